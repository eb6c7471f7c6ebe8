"""The engine's parts, each alone (no :class:`~hetd.core.engine.Engine`): the worker table, the
applier, the policy host, the replicas and the publisher. The engine's own tests
(tests/unit/test_engine.py) cover how it routes between them."""

from __future__ import annotations

import asyncio
import math

import numpy as np
import optax
import pytest

from hetd.codecs.registry import CodecError
from hetd.core import commands as cmd
from hetd.core.applier import Applier
from hetd.core.decisions import LogMismatch
from hetd.core.entries import EngineConfig
from hetd.core.execute import Executor
from hetd.core.guard import UpdateGuard
from hetd.core.intake import Intake
from hetd.core.members import Members
from hetd.core.policy_host import PolicyHost
from hetd.core.publish import Publisher
from hetd.core.queue import CommandQueue
from hetd.core.rates import MB, Meters
from hetd.core.replicas import Replicas
from hetd.core.store import Store
from hetd.protocol import wire
from hetd.protocol.messages import Ack, ErrorReply, JoinIn, PushIn, ShardUpdate
from hetd.pserver.log import DecisionLog, DropEntry
from policies import make_policy
from policies.compose import resolve
from policies.registry import PolicyError
from policies.types import (
    Buffer,
    ClusterView,
    Flush,
    Join,
    Leave,
    Plan,
    Policy,
    Pull,
    Push,
    Release,
    SetPlan,
    Tick,
)
from tests.conftest import FakeClock, FakePeer

SHAPES = {"w": (3,), "b": (1,)}


def hello(name: str, *features: str, **kw: object) -> JoinIn:
    return JoinIn(id=1, name=name, device={}, codecs=("none",), features=frozenset(features), **kw)  # type: ignore[arg-type]


def members(**config: object) -> tuple[Members, FakeClock]:
    clock = FakeClock()
    return Members(EngineConfig(**config), clock, clock.now()), clock  # type: ignore[arg-type]


def admit(m: Members, name: str, *features: str, **kw: object) -> tuple[int, FakePeer]:
    peer = FakePeer()
    entry = m.admit(hello(name, *features, **kw), peer, "none", Plan(batch_size=32))
    m.shard_for(entry)
    return entry.facts.worker, peer


def store() -> Store:
    return Store({k: np.zeros(s, np.float32) for k, s in SHAPES.items()}, optax.sgd(1.0))


def test_applier_tells_a_decision_log_each_decision_and_keeps_its_version() -> None:
    st = store()
    log = DecisionLog()
    ap = Applier(st, log)
    one = {"w": np.ones(3, np.float32), "b": np.ones(1, np.float32)}
    ap.apply("grad", one, 0.5, (1, 1))
    ap.buffer(2, "grad", one, 0.5, (1, 2))
    ap.buffer(2, "delta", one, 0.5, (2, 1))
    ap.flush(Flush(upto=1))  # nothing due: nothing logged
    ap.discard(2, 2)
    ap.flush(Flush())
    st.flush()
    st.flush()  # nothing queued: no second step
    ops = [(type(r.entry).__name__, r.version) for r in log.since(0)]
    assert ops == [
        ("ApplyEntry", 1),
        ("BufferEntry", 1),
        ("BufferEntry", 1),
        ("DropEntry", 1),
        ("FlushEntry", 3),  # a grad and a delta: one version each
        ("StepEntry", 3),
    ]
    assert st.version == log.version == 3
    with pytest.raises(ValueError, match="must name its push"):
        ap.apply("grad", one, 1.0)
    log.version += 1  # a log that miscounts is caught at the next decision
    with pytest.raises(LogMismatch, match="the store at 4"):
        ap.apply("grad", one, 1.0, (1, 3))


def test_members_admit_resume_by_secret_and_leave() -> None:
    m, clock = members()
    a, pa = admit(m, "a")
    b, _ = admit(m, "b")
    assert (a, b) == (1, 2) and set(m.facts) == {a, b}
    assert [m.active[w].stats.slot for w in (a, b)] == [0, 1]
    m.update(m.active[a], clock=7)
    m.active[a].last_push = 1  # a push of it was answered: it is kept to resume
    clock.t += 5
    gone = m.remove(a, "bye", None)
    assert gone is not None and gone[1] and pa.closed == "bye"
    assert set(m.facts) == {b} and m.departed[a].clock == 7
    assert m.departures[-1] == (5.0, a, "bye")
    assert m.remove(a, "again", None) is None  # not active: nothing happens
    secret = m.gone[a].secret
    wrong, _ = admit(m, "a", resume_id=a, resume_secret="guess")
    assert wrong == 3 and a in m.gone  # a wrong secret: a new worker
    back, _ = admit(m, "a", resume_id=a, resume_secret=secret)
    assert back == a and m.active[a].facts.clock == 7 and m.active[a].secret == secret
    assert m.active[a].stats.slot == 2  # the first free slot (the wrong one took slot 0)


