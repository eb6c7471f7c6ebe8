"""A policy hot swap is all or nothing: either the new policy runs with every plan rebuilt from
its first decisions (fields it does not set back at their defaults), or the swap is refused and
the old policy, its state, the stage and every plan are untouched."""

from __future__ import annotations

from typing import Any

import numpy as np
import optax
import pytest

from hetd.core import Engine, EngineConfig
from hetd.core.commands import EvalDone
from hetd.core.store import Store
from hetd.protocol.messages import JoinIn, PlanUpdate, PushIn
from policies import ClusterView, Plan, Policy, PolicyError, make_policy, policy_names, register
from tests.conftest import FakeClock, FakePeer

SHAPES = {"dense/w": (3, 2), "dense/b": (2,)}
CONFIG = EngineConfig(batch_size=16, profile_steps=0)


def exploding() -> Policy:
    """A policy whose first decision raises (a plug-in bug)."""

    def init(view: ClusterView) -> None:
        return None

    def update(event: Any, state: None, view: ClusterView) -> tuple[list[Any], None]:
        raise RuntimeError("boom")

    return Policy("test-explodes", init, update, {})


def exploding_init() -> Policy:
    def init(view: ClusterView) -> None:
        raise RuntimeError("no init")

    return Policy("test-explodes-init", init, lambda e, s, v: ([], s), {})


if "test-explodes" not in policy_names():
    register("test-explodes")(exploding)
    register("test-explodes-init")(exploding_init)


def ashl_in_shl() -> tuple[Engine, dict[int, FakePeer]]:
    """ashl with three profiled workers, one of them departed, in its SHL stage: local steps,
    top-k pushes, lr scales and data shares in every plan."""
    params = {k: np.zeros(s, np.float32) for k, s in SHAPES.items()}
    clock = FakeClock()
    policy = make_policy("ashl", {"switch_loss": 10.0})
    e = Engine(Store(params, optax.sgd(0.1)), policy, CONFIG, clock)
    peers: dict[int, FakePeer] = {}
    for i, sample_s in enumerate((0.001, 0.002, 0.004)):
        peer = FakePeer()
        wid = e.join(JoinIn(1, f"w{i}", {}, ("none",)), peer)
        peers[wid] = peer
        profile = {"sample_s": sample_s, "push_s": 0.01, "pull_s": 0.01, "compress_s": 0.001}
        e.profile_result(wid, profile)
    for n, wid in enumerate(peers, start=1):
        tensors = {k: np.full(s, 0.01, np.float32) for k, s in SHAPES.items()}
        e.push(PushIn(wid, n, e.store.version, "delta", tensors, 8, 2, 0.1, None, None, 1))
    clock.t += 1
    e.handle(EvalDone((1.0, 0.5)))  # below switch_loss: AHL -> SHL
    e.leave(max(peers), "gone")
    assert e.host.stage == "SHL" and len(e.members.facts) == 2 and len(e.members.departed) == 1
    assert all(p.codec == "topk" and p.local_steps >= 1 for p in e.members.plans.values())
    assert all(p.data_share is not None and p.lr_scale != 1.0 for p in e.members.plans.values())
    return e, peers


def test_a_swap_to_asp_puts_every_plan_back_to_its_defaults() -> None:
    e, peers = ashl_in_shl()
    for p in peers.values():
        p.replies.clear()
    e.swap_policy("asp")
    assert e.host.policy.name == "asp" and e.host.stage == "main"
    for wid, plan in e.members.plans.items():
        assert plan == Plan(batch_size=16, codec="none", stage="main"), (wid, plan)
        assert e.members.facts[wid].batch_size == 16
        updates = [r for r in peers[wid].replies if isinstance(r, PlanUpdate)]
        assert [u.plan for u in updates] == [plan]  # told once, the whole new plan
    assert [at_stage for _, at_stage in e.host.stages][-1] == "main"


def test_a_swap_to_ashl_again_starts_it_over_from_its_own_plans() -> None:
    e, _ = ashl_in_shl()
    e.swap_policy("ashl", {"staleness": 2})
    assert e.host.stage in ("profile", "AHL")  # its init's stage, announced by its first decisions
    assert all(p.codec == "none" and p.topk == 1.0 for p in e.members.plans.values())


