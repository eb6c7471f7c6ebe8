"""The engine as a table of events -> what each worker is sent, and the version after.

A real :class:`~hetd.core.engine.Engine` and :class:`~hetd.core.store.Store` (a two-tensor model,
plain SGD) under a fake clock; each worker's peer records the engine's typed replies
(:mod:`hetd.protocol.messages`), the versions of the parameter frames it is sent, and why its
session was closed. A row is ``(event, {worker: what it got}, version)``; events are ``join a``,
``join a resume 1``, ``push a``, ``push a base 5``, ``pull a``, ``leave a``, ``tick +11`` (the
clock moves 11 s first) and ``swap asp``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import optax
import pytest

from hetd.core import Engine, EngineConfig, EngineState
from hetd.core.ingest import decode_hello
from hetd.core.saved import SavedWorker
from hetd.core.store import Store
from hetd.protocol import wire
from hetd.protocol.messages import (
    Ack,
    Bye,
    JoinIn,
    PlanUpdate,
    ProfileRequest,
    PushIn,
    Welcome,
)
from policies import ClusterView, Policy, make_policy
from policies.types import Event, Join, SetPlan
from tests.conftest import FakeClock

SHAPES = {"dense/w": (3, 2), "dense/b": (2,)}
CONFIG = EngineConfig(batch_size=8, profile_steps=0, heartbeat_timeout_s=10.0, max_staleness=4)


class RecordingPeer:
    """A worker's outbox that keeps, in order, a short line per thing the engine sends it."""

    def __init__(self) -> None:
        self.got: list[str] = []
        self.replies: list[Any] = []

    def send(self, reply: Any) -> None:
        self.replies.append(reply)
        if isinstance(reply, Welcome):
            self.got.append(f"welcome {reply.worker_id}")
        elif isinstance(reply, Ack):
            self.got.append(f"ack {reply.status}" + (f": {reply.reason}" if reply.reason else ""))
        elif isinstance(reply, PlanUpdate):
            self.got.append(f"plan batch {reply.plan.batch_size}")
        elif isinstance(reply, ProfileRequest):
            self.got.append(f"profile {reply.steps}")
        elif isinstance(reply, Bye):
            self.got.append(f"bye: {reply.reason}")
        else:
            raise AssertionError(f"not a reply: {reply!r}")

    def send_params(self, frame: bytes, *, full: bool) -> None:
        msg = wire.decode(frame)
        assert msg.type == "params" and msg["full"] == full
        self.got.append(f"params v{msg['version']}")

    def close(self, reason: str) -> None:
        self.got.append(f"closed: {reason}")


def hello(name: str, resume: int | None = None, secret: str | None = None) -> JoinIn:
    fields: dict[str, Any] = {"name": name, "device": {"platform": "cpu"}, "codecs": ["none"]}
    if resume is not None:
        fields["resume"] = {"worker_id": resume, "secret": secret}
    return decode_hello(wire.decode(wire.encode("hello", 7, **fields)))


@dataclass
class Harness:
    """An engine and its workers by name."""

    engine: Engine
    clock: FakeClock
    peers: dict[str, RecordingPeer]
    ids: dict[str, int]
    pushes: int = 0  # request ids of pushes, increasing (a repeated id is a duplicate)

    @classmethod
    def of(cls, policy: Policy, config: EngineConfig = CONFIG) -> Harness:
        params = {k: np.zeros(s, np.float32) for k, s in SHAPES.items()}
        clock = FakeClock()
        engine = Engine(Store(params, optax.sgd(1.0)), policy, config, clock)
        return cls(engine, clock, {}, {})

    def run(self, event: str) -> dict[str, list[str]]:
        """Do one event; what each worker got meanwhile (workers that got nothing left out)."""
        for peer in self.peers.values():
            peer.got.clear()
        verb, name, *rest = event.split()
        e = self.engine
        if verb == "join":
            old = self.peers.get(name)
            self.peers[name] = RecordingPeer()
            resume = int(rest[1]) if rest[:1] == ["resume"] else None
            # a resuming worker shows the secret its last welcome gave it
            welcomes = [r for r in old.replies if isinstance(r, Welcome)] if old else []
            secret = welcomes[-1].secret if welcomes else None
            self.ids[name] = e.join(hello(name, resume, secret), self.peers[name])
        elif verb == "push":
            wid = self.ids[name]
            base = int(rest[1]) if rest[:1] == ["base"] else e.members.facts[wid].version
            grads = {k: np.full(s, 0.5, np.float32) for k, s in SHAPES.items()}
            self.pushes += 1
            e.push(PushIn(wid, self.pushes, base, "grad", grads, 8, 1, 0.1, None, None, 100))
        elif verb == "pull":
            e.pull(self.ids[name], e.members.facts[self.ids[name]].version)
        elif verb == "leave":
            e.leave(self.ids[name], "bye")
        elif verb == "tick":
            self.clock.t += float(name)
            e.tick()
        elif verb == "swap":
            e.swap_policy(name)
        else:
            raise AssertionError(f"unknown event {event!r}")
        return {n: list(p.got) for n, p in self.peers.items() if p.got}