def test_members_hide_keeps_a_worker_out_of_the_view_only() -> None:
    m, _ = members()
    a, _ = admit(m, "a")
    assert m.hide(a) and a not in m.facts and a in m.entries
    m.update(m.active[a], clock=3)
    assert a not in m.facts  # a hidden worker's facts change in its entry only
    m.show(a)
    assert m.facts[a].clock == 3
    gone = m.remove(a, "x", None)
    assert gone is not None and gone[1]  # it was in the view again


def test_members_recut_one_shard_per_resharding_worker() -> None:
    m, _ = members(recut_shards=True)
    a, pa = admit(m, "a", "reshard")
    b, pb = admit(m, "b", "reshard")
    assert m.active[a].shard == (0, 1) and m.active[b].shard == (1, 2)
    m.send_cuts(m.recut(), but=b)
    assert pa.replies == [ShardUpdate(0, 2)] and pb.replies == []
    m.remove(a, "bye", None)
    m.send_cuts(m.recut())
    assert pb.replies == [ShardUpdate(0, 1)]


def test_members_profile_keeps_finite_known_keys_only() -> None:
    m, _ = members()
    a, _ = admit(m, "a")
    assert m.profiled(a, {"sample_s": 0.5, "push_s": math.nan, "odd": 1.0, "pull_s": -1})
    assert m.facts[a].profile == {"sample_s": 0.5}
    assert not m.profiled(99, {"sample_s": 1.0})


def test_applier_buffers_flush_by_group_and_round_trip() -> None:
    ap = Applier(store())
    one = {"w": np.ones(3, np.float32), "b": np.ones(1, np.float32)}
    ap.apply("grad", one, 1.0)
    ap.buffer(2, "grad", one, 0.5)
    ap.buffer(2, "grad", one, 0.5)
    ap.buffer(5, "grad", one, 1.0)
    assert ap.updates_applied == 1 and ap.buffered() == 3
    saved = ap.saved_buffers()
    ap.flush(Flush(upto=2, normalize=True))
    assert ap.updates_applied == 2 and ap.buffered() == 1 and set(ap.buffers) == {5}
    np.testing.assert_allclose(np.asarray(ap.store.snapshot().tensors["w"]), -2.0)
    again = Applier(store())
    again.restore_buffers(saved)
    assert again.buffered() == 3 and set(again.buffers) == {2, 5}


def _view(workers: dict[int, object] | None = None) -> ClusterView:
    return ClusterView(now=0.0, version=0, workers=workers or {}, global_batch=64, buffered=0)  # type: ignore[arg-type]


def test_policy_host_falls_back_to_async_on_a_policy_bug_and_keeps_its_state() -> None:
    clock = FakeClock()

    def broken(event: object, state: object, view: object) -> object:
        raise RuntimeError("a policy bug")

    host = PolicyHost(Policy("broken", lambda v: "its state", broken, {}), clock, clock.now())  # type: ignore[arg-type]
    host.state = "its state"
    r = host.decide(Push(0.0, 1, 0, "grad", 8, 1, 0.1, None), _view(), push=True)
    assert r.push is not None and host.state == "its state"  # applied; the state kept
    assert host.decide(Push(0.0, 1, 0, "grad", 8, 1, 0.1, None), _view(), push=False).push is None
    assert host.enter("shl", "test") and not host.enter("shl")
    assert [s for _, s in host.stages] == ["shl"]


def test_policy_host_trial_refuses_before_anything_changes() -> None:
    clock = FakeClock()
    host = PolicyHost(make_policy("asp"), clock, clock.now())
    before = (host.policy, host.state, host.stage)
    with pytest.raises(PolicyError):
        host.trial("no-such-policy", None, {}, lambda f: Plan(), 0, 64, None)
    with pytest.raises(PolicyError, match="failed to start"):
        host.trial("asp", None, {}, lambda f: Plan(), 0, 64, lambda n, p: "no-such-outer")
    assert (host.policy, host.state, host.stage) == before
    t = host.trial("bsp", None, {}, lambda f: Plan(), 0, 64, None)
    assert t.policy.name == "bsp" and host.policy.name == "asp"  # installed only when asked


