"""A head that holds no parameters (:class:`~hetd.core.ledger.LedgerStore`, ``[pservers] headers``)
decides what a head with them decides.

Two real engines, assembled as the daemon assembles one (one on a :class:`~hetd.core.store.Store`,
one on a :class:`~hetd.core.ledger.LedgerStore`), each with a :class:`~hetd.pserver.log.DecisionLog`,
are fed the same pushes by three emulated workers that pull every release (the real
:class:`~hetd.server.pserver_pulls.Pointers` make their ``params_at`` frames): the first engine
gets each push's tensors, the second its header (``tensors`` {}, the norm its pservers' reports
give). Both write the same log, record for record, reach the same versions, answer each push
alike and release the same versions at the same log positions: under ``asp`` with publishes
deferred (the queued steps of a batch one ``step`` entry), pushes dropped as too stale, one sent
again, one refused by the update guard, one whose norm is NaN (refused with the guard off too),
a swap to ``diloco`` (a new outer optimizer) and a checkpoint; under ``bsp`` buffered rounds and
their flushes, a swap to ``ssp`` that flushes the round under way and a checkpoint taken
mid-round; each with ``sgd`` and ``adam``, and a restore at the end.

The store alone: a checkpoint of the ledger holds its version and no parameters, and restores;
asking it for parameters raises :class:`~hetd.core.ledger.NoParameters`; a store with
parameters refuses to restore such a checkpoint, saying why.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest

from hetd.core.assemble import EngineSpec, Optimizers, assemble
from hetd.core.engine import Engine
from hetd.core.entries import EngineConfig
from hetd.core.ingest import decode_hello, update_norm
from hetd.core.ledger import LedgerStore, NoParameters
from hetd.core.saved import EngineState
from hetd.core.store import Int8, Store, make_optimizer, make_outer
from hetd.protocol import frames, wire
from hetd.protocol.messages import Ack, ErrorReply, PushIn
from hetd.pserver.log import (
    ApplyEntry,
    BufferEntry,
    CheckpointEntry,
    DecisionLog,
    DropEntry,
    FlushEntry,
    OuterEntry,
    RestartEntry,
    RestoreEntry,
    StepEntry,
    to_dict,
)
from hetd.pserver.partition import partition
from hetd.server.pserver_pulls import Pointers
from tests.conftest import FakeClock, FakePeer

SHAPES = {"a/w": (8, 4), "a/b": (4,), "b/w": (4, 3), "s": ()}
PARAMS = {
    k: np.linspace(-1, 1, math.prod(s), dtype=np.float32).reshape(s) for k, s in SHAPES.items()
}
PMAP = partition(SHAPES, 2, block_bytes=0)
SPEEDS = (1.0, 1.3, 2.1)  # seconds per step of each worker (virtual)
OPTIMIZERS = {"sgd": Optimizers("sgd", 0.1), "adam": Optimizers("adam", 1e-3)}
PUSHES = 40


def _update(worker: int, pid: int, blown: bool, nan: bool, int8: bool) -> dict[str, Any]:
    """Push ``pid`` of ``worker``'s tensors: the same in both runs (seeded by the pair)."""
    rng = np.random.default_rng(worker * 1000 + pid)
    out: dict[str, Any] = {
        k: rng.standard_normal(s).astype(np.float32) * np.float32(1e6 if blown else 1)
        for k, s in SHAPES.items()
    }
    if nan:
        out["a/w"][3, 1] = np.nan
    if int8 and not nan:
        for k, v in out.items():
            scale = np.float32(max(float(np.max(np.abs(v))), 1e-12) / 127)
            out[k] = Int8(np.clip(np.round(v / scale), -127, 127).astype(np.int8), scale)
    return out


@dataclass
class Worker:
    wid: int
    peer: FakePeer
    speed: float
    held: int = -1  # the version it holds (-1: none yet)
    seen: int = 0  # frames taken from its peer
    done_at: float | None = None  # when the step under way ends (None: waiting)
    pid: int = 0