def plan_on_join(batch: int) -> Policy:
    """ASP that gives every joiner a plan of ``batch`` samples."""
    asp = make_policy("asp")

    def update(event: Event, state: Any, view: ClusterView) -> tuple[Sequence[Any], Any]:
        out, state = asp.update(event, state, view)
        if isinstance(event, Join):
            out = [SetPlan(event.worker, {"batch_size": batch}), *out]
        return out, state

    return Policy("plan-on-join", asp.init, update, {})


Row = tuple[str, dict[str, list[str]], int]

TABLES: dict[str, tuple[Policy, list[Row]]] = {
    "asp: a joiner is welcomed and released; each push is applied and answered": (
        make_policy("asp"),
        [
            ("join a", {"a": ["welcome 1", "params v0"]}, 0),
            ("push a", {"a": ["ack applied", "params v1"]}, 1),
            ("push a", {"a": ["ack applied", "params v2"]}, 2),
        ],
    ),
    "bsp: the first push of a round waits in the buffer, the second applies both": (
        make_policy("bsp"),
        [
            ("join a", {"a": ["welcome 1", "params v0"]}, 0),
            ("join b", {"b": ["welcome 2", "params v0"]}, 0),
            ("push a", {"a": ["ack buffered"]}, 0),
            ("pull a", {}, 0),  # a pull before the round is done: nothing yet
            ("push b", {"a": ["params v1"], "b": ["ack buffered", "params v1"]}, 1),
            ("push b", {"b": ["ack buffered"]}, 1),
            ("push a", {"a": ["ack buffered", "params v2"], "b": ["params v2"]}, 2),
        ],
    ),
    "bsp: a leaver leaves the barrier; the round completes without it": (
        make_policy("bsp"),
        [
            ("join a", {"a": ["welcome 1", "params v0"]}, 0),
            ("join b", {"b": ["welcome 2", "params v0"]}, 0),
            ("push a", {"a": ["ack buffered"]}, 0),
            ("leave b", {"a": ["params v1"], "b": ["closed: bye"]}, 1),
            ("push a", {"a": ["ack buffered", "params v2"]}, 2),
        ],
    ),
    "a push from the future or too stale is dropped with the reason": (
        make_policy("asp"),
        [
            ("join a", {"a": ["welcome 1", "params v0"]}, 0),
            ("push a base 5", {"a": ["ack dropped: base version from the future", "params v0"]}, 0),
            ("push a", {"a": ["ack applied", "params v1"]}, 1),
            ("push a", {"a": ["ack applied", "params v2"]}, 2),
            ("push a base -3", {"a": ["ack dropped: too stale", "params v2"]}, 2),
        ],
    ),
    "ssp: a worker more than `staleness` ahead waits for the slowest": (
        make_policy("ssp", {"staleness": 1}),
        [
            ("join a", {"a": ["welcome 1", "params v0"]}, 0),
            ("join b", {"b": ["welcome 2", "params v0"]}, 0),
            ("push a", {"a": ["ack applied", "params v1"]}, 1),  # 1 ahead: allowed
            ("push a", {"a": ["ack applied"]}, 2),  # 2 ahead: held
            ("pull a", {}, 2),
            ("push b", {"a": ["params v3"], "b": ["ack applied", "params v3"]}, 3),
        ],
    ),
    "a silent worker times out and leaves; a returning one gets its id and clock back": (
        make_policy("bsp"),
        [
            ("join a", {"a": ["welcome 1", "params v0"]}, 0),
            ("join b", {"b": ["welcome 2", "params v0"]}, 0),
            ("push a", {"a": ["ack buffered"]}, 0),
            # (each has a push answered: a worker without one leaves nothing behind to resume)
            ("push b", {"a": ["params v1"], "b": ["ack buffered", "params v1"]}, 1),
            ("push a", {"a": ["ack buffered"]}, 1),
            (
                "tick +11",
                {"a": ["closed: heartbeat timeout"], "b": ["closed: heartbeat timeout"]},
                2,
            ),
            ("join b resume 2", {"b": ["welcome 2", "params v2"]}, 2),
            ("join a resume 1", {"a": ["welcome 1"]}, 2),  # its clock 2 is a round ahead
            ("push b", {"a": ["params v3"], "b": ["ack buffered", "params v3"]}, 3),
        ],
    ),
    "a policy's plan goes out as a plan reply before the worker's parameters": (
        plan_on_join(16),
        [
            ("join a", {"a": ["welcome 1", "plan batch 16", "params v0"]}, 0),
            ("push a", {"a": ["ack applied", "params v1"]}, 1),
        ],
    ),
    "a swap keeps buffered pushes: they are applied before the new policy takes over": (
        make_policy("bsp"),
        [
            ("join a", {"a": ["welcome 1", "params v0"]}, 0),
            ("join b", {"b": ["welcome 2", "params v0"]}, 0),
            ("push a", {"a": ["ack buffered"]}, 0),
            ("swap asp", {"a": ["params v1"]}, 1),
            ("push b", {"b": ["ack applied", "params v2"]}, 2),
        ],
    ),
}