def test_replicas_form_hides_later_stages_and_dissolve_brings_them_back() -> None:
    m, _ = members()
    ids = [admit(m, n, "stages")[0] for n in "abc"]
    plain, _ = admit(m, "d")
    r = Replicas(m)
    with pytest.raises(ValueError, match="do not run pipeline stages"):
        r.form([ids[0], plain], 0.0)
    with pytest.raises(ValueError, match="distinct"):
        r.form([ids[0], ids[0]], 0.0)
    assert r.groups == {} and set(m.facts) == {*ids, plain}  # refused: nothing changed
    events = r.form(ids, 1.0)
    assert [type(e) for e in events] == [Leave, Leave] and set(m.facts) == {ids[0], plain}
    assert r.of(ids[2]) == ids[0] and r.row(ids[1]) == [ids[0], 1]
    with pytest.raises(ValueError, match="in a replica already"):
        r.form([ids[1], plain], 0.0)
    m.remove(ids[1], "gone", None)
    back = r.dissolve(ids[0], "a stage left", 2.0)
    assert back == [Join(2.0, ids[2])]
    assert set(m.facts) == {ids[0], ids[2], plain} and r.groups == {} and r.head_of == {}
    assert r.dissolve(ids[0], "again", 3.0) == []


def test_publisher_defers_releases_and_answers_every_joined_push() -> None:
    m, _ = members()
    a, pa = admit(m, "a")
    meters = Meters()
    pub = Publisher(m, store(), EngineConfig(), meters)
    pub.deferred = True
    pub.release(m.active[a])
    assert pa.frames == [] and list(pub.pending) == [a]
    m.active[a].joined_pushes = 2  # two pushes waited for this release
    wants = pub.take()
    pub.send_all(wants, pub.encode(wants))
    assert pub.pending == {} and len(pa.frames) == 3
    full, *go_on = (wire.decode(f) for f in pa.frames)
    assert full["full"] and all(not g["full"] and g["tensors"] == {} for g in go_on)
    assert meters.bytes_out == sum(len(f) for f in pa.frames) == m.stats[a].bytes_out
    assert m.facts[a].version == 0 and m.active[a].joined_pushes == 0
    pub.deferred = False
    pub.resend(a)
    assert wire.decode(pa.frames[-1])["full"] and m.stats[a].releases == 2


def test_members_push_facts_are_smoothed() -> None:
    m, clock = members()
    a, _ = admit(m, "a")
    entry = m.active[a]

    def push(compute_s: float) -> None:
        p = PushIn(a, 1, 0, "grad", {}, 10, 1, compute_s, None, None, 100)
        m.pushed(entry, p, clock.now())

    push(1.0)
    push(3.0)
    f = m.facts[a]
    assert f.clock == 2 and f.samples == 20 and f.compute_s == pytest.approx(2.0)
    assert entry.stats.pushes == 2 and entry.stats.bytes_in == 200


def test_a_worker_that_never_had_a_push_answered_leaves_nothing_behind() -> None:
    """A hello-then-leave flood grew the departed table (and every checkpoint) without bound."""
    m, clock = members(departed_retention_s=100.0, max_departed=2)
    for i in range(50):
        w, _ = admit(m, f"flood{i}")
        m.remove(w, "bye", None)
    assert m.gone == {} and m.stats == {}
    kept = []
    for name in "abc":
        w, _ = admit(m, name)
        m.active[w].last_push = 3  # a push of it was answered: exactly-once needs the id
        clock.t += 1
        m.remove(w, "bye", None)
        kept.append(w)
    assert list(m.gone) == kept[1:]  # at most max_departed: the longest gone went first
    r, _ = admit(m, "r")
    clock.t += 1
    assert m.remove(r, "resumes at once", None, keep=True) is not None and r in m.gone
    clock.t += 150
    m.evict_due(clock.now())
    assert m.gone == {}  # past the retention time


def test_a_resume_keeps_its_id_before_any_push() -> None:
    m, _ = members()
    a, _ = admit(m, "a")
    secret = m.active[a].secret
    m.remove(a, "resumed on a new connection", None, keep=True)
    back, _ = admit(m, "a", resume_id=a, resume_secret=secret)
    assert back == a