@pytest.mark.parametrize(
    ("name", "params"),
    [
        ("nope", None),
        ("ssp", {"staleness": -1}),
        ("ssp", {"stalenes": 2}),
        ("test-explodes", None),
        ("test-explodes-init", None),
    ],
)
def test_a_refused_swap_changes_nothing(name: str, params: dict[str, Any] | None) -> None:
    e, peers = ashl_in_shl()

    def seen() -> tuple[Any, ...]:
        m = e.members
        return (
            e.host.policy,
            e.host.state,
            e.host.stage,
            dict(m.plans),
            dict(m.facts),
            e.store.version,
        )

    before = seen()
    sent = {wid: len(p.replies) for wid, p in peers.items()}
    with pytest.raises(PolicyError):
        e.swap_policy(name, params)
    assert seen() == before
    assert e.host.state is before[1]
    assert {wid: len(p.replies) for wid, p in peers.items()} == sent  # nothing sent to anyone


def test_a_swap_starts_every_worker_on_the_same_round() -> None:
    """Under asp a fast worker runs rounds ahead; after a swap to bsp the first round is one
    push from each worker, not a wait until the slow one has caught up."""
    params = {k: np.zeros(s, np.float32) for k, s in SHAPES.items()}
    e = Engine(Store(params, optax.sgd(0.1)), make_policy("asp", {}), CONFIG, FakeClock())
    fast, slow = FakePeer(), FakePeer()
    wf = e.join(JoinIn(1, "fast", {}, ("none",)), fast)
    ws = e.join(JoinIn(1, "slow", {}, ("none",)), slow)
    tensors = {k: np.full(s, 0.01, np.float32) for k, s in SHAPES.items()}

    def push(wid: int, n: int) -> None:
        e.push(PushIn(wid, n, e.store.version, "grad", dict(tensors), 16, 1, 0.01, None, None, 1))

    for n in range(1, 6):
        push(wf, n)
    push(ws, 1)
    assert e.members.facts[wf].clock - e.members.facts[ws].clock == 4
    e.swap_policy("bsp")
    assert e.members.facts[wf].clock == e.members.facts[ws].clock
    version, sent = e.store.version, (len(fast.frames), len(slow.frames))
    push(wf, 6)
    push(ws, 2)
    assert e.store.version == version + 1  # one round: both pushes in one step
    assert len(fast.frames) > sent[0] and len(slow.frames) > sent[1]  # both released at once


SEEN: list[ClusterView] = []  # the views test-sees was initialised with


def sees() -> Policy:
    """asp that keeps the view it starts on."""
    asp = make_policy("asp")

    def init(view: ClusterView) -> Any:
        SEEN.append(view)
        return asp.init(view)

    return Policy("test-sees", init, asp.update, {})


if "test-sees" not in policy_names():
    register("test-sees")(sees)


def _adam_engine(policy: Policy) -> Engine:
    """An engine whose workers train with Adam (as the welcome tells them), one worker joined."""
    params = {k: np.zeros(s, np.float32) for k, s in SHAPES.items()}
    welcome = {"train": {"inner_optimizer": "adam:lr=0.01"}}
    config = EngineConfig(batch_size=16, profile_steps=0, welcome=welcome)
    e = Engine(Store(params, optax.adam(0.01)), policy, config, FakeClock())
    e.join(JoinIn(1, "w", {}, ("none",)), FakePeer())
    return e


def test_a_policy_swapped_in_sees_what_the_engine_knows_of_the_model_and_the_training() -> None:
    """The trial view a swap starts a policy on carries the engine's own view of the workers'
    optimizer, the model's blocks and the noise scale: a policy swapped in decides as one built
    at the start would (auto warms up as its optimizer family asks)."""
    e = _adam_engine(make_policy("asp"))
    SEEN.clear()
    e.swap_policy("test-sees")
    live = e.view()
    assert live.optimizer == "adam:lr=0.01"
    assert [(v.optimizer, v.blocks, v.noise_scale) for v in SEEN] == [
        (live.optimizer, live.blocks, live.noise_scale)
    ]


def test_auto_swapped_into_an_adam_daemon_warms_up_as_it_does_from_the_start() -> None:
    cands = {"candidates": "asp,ashl,lbbsp"}
    started = _adam_engine(make_policy("auto", cands))
    e = _adam_engine(make_policy("asp"))
    e.swap_policy("auto", cands)
    assert started.host.state.name == "ashl" and started.host.state.warming
    assert e.host.state.name == started.host.state.name and e.host.state.warming