@pytest.mark.parametrize("name", list(TABLES))
def test_event_table(name: str) -> None:
    policy, rows = TABLES[name]
    h = Harness.of(policy)
    for i, (event, replies, version) in enumerate(rows):
        got = h.run(event)
        assert (got, h.engine.store.version) == (replies, version), f"row {i}: {event}"


def test_a_join_is_welcomed_with_the_plan_shard_and_setup_and_asked_for_a_profile() -> None:
    setup = {"model": {"spec": "mlp"}, "dataset": {"spec": "digits"}, "train": {"seed": 1}}
    config = EngineConfig(batch_size=8, profile_steps=3, shards=2, welcome=setup)
    h = Harness.of(make_policy("bsp"), config)
    h.run("join a")
    h.run("join b")
    welcome, profile = h.peers["b"].replies
    assert isinstance(welcome, Welcome) and isinstance(profile, ProfileRequest)
    assert (welcome.id, welcome.worker_id, welcome.shard, welcome.shards) == (7, 2, 1, 2)
    assert welcome.plan.batch_size == 8 and welcome.setup == setup
    assert profile.spec() == {"steps": 3, "batch_size": 8}
    h.engine.profile_result(2, {"sample_s": 0.01, "push_s": -1.0, "bogus": 3.0})
    assert h.engine.members.facts[2].profile == {
        "sample_s": 0.01
    }  # negative and unknown keys dropped


def test_a_departed_worker_keeps_its_entry_out_of_the_view() -> None:
    h = Harness.of(make_policy("asp"))
    h.run("join a")
    h.run("join b")
    h.run("push b")
    h.run("leave b")
    e = h.engine
    assert set(e.members.facts) == set(e.members.entries) == set(e.members.plans) == {1}
    assert set(e.members.departed) == {2} and e.members.departed[2].clock == 1
    assert (
        set(e.members.stats) == {1, 2} and e.members.stats[2].pushes == 1
    )  # its counters stay counted
    assert e.view().workers == {1: e.members.facts[1]}
    assert [row["worker"] for row in e.workers()] == [1] and e.status()["workers"] == 1


def test_bye_all_says_bye_and_lets_everyone_leave() -> None:
    h = Harness.of(make_policy("asp"))
    for event in ("join a", "join b", "push a", "push b"):
        h.run(event)
    h.engine.bye_all("daemon stopping")
    for name in "ab":
        assert h.peers[name].got[-2:] == ["bye: daemon stopping", "closed: daemon stopping"]
    assert not h.engine.members.facts and set(h.engine.members.departed) == {1, 2}


def test_state_and_restore_round_trip_in_memory() -> None:
    h = Harness.of(make_policy("bsp"))
    for event in ("join a", "join b", "push a", "push b", "push a", "leave b"):
        h.run(event)
    st = h.engine.state()
    assert isinstance(st, EngineState)
    assert (st.version, st.updates_applied, st.next_id, st.policy) == (2, 2, 3, "bsp")
    assert all(w.secret for w in st.workers.values())  # each its own random secret
    assert {wid: dataclasses.replace(w, secret="") for wid, w in st.workers.items()} == {
        2: SavedWorker("b", 1, samples=8, batch_size=8, active=False, last_push=2),
        1: SavedWorker("a", 2, samples=16, batch_size=8, active=True, last_push=3),
    }
    assert not st.buffers  # the leave completed a's round
    fresh = Harness.of(make_policy("asp"))
    fresh.engine.restore(st)
    e = fresh.engine
    assert (e.store.version, e.applier.updates_applied, e.host.policy.name) == (2, 2, "bsp")
    assert not e.members.facts and {w: f.clock for w, f in e.members.departed.items()} == {
        1: 2,
        2: 1,
    }
    for k, v in h.engine.store.snapshot().tensors.items():
        np.testing.assert_array_equal(e.store.snapshot().tensors[k], v)
    assert fresh.run("join x") == {"x": ["welcome 3", "params v2"]}  # new ids after the saved