def test_the_core_package_front_names_its_parts_lazily() -> None:
    import importlib
    import subprocess
    import sys

    import hetd.core

    for name in hetd.core.__all__:
        sub = importlib.import_module(f"hetd.core.{hetd.core._WHERE[name]}")
        assert getattr(hetd.core, name) is getattr(sub, name), name
    code = "import sys, hetd.core; print('jax' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "False", out.stderr[-1000:]


def _push(wid: int, pid: int, base: int = 0, samples: int = 4, norm: float = 1.0) -> PushIn:
    grads = {k: np.ones(s, np.float32) for k, s in SHAPES.items()}
    return PushIn(wid, pid, base, "grad", grads, samples, 1, 0.01, None, None, 16, norm=norm)


def intake(**config: object) -> tuple[Intake, Members, Store, FakeClock]:
    m, clock = members(**config)
    s = store()
    cfg = m.config
    part = Intake(m, Replicas(m), UpdateGuard(cfg.guard_factor, 2), Applier(s), cfg, Meters())
    return part, m, s, clock


def test_intake_answers_a_push_seen_before_and_one_too_stale_without_the_policy() -> None:
    part, m, s, clock = intake(max_staleness=1, guard_factor=0)
    a, _ = admit(m, "a")
    reply, event = part.push(_push(a, 1), clock.now())
    assert reply is None and isinstance(event, Push) and event.samples == 4
    assert m.active[a].last_push == 1 and m.active[a].stats.pushes == 1
    reply, event = part.push(_push(a, 1), clock.now())  # the same id again: never twice
    assert isinstance(reply, Ack) and reply.status == "duplicate" and event is None
    for _ in range(3):
        s.apply("grad", {k: np.zeros(v, np.float32) for k, v in SHAPES.items()}, 1.0)
    reply, event = part.push(_push(a, 2, base=0), clock.now())  # 3 versions behind, bound 1
    assert isinstance(reply, Ack) and reply.status == "dropped" and reply.reason == "too stale"
    assert isinstance(event, Tick)  # the clock moved: gates may open
    reply, _ = part.push(_push(a, 3, base=s.version + 1), clock.now())
    assert isinstance(reply, Ack) and reply.reason == "base version from the future"
    assert part.push(_push(99, 4), clock.now()) == (None, None)  # not a member: nothing


def test_intake_guard_refuses_an_outlier_and_counts_nothing_of_it() -> None:
    part, m, _, clock = intake(guard_factor=10.0)
    a, _ = admit(m, "a")
    for pid in (1, 2):
        assert part.push(_push(a, pid, norm=1.0), clock.now())[1] is not None
    reply, event = part.push(_push(a, 3, norm=1e3), clock.now())
    assert isinstance(reply, ErrorReply) and reply.code == "out_of_range" and event is None
    st = m.active[a].stats
    assert (st.refused, st.pushes, m.active[a].last_push) == (1, 2, 2)  # not counted, not acked


def test_intake_logs_what_it_refuses_or_drops_as_drops_and_spends_a_refused_id() -> None:
    m, clock = members(guard_factor=10.0, max_staleness=0)
    s = store()
    log = DecisionLog()
    part = Intake(m, Replicas(m), UpdateGuard(10.0, 2), Applier(s, log), m.config, Meters())
    a, _ = admit(m, "a")
    for pid in (1, 2):
        assert part.push(_push(a, pid, norm=1.0), clock.now())[1] is not None
    reply, _ = part.push(_push(a, 3, norm=1e3), clock.now())  # refused by the guard
    assert isinstance(reply, ErrorReply) and m.active[a].last_push == 3  # its id is spent
    reply, _ = part.push(_push(a, 3, norm=1.0), clock.now())  # the same id: a duplicate
    assert isinstance(reply, Ack) and reply.status == "duplicate"
    s.apply("grad", {k: np.zeros(v, np.float32) for k, v in SHAPES.items()}, 1.0)
    reply, _ = part.push(_push(a, 4, base=0), clock.now())  # one behind, bound 0
    assert isinstance(reply, Ack) and reply.status == "dropped"
    drops = [r.entry for r in log.since(0) if isinstance(r.entry, DropEntry)]
    assert [(d.worker, d.pid) for d in drops] == [
        (a, 3),
        (a, 4),
    ]  # the passed pushes are the policy's to log; no duplicate


