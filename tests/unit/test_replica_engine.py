"""Pipeline replicas in the engine's view: a real Engine and Store under a fake clock. A replica's
later stages leave the policy's view, so a bsp round is one push of the replica (its head) and
one of each data-parallel worker; releasing the head runs the replica's next step (the hook), a
stage's own data-parallel push is dropped, and when a member leaves the survivors come back as
data-parallel workers."""

from __future__ import annotations

import numpy as np
import optax
import pytest

from hetd.core import Engine, EngineConfig
from hetd.core.ingest import decode_hello
from hetd.core.store import Store
from hetd.protocol import wire
from hetd.protocol.messages import Ack, PushIn
from policies import make_policy
from tests.conftest import FakeClock, FakePeer

SHAPES = {"b00/w": (3, 2), "b01/w": (2,)}
CONFIG = EngineConfig(batch_size=8, profile_steps=0)


def _engine(policy: str) -> tuple[Engine, dict[int, FakePeer], list[int]]:
    params = {k: np.zeros(s, np.float32) for k, s in SHAPES.items()}
    engine = Engine(Store(params, optax.sgd(1.0)), make_policy(policy), CONFIG, FakeClock())
    peers: dict[int, FakePeer] = {}
    for name in ("a", "b", "c"):
        peer = FakePeer()
        hello = wire.encode("hello", 1, name=name, device={}, codecs=["none"], features=["stages"])
        peers[engine.join(decode_hello(wire.decode(hello)), peer)] = peer
    steps: list[int] = []
    engine.pipelines.run_step = steps.append
    return engine, peers, steps


def _push(engine: Engine, wid: int, pid: int) -> None:
    grads = {k: np.full(s, 0.5, np.float32) for k, s in SHAPES.items()}
    base = engine.store.version
    engine.push(PushIn(wid, pid, base, "grad", grads, 8, 1, 0.1, None, None, 100))


def _acks(peer: FakePeer) -> list[str]:
    return [r.status for r in peer.replies if isinstance(r, Ack)]


def test_a_replica_is_one_participant_of_a_bsp_round() -> None:
    engine, peers, steps = _engine("bsp")
    a, b, c = peers
    for w in (a, b, c):
        engine.pull(w, None)
    engine.form_replica([a, b])
    assert set(engine.members.facts) == {a, c} and engine.pipelines.view == {a: (a, b)}
    assert engine.workers()[1]["replica"] == [a, 1]
    _push(engine, b, 1)  # stage 1's data-parallel step, ended after it became a stage
    assert _acks(peers[b])[-1] == "dropped" and engine.store.version == 0
    for rnd in range(1, 4):
        _push(engine, a, 10 + rnd)  # the replica's assembled step
        assert engine.store.version == rnd - 1 and steps == [a] * (rnd - 1)  # held by bsp
        _push(engine, c, 10 + rnd)  # ... and the data-parallel worker's: the round is complete
        assert engine.store.version == rnd  # one flush of both
        assert steps == [a] * rnd  # the replica's next step was released, once
    engine.pull(b, None)  # a stage short of its base gets the newest in full, no gate
    assert engine.store.version == 3 and len(peers[b].frames) >= 1


@pytest.mark.parametrize("gone", ["head", "stage"])
def test_a_member_that_leaves_dissolves_the_replica_and_the_rest_rejoin(gone: str) -> None:
    engine, peers, steps = _engine("bsp")
    a, b, c = peers
    engine.form_replica([a, b])
    with pytest.raises(ValueError, match="in a replica already"):
        engine.form_replica([c, b])
    engine.leave(a if gone == "head" else b, "killed")
    assert engine.pipelines.view == {} and set(engine.members.facts) == (
        {b, c} if gone == "head" else {a, c}
    )
    survivor = b if gone == "head" else a
    _push(engine, survivor, 1)
    _push(engine, c, 1)
    assert engine.store.version == 1 and steps == []  # data parallel again: no replica step


def test_a_swap_to_bsp_counts_the_replica_once() -> None:
    engine, peers, steps = _engine("asp")
    a, b, c = peers
    engine.form_replica([a, b])
    _push(engine, a, 1)
    assert steps == [a]  # asp releases the replica at once
    engine.swap_policy("bsp")
    assert set(engine.members.facts) == {a, c}
    _push(engine, a, 2)
    _push(engine, c, 2)
    assert steps == [a, a] and engine.store.version == 2


def test_hetd_replicas_prints_each_replica_that_ran() -> None:
    from hetd.cli.replicas import replicas_text

    row = {"step": 7, "assembled": 6, "aborted": 1, "timeouts": 0, "timeout_s": 30.0}
    reply = {"replica": 0, "members": [3, 1], "gen": 2, **row, "others": []}
    reply["others"] = [{"replica": 1, "members": [], "gen": 1, **row}]
    lines = replicas_text(reply).splitlines()
    assert lines[0].split()[:3] == ["replica", "stages", "gen"]
    assert "3 > 1" in lines[1] and lines[2].split()[:2] == ["1", "-"]  # dissolved, not hidden
    idle = {"replica": 0, "members": [], "gen": 0, **row, "others": []}
    assert replicas_text(idle) == "no pipeline replicas"


def test_hetd_workers_shows_each_replicas_stages() -> None:
    from hetd.cli.admin_text import workers_text

    engine, peers, _ = _engine("bsp")
    a, b, c = peers
    engine.form_replica([b, a])
    lines = workers_text({"workers": engine.workers()}).splitlines()
    assert lines[0].split()[-1] == "REPLICA"
    rows = {int(line.split()[0]): line for line in lines[1:]}
    assert rows[b].endswith(f"{b} > {a} (stage 0)") and rows[a].endswith(f"{b} > {a} (stage 1)")
    assert rows[c].endswith(" -")  # data parallel


def test_a_dissolved_replicas_head_does_not_keep_the_replicas_timings() -> None:
    """A replica's pushes carry the whole replica's step time (its first one the stages'
    compiles): once it dissolves, its head's own speed is unknown again, not that."""
    engine, peers, _ = _engine("bsp")
    a, b, _c = peers
    engine.form_replica([a, b])
    grads = {k: np.full(s, 0.5, np.float32) for k, s in SHAPES.items()}
    engine.push(PushIn(a, 1, 0, "grad", grads, 8, 1, 30.0, None, None, 100))  # 30 s: compiles
    assert engine.members.entries[a].facts.sample_s == 30.0 / 8
    engine.dissolve_replica(a, "regrouped")
    facts = engine.members.facts[a]
    assert facts.sample_s is None and facts.compute_s is None