@dataclass
class Trace:
    """What one engine did: its log, its version, its answers and its releases."""

    engine: Engine
    log: DecisionLog
    replies: list[tuple[Any, ...]] = field(default_factory=list)  # (worker, what, id, ...)
    releases: list[tuple[int, int, int]] = field(default_factory=list)  # (worker, version, pos)
    saved: EngineState | None = None  # the checkpoint taken two thirds in, and its name
    saved_ref: str | None = None

    def records(self) -> list[dict[str, Any]]:
        return [to_dict(r) for r in self.log.since(0)]

    def ops(self) -> dict[type, int]:
        out: dict[type, int] = {}
        for r in self.log.since(0):
            out[type(r.entry)] = out.get(type(r.entry), 0) + 1
        return out


def _reply(wid: int, r: Any) -> tuple[Any, ...]:
    if isinstance(r, Ack):
        return (wid, "ack", r.id, r.status, r.version, r.reason)
    assert isinstance(r, ErrorReply), r
    return (wid, "error", r.id, r.code)


def _hello(name: str) -> Any:
    fields = {"name": name, "device": {"platform": "cpu"}, "codecs": ["none"]}
    return decode_hello(wire.decode(wire.encode("hello", 7, features=["pulls"], **fields)))


def _drive(ledger: bool, policy: str, opt: str, seed: int = 7) -> Trace:
    """One engine (on a LedgerStore when ``ledger``, fed headers) through :data:`PUSHES`
    pushes of three workers (see the module's docstring); the same decisions in both runs
    come from the engine alone: the test's own choices are seeded and counted."""
    asynchronous = policy == "asp"
    settings = EngineConfig(
        max_staleness=2 if asynchronous else 1000,
        guard_factor=100.0 if asynchronous else 0.0,  # bsp: the guard off
        guard_warmup=3,
        downlink="full",
    )
    spec = EngineSpec(
        PARAMS,
        policy,
        optimizers=OPTIMIZERS[opt],
        settings=settings,
        store_type=LedgerStore if ledger else None,
    )
    log = DecisionLog()
    clock = FakeClock()
    engine = assemble(spec).engine(clock, decisions=log)
    assert isinstance(engine.store, LedgerStore) == ledger
    # every release a pull from the pservers: a head with parameters names each slice's hash
    engine.publisher.pointer = Pointers(PMAP, log, hashes=not ledger)
    if asynchronous:
        engine.defer_publishing()  # releases wait for the batch's publish; its steps combined
    trace = Trace(engine, log)
    rng = random.Random(seed)
    workers = []
    for i, speed in enumerate(SPEEDS):
        peer = FakePeer()
        workers.append(Worker(engine.join(_hello(f"w{i}"), peer), peer, speed))
        engine.pull(workers[-1].wid, None)
    kind = "grad"
    count = 0
    while count < PUSHES:
        for w in workers:
            for frame in w.peer.frames[w.seen :]:
                msg = frames.decode(frame)
                assert isinstance(msg, frames.ParamsAt), msg
                trace.releases.append((w.wid, msg.version, msg.position))
                assert msg.version >= w.held
                w.held = msg.version
                w.done_at = clock.t + w.speed
            w.seen = len(w.peer.frames)
        busy = [w for w in workers if w.done_at is not None]
        if not busy:  # every worker waits: the daemon's batch ends and it publishes
            engine.publish_batch()
            assert any(len(w.peer.frames) > w.seen for w in workers), "no worker was released"
            continue
        w = min(busy, key=lambda x: (x.done_at, x.wid))
        assert w.done_at is not None
        clock.t = w.done_at
        w.done_at = None
        w.pid += 1
        blown = asynchronous and count == PUSHES // 2  # the guard refuses it
        nan = count == PUSHES // 4  # refused whatever the guard
        base = w.held
        if asynchronous and count == PUSHES // 3:  # held on to an old version: too stale
            base = max(0, engine.store.version - 3)
        tensors = _update(w.wid, w.pid, blown, nan, int8=w.wid == workers[2].wid)
        norm = update_norm(tensors)  # what ingest measures, or the pservers' reports sum to
        sent = {} if ledger else tensors
        p = PushIn(w.wid, w.pid, base, kind, sent, 32, 1, w.speed, None, None, 1, norm=norm)
        engine.push(p)
        count += 1
        reply = w.peer.replies[-1]
        trace.replies.append(_reply(w.wid, reply))
        if isinstance(reply, ErrorReply):
            w.done_at = clock.t + w.speed  # it goes on from what it holds
            continue
        if count == 5:  # sent again (a reconnect): a duplicate, never logged again
            engine.push(p)
            trace.replies.append(_reply(w.wid, w.peer.replies[-1]))
        engine.pull(w.wid, w.held)
        if count == PUSHES * 2 // 3:  # a checkpoint (bsp: with a round under way)
            trace.saved = engine.state()
            trace.saved_ref = engine.applier.checkpoint_ref
        if count == PUSHES * 3 // 4:
            if asynchronous:
                engine.swap_policy("diloco", {"H": 2})  # deltas from here, a new outer optimizer
                kind = "delta"
            else:
                engine.swap_policy("ssp")  # the round under way is flushed first
        if asynchronous and rng.random() < 0.4:  # the daemon's batches end at times of their own
            engine.publish_batch()
    engine.publish_batch()
    engine.state()  # the last checkpoint, then the earlier one restored (its buffers too)
    assert trace.saved is not None and trace.saved_ref is not None
    engine.restore(trace.saved, ref=trace.saved_ref)
    return trace