def test_members_silent_are_those_past_the_heartbeat_timeout() -> None:
    m, clock = members(heartbeat_timeout_s=5.0)
    a, _ = admit(m, "a")
    b, _ = admit(m, "b")
    clock.t += 4.0
    m.seen(b)
    clock.t += 2.0  # a: 6 s silent, b: 2 s
    assert m.silent(clock.now()) == [a]


def test_replicas_run_pending_dissolves_a_replica_no_driver_runs() -> None:
    m, clock = members()
    a, _ = admit(m, "a", "stages")
    b, _ = admit(m, "b", "stages")
    r = Replicas(m)
    r.form([a, b], clock.now())
    r.pending[a] = None
    events = r.run_pending(clock.now())  # no driver here: the replica ends, b comes back
    assert events == [Join(clock.now(), b)]
    assert not r.groups and not r.pending
    ran: list[int] = []
    r.run_step = ran.append
    r.form([a, b], clock.now())
    r.pending[a] = None
    assert r.run_pending(clock.now()) == [] and ran == [a] and r.groups


def test_intake_pull_marks_the_worker_waiting_on_what_it_holds() -> None:
    part, m, _, clock = intake()
    a, _ = admit(m, "a")
    m.update(m.active[a], version=3, waiting=False, waiting_since=None)
    clock.t = 2.0
    event = part.pull(a, 3, clock.now())
    assert isinstance(event, Pull) and event.worker == a
    f = m.active[a].facts
    assert f.waiting and f.waiting_since == 2.0 and f.version == 3  # a delta may follow
    part.pull(a, 2, clock.now())
    assert m.active[a].facts.version == -1  # it holds something else: parameters in full
    assert part.pull(99, None, clock.now()) is None


def executor() -> tuple[Executor, Members, Applier, Publisher, FakeClock]:
    m, clock = members(batch_size=8)
    s, meters = store(), Meters()
    applier, pub = Applier(s), Publisher(m, s, m.config, meters)
    host = PolicyHost(make_policy("asp"), clock, clock.now())
    ex = Executor(m, host, applier, pub, Replicas(m), s, m.config, meters, clock)
    return ex, m, applier, pub, clock


def test_executor_sets_plans_before_it_releases_and_answers_each_push_decision() -> None:
    ex, m, applier, _, _ = executor()
    a, peer = admit(m, "a")
    p = _push(a, 1)
    resolved = resolve([SetPlan(a, {"batch_size": 16}), Release(a), Buffer(0.5, group=3)])
    assert ex.run(resolved, p) == []
    kinds = [type(r).__name__ for r in peer.replies]
    assert kinds == ["PlanUpdate", "Ack"]  # told its plan, then its push answered
    assert peer.replies[1].status == "buffered" and applier.buffered() == 1
    assert len(peer.frames) == 1 and not m.active[a].facts.waiting  # released at once
    assert m.active[a].plan.batch_size == 16
    ex.run(resolve([Flush(upto=3)]), None)
    assert applier.updates_applied == 1 and applier.buffered() == 0


def test_executor_applies_a_push_the_policy_said_nothing_about() -> None:
    ex, m, applier, _, _ = executor()
    a, peer = admit(m, "a")
    ex.run(resolve([]), _push(a, 1))
    assert peer.replies[-1].status == "applied" and applier.updates_applied == 1


def test_executor_swap_applies_buffered_pushes_first_and_a_refused_one_changes_nothing() -> None:
    ex, m, applier, _, _ = executor()
    admit(m, "a")
    applier.buffer(0, "grad", {k: np.ones(v, np.float32) for k, v in SHAPES.items()}, 1.0)
    _, described = ex.swap("bsp", None)
    assert described["name"] == "bsp" and ex.host.policy.name == "bsp"
    assert applier.buffered() == 0 and applier.updates_applied == 1  # nothing lost
    with pytest.raises(PolicyError):
        ex.swap("no-such-policy", None)
    assert ex.host.policy.name == "bsp"  # a refused swap changes nothing