def test_restore_refuses_parameters_of_another_model_before_changing_anything() -> None:
    h = Harness.of(make_policy("asp"))
    st = h.engine.state()
    other = {"dense/w": np.zeros((4, 2), np.float32), "dense/b": np.zeros(2, np.float32)}
    bad = EngineState(**{**{f: getattr(st, f) for f in st.__slots__}, "params": other})
    with pytest.raises(ValueError, match="do not match"):
        h.engine.restore(bad)
    assert h.engine.host.stage == "main" and h.engine.host.policy.name == "asp"


def test_decode_hello_reads_what_the_engine_needs() -> None:
    msg = wire.decode(
        wire.encode(
            "hello",
            9,
            name="w",
            device={"platform": "gpu", "free_memory": 1 << 30},
            codecs=["int8", "none"],
            resume={"worker_id": 4},
        )
    )
    assert decode_hello(msg, same_host=True) == JoinIn(
        id=9,
        name="w",
        device={"platform": "gpu", "free_memory": 1 << 30},
        codecs=("int8", "none"),
        resume_id=4,
        free_mem=1 << 30,
        same_host=True,
    )
    odd = wire.decode(
        wire.encode(
            "hello",
            1,
            name="w",
            device={"free_memory": "lots"},
            codecs=["none"],
            resume={"worker_id": "x"},
        )
    )
    assert (decode_hello(odd).resume_id, decode_hello(odd).free_mem) == (None, None)


def test_evaluations_keep_to_their_grid_from_the_anchor() -> None:
    """At a fixed rate from ``evaluations.anchor``: a tick that comes late (ticks are 0.25 s apart) does
    not move the later points, and a point missed entirely is skipped, not caught up."""
    config = dataclasses.replace(CONFIG, eval_interval_s=0.5, eval_inline=True)
    h = Harness.of(make_policy("asp"), config)
    h.engine.evaluations.evaluator = lambda snap: (0.0, 0.5)
    h.clock.t = 10.0
    h.engine.evaluations.anchor(10.0)
    for t in (10.3, 10.6, 10.9, 11.05, 12.3, 12.4, 12.55):
        h.clock.t = t
        h.engine.tick()
    started = h.engine.started_at
    assert [round(t + started, 2) for t, _, _ in h.engine.evaluations.evals] == [
        10.6,
        11.05,
        12.3,
        12.55,
    ]


def test_a_worker_link_is_the_fastest_of_its_recent_pushes() -> None:
    """A busy host only makes a transfer look slower: the link estimate is the max of the last
    pushes' rates, so one slow reading does not halve it, and a link that really slowed down is
    read once its fast readings have left the window."""
    from hetd.core.entries import LINK_WINDOW, WorkerStats
    from hetd.core.members import link_rate as rate

    st = WorkerStats()
    assert rate(st, 1_000_000, None, None) is None  # no stamp: nothing known
    assert rate(st, 1_000_000, 0.01, None) == pytest.approx(1e8)
    assert rate(st, 1_000_000, 0.05, 1e8) == pytest.approx(1e8)  # a slow reading: unchanged
    for _ in range(LINK_WINDOW):  # the link itself became 10x slower
        got = rate(st, 1_000_000, 0.1, 1e8)
    assert got == pytest.approx(1e7)


def test_each_push_of_a_pipelined_worker_is_answered_with_a_frame() -> None:
    """A pipelined worker (hps) computes its next step while its last push waits for a release,
    and counts each push until a ``params`` frame answers it. When that next push joins a wait
    still open, the one release ending the wait brings an empty frame for it too: with one frame,
    the worker counted a push in flight for good and never again computed with one in flight (the
    simulator's hps and real runs lost the lead this way, each worker from its first such wait)."""
    h = Harness.of(make_policy("hps", {"quantize": False}))
    h.run("join a")
    h.run("join b")
    frames: list[str] = []
    for event in ["push a", "push a", "push a", "push b", "push b"]:
        frames += [g for g in h.run(event).get("a", []) if g.startswith("params")]
    # push 1 is released at once (one round ahead); pushes 2 and 3 wait together for b's rounds
    assert len(frames) == 3, frames
    assert frames[1] == frames[2]  # the empty frame: the same version, nothing to apply