@pytest.mark.parametrize(
    ("policy", "opt"), [("asp", "adam"), ("asp", "sgd"), ("bsp", "adam"), ("bsp", "sgd")]
)
def test_a_head_on_headers_writes_the_log_a_head_with_parameters_writes(
    policy: str, opt: str
) -> None:
    real = _drive(False, policy, opt)
    headers = _drive(True, policy, opt)
    assert headers.records() == real.records()
    assert headers.engine.store.version == real.engine.store.version == real.log.version
    assert headers.log.version == headers.engine.store.version
    assert headers.replies == real.replies
    assert headers.releases == real.releases
    assert headers.engine.store.pending == real.engine.store.pending == 0

    # the runs did what the test means them to: each kind of decision is in the log
    ops = real.ops()
    statuses = [r[3] for r in real.replies]
    reasons = [r[5] for r in real.replies if r[1] == "ack"]
    assert ops.get(StepEntry, 0) >= 5
    assert ops.get(CheckpointEntry) == 2 and ops.get(RestoreEntry) == 1
    assert statuses.count("duplicate") == 1
    assert statuses.count("out_of_range") == (2 if policy == "asp" else 1)  # NaN, (blown up)
    assert ops.get(DropEntry, 0) >= statuses.count("out_of_range")
    if policy == "asp":
        steps = [r.entry for r in real.log.since(0) if isinstance(r.entry, StepEntry)]
        assert any(s.combine for s in steps)  # a batch's queued steps summed into one
        assert "too stale" in reasons
        assert ops.get(ApplyEntry, 0) >= 15
        assert ops.get(BufferEntry, 0) >= 5 and ops.get(FlushEntry, 0) >= 2  # diloco's rounds
        # diloco's outer optimizer: Nesterov over sgd, plain averaging (asp's) over adam
        assert ops.get(OuterEntry, 0) == (1 if opt == "sgd" else 0)
    else:
        assert ops.get(BufferEntry, 0) >= 15 and ops.get(FlushEntry, 0) >= 5
        assert ops.get(ApplyEntry, 0) >= 5  # after the swap to ssp
    # the restore puts back the checkpoint taken two thirds in: its version, its round's buffers
    assert real.saved is not None and headers.saved is not None
    assert headers.saved.params == {} and headers.saved.version == real.saved.version
    assert headers.saved.buffers.keys() == real.saved.buffers.keys()
    assert headers.engine.store.version == real.saved.version < real.log.since(0)[-2].version
    restore = real.log.since(0)[-1].entry
    assert isinstance(restore, RestoreEntry) and restore.ref == real.saved_ref
    assert bool(restore.groups) == (policy == "bsp")  # a synchronous round under way
    # the head with parameters moved them: the logs compared are of a real training
    moved = real.engine.store.snapshot().tensors
    assert any(np.any(moved[k] != PARAMS[k]) for k in PARAMS)


# --- the store alone ---------------------------------------------------------------------------