async def test_the_command_queue_runs_what_is_queued_in_one_batch_and_survives_a_failure() -> None:
    meters = Meters()
    q = CommandQueue(meters)
    seen: list[object] = []

    def handle(command: cmd.Command) -> None:
        if isinstance(command, cmd.Heartbeat) and command.worker == 2:
            raise RuntimeError("a bug in one command")
        seen.append(command)

    for w in (1, 2, 3):
        q.submit(cmd.Heartbeat(w))
    await q.run_batch(handle)
    assert seen == [cmd.Heartbeat(1), cmd.Heartbeat(3)]  # one batch; the failure was logged
    assert meters.latency.count == 3
    done = asyncio.ensure_future(q.call(lambda: 42))
    await asyncio.sleep(0)
    await q.run_batch(lambda c: c.answer() if isinstance(c, cmd.Call) else None)
    assert await done == 42


def test_members_terms_refuse_before_anything_changes_and_resuming_needs_the_secret() -> None:
    m, _ = members(codec="int8", batch_size=16)
    assert m.terms(hello("a"), "main") == ("none", Plan(batch_size=16, codec="none"))
    h = JoinIn(id=1, name="b", device={}, codecs=("int8", "none"))
    assert m.terms(h, "warm") == ("int8", Plan(batch_size=16, codec="int8", stage="warm"))
    with pytest.raises(CodecError, match="no usable codec"):
        m.terms(JoinIn(id=1, name="c", device={}, codecs=("int4",)), "main")
    assert m.active == {} and m.next_id == 1
    a, _ = admit(m, "a")
    secret = m.active[a].secret
    assert m.resuming(hello("a", resume_id=a, resume_secret=secret)) == a
    assert m.resuming(hello("a", resume_id=a, resume_secret="guess")) is None
    assert m.resuming(hello("a", resume_id=99, resume_secret=secret)) is None
    assert m.resuming(hello("a")) is None


@pytest.mark.parametrize("recut", [False, True])
def test_members_recut_on_leave_only_when_configured(recut: bool) -> None:
    m, _ = members(recut_shards=recut)
    a, _ = admit(m, "a", "reshard")
    b, pb = admit(m, "b", "reshard")
    before = m.active[b].shard
    m.remove(a, "bye", None)
    m.recut_on_leave()
    assert pb.replies == ([ShardUpdate(0, 1)] if recut else [])
    assert m.active[b].shard == ((0, 1) if recut else before)


class _Sink:
    """A frame sink that packs frames into buffers of its own and keeps what it was given."""

    def __init__(self) -> None:
        self.committed: list[tuple[bytes, int]] = []

    def reserve(self, nbytes: int) -> np.ndarray | None:
        return np.zeros(nbytes, np.uint8)

    def commit(self, buf: np.ndarray, frame: memoryview, version: int) -> None:
        self.committed.append((bytes(frame), version))


def test_publisher_defers_with_the_store_forgets_releases_and_packs_into_a_sink() -> None:
    m, _ = members()
    a, pa = admit(m, "a")
    b, _ = admit(m, "b")
    s = store()
    pub = Publisher(m, s, EngineConfig(param_hashes=False), Meters())
    assert s.hashes is False and not pub.due()
    pub.defer()
    assert pub.deferred and s.combine
    pub.release(m.active[a])
    pub.release(m.active[b])
    assert pub.due()
    pub.forget([b, 42])
    assert list(pub.pending) == [a]
    sink = _Sink()
    pub.sink_to(sink)
    pub.publish()
    assert not pub.due() and len(pa.frames) == 1
    assert sink.committed == [(pa.frames[0], 0)]  # the frame sent is the one packed there
    pub.defer(False)
    assert not pub.deferred and not s.combine


def test_queue_ticking_feeds_ticks_and_stops_its_feeds_after_the_block() -> None:
    stopped: list[bool] = []

    async def feed() -> None:
        try:
            await asyncio.Event().wait()
        finally:
            stopped.append(True)

    async def main() -> list[cmd.Command]:
        q, seen = CommandQueue(Meters()), []
        async with q.ticking(0.001, feed()):
            await q.run_batch(seen.append)
            assert stopped == []
        return seen

    assert isinstance(asyncio.run(main())[0], cmd.Tick) and stopped == [True]


def test_meters_sample_the_rates_with_their_own_byte_counts() -> None:
    m = Meters()
    m.sample(0.0, 0)
    m.bytes_in, m.bytes_out = 2_000_000, 4_000_000
    m.sample(2.0, 10)
    assert m.rates.rates() == {
        "updates_per_s": 5.0,
        "mb_in_per_s": round(1_000_000 / MB, 3),
        "mb_out_per_s": round(2_000_000 / MB, 3),
        "window_s": 2.0,
    }
