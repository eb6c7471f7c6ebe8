"""Every built-in policy's state survives a checkpoint: the restored engine runs the same policy
with the same state, its engine-clock times moved to the new process's clock (times are kept
relative to the checkpoint), and ashl and adsp resume in the stage they were in."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import optax
import pytest

from hetd.core import Engine, EngineConfig
from hetd.core.commands import EvalDone
from hetd.core.store import Store
from hetd.protocol.messages import JoinIn, PushIn
from hetd.server import checkpoint
from hetd.server.policy_state import shift_times
from policies import make_policy
from policies.registry import _REGISTRY, policy_names
from tests.conftest import FakeClock, FakePeer

SHAPES = {"dense/w": (3, 2), "dense/b": (2,)}
PARAMS: dict[str, dict[str, Any]] = {
    "ashl": {"switch_loss": 10.0},  # into SHL at the first evaluation
    "adsp": {"period_s": 0.5},
}
BUILT_IN = sorted(
    n for n in policy_names() if getattr(_REGISTRY[n], "__module__", "").startswith("policies.")
)


def make_engine(name: str, clock: FakeClock) -> Engine:
    params = {k: np.zeros(s, np.float32) for k, s in SHAPES.items()}
    policy = make_policy(name, PARAMS.get(name))
    return Engine(Store(params, optax.sgd(0.01)), policy, EngineConfig(profile_steps=0), clock)


def drive(e: Engine, clock: FakeClock) -> None:
    """Three workers of different speeds join with profiles, push for a while (with losses),
    evaluations come in, and one worker leaves."""
    ids = []
    for i in range(3):
        wid = e.join(JoinIn(1, f"w{i}", {}, ("none",)), FakePeer())
        ids.append(wid)
        e.profile_result(
            wid, {"sample_s": 1e-3 * (i + 1), "push_s": 0.01, "pull_s": 0.01, "compress_s": 0.0}
        )
    n = 0
    for r in range(12):
        for i, wid in enumerate(ids):
            clock.t += 0.05 * (i + 1)
            n += 1
            tensors = {k: np.full(s, 1e-3, np.float32) for k, s in SHAPES.items()}
            kind = "delta" if e.members.plans[wid].push_kind == "delta" else "grad"
            loss = 2.0 / (1 + r)
            e.push(PushIn(wid, n, e.store.version, kind, tensors, 8, 1, 0.05, loss, None, 1))
        e.tick()
        if r % 3 == 2:
            e.handle(EvalDone((2.0 / (1 + r), 0.5)))
    e.leave(ids[-1], "gone")


@pytest.mark.parametrize("name", BUILT_IN)
def test_a_policy_state_round_trips_through_a_checkpoint(name: str) -> None:
    clock = FakeClock()
    e = make_engine(name, clock)
    drive(e, clock)
    state = checkpoint.engine_state(e)
    data = checkpoint.encode(state)
    later = FakeClock()
    later.t = 5000.0  # a new process: its clock started elsewhere
    fresh = make_engine(name, later)
    checkpoint.restore_engine(fresh, checkpoint.decode(data))
    dt = later.t - clock.t
    assert fresh.host.policy.describe() == e.host.policy.describe()
    assert type(fresh.host.state) is type(e.host.state)
    assert fresh.host.state == shift_times(e.host.state, dt)
    assert fresh.host.stage == e.host.stage


def test_ashl_resumes_in_its_stage_with_times_relative_to_the_checkpoint() -> None:
    clock = FakeClock()
    e = make_engine("ashl", clock)
    drive(e, clock)
    st = e.host.state
    assert st.stage == "SHL" and e.host.stage == "SHL" and st.plans
    later = FakeClock()
    later.t = 7.0
    fresh = make_engine("ashl", later)
    checkpoint.restore_engine(
        fresh, checkpoint.decode(checkpoint.encode(checkpoint.engine_state(e)))
    )
    got = fresh.host.state
    assert got.stage == "SHL" and fresh.host.stage == "SHL"
    assert got.plans == st.plans and got.commits == st.commits and got.switch == st.switch
    # each time is as long before the restore as it was before the checkpoint
    for (s1, t1), (s2, t2) in zip(st.transitions, got.transitions, strict=True):
        assert s1 == s2 and math.isclose(clock.t - t1, later.t - t2)
    for w, track in st.tracks.items():
        if track.profile is not None:
            assert math.isclose(clock.t - track.profile.at, later.t - got.tracks[w].profile.at)
    # and it carries on: a returning worker is planned in SHL
    wid = fresh.join(JoinIn(1, "new", {}, ("none",)), FakePeer())
    fresh.profile_result(wid, {"sample_s": 1e-3, "push_s": 0.01, "pull_s": 0.01})
    fresh.tick()
    assert fresh.host.state.stage == "SHL" and fresh.members.plans[wid].stage == "SHL"


def test_adsp_resumes_its_period_relative_to_the_checkpoint() -> None:
    clock = FakeClock()
    e = make_engine("adsp", clock)
    drive(e, clock)
    st = e.host.state
    assert st.stage == "ADSP"
    later = FakeClock()
    later.t = 3.0
    fresh = make_engine("adsp", later)
    checkpoint.restore_engine(
        fresh, checkpoint.decode(checkpoint.encode(checkpoint.engine_state(e)))
    )
    got = fresh.host.state
    assert got.stage == "ADSP" and got.search == st.search and got.quota == st.quota
    assert math.isclose(clock.t - st.period_start, later.t - got.period_start)
    for w, t in st.last_push.items():
        assert math.isclose(clock.t - t, later.t - got.last_push[w])