def _stores() -> tuple[Store, LedgerStore]:
    tx, outer = make_optimizer("adam:lr=0.01"), "nesterov:lr=0.7,momentum=0.9"
    real = Store(PARAMS, tx, outer=make_outer(outer), outer_spec=outer)
    ledger = LedgerStore(PARAMS, tx, outer=make_outer(outer), outer_spec=outer)
    return real, ledger


def _grad(x: float) -> dict[str, np.ndarray]:
    return {k: np.full(s, x, np.float32) for k, s in SHAPES.items()}


@pytest.mark.parametrize("combine", [False, True])
def test_the_ledger_logs_each_run_of_queued_steps_where_a_store_does(combine: bool) -> None:
    """Store-level calls (the applier's and a policy's) on both: the same step, outer and
    restart entries at the same places, and the same version."""
    real, ledger = _stores()
    logs = []
    for s in (real, ledger):
        log = DecisionLog()
        logs.append(log)
        s.decisions = log
        s.combine = combine
        assert s.holds_params == (s is real)
        assert s.shapes == real.shapes and s.n_params == real.n_params
        s.apply("grad", _grad(1.0) if s is real else {}, 0.5)
        s.apply("delta", _grad(0.1) if s is real else {}, 1.0)
        s.flush()
        s.flush()  # nothing queued: nothing logged
        for i in range(17):  # the 16th queued step runs them at once
            s.apply("grad", _grad(float(i)) if s is real else {}, 1.0)
        assert s.set_outer("sgd:lr=1") and not s.set_outer("sgd:lr=1")
        s.apply("grad", _grad(2.0) if s is real else {}, 1.0)
        s.restart_optimizer()
        with pytest.raises(ValueError, match="unknown update kind"):
            s.apply("nudge", {}, 1.0)
    assert real.version == ledger.version == 20
    assert real.outer_spec == ledger.outer_spec == "sgd:lr=1"
    want, got = ([to_dict(r) for r in log.since(0)] for log in logs)
    assert got == want
    entries = [r.entry for r in logs[1].since(0)]
    kinds = [type(e) for e in entries]
    assert kinds == [StepEntry, StepEntry, StepEntry, OuterEntry, StepEntry, RestartEntry]
    assert {e.combine for e in entries if isinstance(e, StepEntry)} == {combine}


def test_a_ledger_checkpoint_holds_its_version_and_no_parameters_and_restores() -> None:
    _, ledger = _stores()
    for _ in range(3):
        ledger.apply("grad", {}, 1.0)
    params, opt, version = ledger.state()
    assert params == {} and version == 3 and ledger.pending == 0  # its queued steps logged
    assert set(opt) == {"grad", "outer"}  # the optimizers' state's shape, without tensors
    fresh = LedgerStore(PARAMS, make_optimizer("adam:lr=0.01"))
    fresh.apply("grad", {}, 1.0)  # queued, then forgotten by the restore
    fresh.restore(params, opt, version)
    assert fresh.version == 3 and fresh.pending == 0 and fresh.state()[:1] == ({},)
    fresh.restore(dict(PARAMS), opt, 9)  # a checkpoint with parameters: they are the pservers'
    assert fresh.version == 9


def test_asking_the_ledger_for_parameters_raises_no_parameters() -> None:
    _, ledger = _stores()
    ledger.apply("grad", {}, 1.0)
    with pytest.raises(NoParameters, match="holds no parameters"):
        ledger.snapshot()
    with pytest.raises(NoParameters, match="pull them"):
        ledger.read(lambda version, params: version)
    assert ledger.version == 1  # nothing changed by asking


def test_a_store_with_parameters_refuses_a_checkpoint_without_them_saying_why() -> None:
    real, ledger = _stores()
    real.apply("grad", _grad(1.0), 1.0)
    _, opt, version = real.state()
    ledger.apply("grad", {}, 1.0)
    params, _, _ = ledger.state()
    before = dict(real.snapshot().tensors)
    with pytest.raises(ValueError, match=r"headers = true"):
        real.restore(params, opt, version)
    assert real.version == 1
    after = real.snapshot().tensors
    assert all(np.array_equal(after[k], before[k]) for k in before)  # nothing replaced
