"""The daemon's engine writes the decision log, and S = 3 slices replaying it end with its store.

A real :class:`~hetd.core.engine.Engine`, assembled as the daemon assembles one and publishing in
batches as the daemon does (its store combines the updates queued between two publishes into one
optimizer step), trains the bundled MLP with three workers that compute real gradients on the
parameters each was sent (one pushes int8) and answer their releases as a worker does. The
engine is given a :class:`~hetd.pserver.log.DecisionLog`; the test writes nothing into it. Two
policies: ``bsp`` (buffered rounds, flushes as means, a swap to ``ssp`` that flushes the round
in progress) and ``asp`` (applies scaled by the number of workers, pushes dropped as too stale,
one refused by the update guard, one sent again as a duplicate, a checkpoint and a restore).
Inline evaluations take snapshots between publishes, so the store's steps run at places no
publish chose.

The pushes' tensors, cut with the partition map, go to three slices in a shuffled order (some
twice) and the log's records are replayed on them: every version a worker was sent is the
slices' joined parameters at that version, bit for bit, and so is the end, for SGD and Adam.
"""

from __future__ import annotations

import functools
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import jax
import numpy as np
import pytest

from hetd.core.assemble import EngineSpec, Optimizers, assemble
from hetd.core.decisions import LogMismatch
from hetd.core.engine import Engine
from hetd.core.entries import EngineConfig
from hetd.core.ingest import decode_hello
from hetd.core.store import Int8, Snapshot, make_optimizer, make_outer
from hetd.protocol import frames, wire
from hetd.protocol.messages import Ack, ErrorReply, PushIn
from hetd.protocol.params import Held, apply_params, param_hash
from hetd.pserver.log import (
    ApplyEntry,
    BufferEntry,
    CheckpointEntry,
    DecisionLog,
    DropEntry,
    FlushEntry,
    Record,
    RestoreEntry,
    StepEntry,
)
from hetd.pserver.partition import PartitionMap, join, partition, split
from hetd.pserver.slice import SliceState
from hetd.zoo.models import get_model, to_numpy
from tests.conftest import FakeClock, FakePeer

S = 3
BLOCK = 64 << 10  # cuts the 784x128 kernel into row blocks, as the identity test does
MODEL = get_model("mlp", 10)
PARAMS = to_numpy(MODEL.init(jax.random.PRNGKey(0), (784,)))
SPEEDS = (1.0, 1.3, 2.1)  # seconds per step of each worker (virtual)
OPTIMIZERS = {"sgd": Optimizers("sgd", 0.1), "adam": Optimizers("adam", 1e-3)}


@functools.cache
def _grad_fn() -> Callable[..., Any]:
    return jax.jit(jax.grad(MODEL.loss))


def _gradient(params: Any, seed: int) -> dict[str, np.ndarray]:
    """A real gradient of the MLP's loss at ``params`` on a batch of 32 (seeded)."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((32, 784)).astype(np.float32)
    y = rng.integers(0, 10, 32)
    return to_numpy(_grad_fn()(dict(params), x, y))


def _int8(update: dict[str, np.ndarray]) -> dict[str, Int8]:
    out = {}
    for k, v in update.items():
        scale = np.float32(max(float(np.max(np.abs(v))), 1e-12) / 127)
        out[k] = Int8(np.clip(np.round(v / scale), -127, 127).astype(np.int8), scale)
    return out


def _evaluate(snap: Snapshot) -> tuple[float, float]:
    """An inline evaluation: reads a snapshot (so the store runs its queued steps there)."""
    return float(sum(np.sum(v) for v in snap.tensors.values())), 0.0


@dataclass
class Worker:
    """One emulated worker: what it holds, when its step ends, its push ids."""

    wid: int
    peer: FakePeer
    speed: float
    int8: bool
    held: Held | None = None
    seen: int = 0  # frames taken from the peer
    done_at: float | None = None  # the end of the step under way (None: waiting)
    pid: int = 0
    sent: list[frames.Params] = field(default_factory=list)  # the full frames it was sent


@dataclass
class Run:
    """A finished run: the engine, its log's records, the pushes and what the test saw."""

    engine: Engine
    records: list[Record]
    pushes: dict[tuple[int, int], tuple[str, Any]]  # (worker, pid) -> (kind, tensors)
    sent: dict[int, dict[str, np.ndarray]]  # version -> the parameters a worker was sent
    outer_spec: str
    checkpoint: tuple[str, int, dict[str, np.ndarray]] | None = None  # ref, version, params


def _hello(name: str) -> Any:
    fields = {"name": name, "device": {"platform": "cpu"}, "codecs": ["none"]}
    return decode_hello(wire.decode(wire.encode("hello", 7, **fields)))


def _run(policy: str, optimizers: Optimizers, pushes: int, seed: int) -> Run:
    """The engine and three workers for ``pushes`` pushes (see the module's docstring)."""
    asynchronous = policy == "asp"
    settings = EngineConfig(
        eval_interval_s=3.0,
        eval_inline=True,
        max_staleness=3 if asynchronous else 1000,
        guard_factor=100.0 if asynchronous else 0.0,
        guard_warmup=3,
    )
    spec = EngineSpec(PARAMS, policy, optimizers=optimizers, settings=settings)
    log = DecisionLog()
    clock = FakeClock()
    engine = assemble(spec).engine(clock, _evaluate, decisions=log)
    outer_spec = engine.store.outer_spec
    engine.defer_publishing()  # releases wait for the batch's publish; its steps are combined
    rng = random.Random(seed)
    workers = []
    for i, speed in enumerate(SPEEDS):
        peer = FakePeer()
        wid = engine.join(_hello(f"w{i}"), peer)
        workers.append(Worker(wid, peer, speed, int8=i == 2))
        engine.pull(wid, None)
    run = Run(engine, [], {}, {0: dict(PARAMS)}, outer_spec)
    count = 0
    while count < pushes:
        for w in workers:  # what each worker was sent: it starts its next step on it
            for frame in w.peer.frames[w.seen :]:
                msg = frames.decode(frame)
                assert isinstance(msg, frames.Params)
                w.held = apply_params(w.held, msg)
                assert w.held is not None
                run.sent.setdefault(w.held.version, dict(w.held.tensors))
                w.done_at = clock.t + w.speed
            w.seen = len(w.peer.frames)
        busy = [w for w in workers if w.done_at is not None]
        if not busy:  # every worker waits: the daemon's batch ends and it publishes
            engine.publish_batch()
            assert any(len(w.peer.frames) > w.seen for w in workers), "no worker was released"
            continue
        w = min(busy, key=lambda x: (x.done_at, x.wid))
        assert w.done_at is not None and w.held is not None
        clock.t = w.done_at
        w.done_at = None
        grad = _gradient(w.held.tensors, seed * 1000 + count)
        refuse = asynchronous and count == pushes // 2  # blown up: the guard refuses it
        if refuse:
            grad = {k: v * np.float32(1e6) for k, v in grad.items()}
        tensors: Any = _int8(grad) if w.int8 else grad
        w.pid += 1
        p = PushIn(w.wid, w.pid, w.held.version, "grad", tensors, 32, 1, w.speed, None, None, 1)
        run.pushes[(w.wid, w.pid)] = ("grad", tensors)
        engine.push(p)
        count += 1
        reply = w.peer.replies[-1]
        if refuse:
            assert isinstance(reply, ErrorReply) and reply.id == w.pid
            w.done_at = clock.t + w.speed  # it goes on from what it holds
            continue
        assert isinstance(reply, Ack) and reply.id == w.pid
        if asynchronous and count == 5:  # sent again (a reconnect): acked, never logged again
            engine.push(p)
            again = w.peer.replies[-1]
            assert isinstance(again, Ack) and (again.id, again.status) == (p.id, "duplicate")
        engine.pull(w.wid, w.held.version)
        if count % 4 == 0:
            clock.t += 0.01
            engine.tick()  # evaluations are due every 3 s: a snapshot between publishes
        if not asynchronous and count == pushes // 2:
            engine.swap_policy("ssp")  # the round in progress is flushed first
        if asynchronous and count == pushes * 2 // 3:
            st = engine.state()  # a checkpoint: the store's steps run, then the entry
            assert engine.applier.checkpoint_ref is not None
            run.checkpoint = (engine.applier.checkpoint_ref, st.version, dict(st.params))
        if rng.random() < 0.4:  # the daemon's batches end at times of their own
            engine.publish_batch()
    engine.publish_batch()
    engine.store.snapshot()  # the end is read where the store runs what is queued
    run.records = log.since(0)
    assert log.version == engine.store.version
    return run


def _replay(
    run: Run, optimizers: Optimizers, seed: int
) -> tuple[list[SliceState], PartitionMap, dict[int, dict[str, np.ndarray]]]:
    """The log replayed on S slices, fed every push's parts first, shuffled, some twice; the
    joined parameters after each step entry (where a pserver serves a release), by version."""
    pmap = partition({k: v.shape for k, v in PARAMS.items()}, S, block_bytes=BLOCK)
    assert any(not p.whole for p in pmap.parts) and len({p.server for p in pmap.parts}) == S
    daemon_opt = optimizers.specs()[0]
    slices = [
        SliceState(
            pmap,
            s,
            part,
            make_optimizer(daemon_opt),
            outer=make_outer(run.outer_spec),
            outer_spec=run.outer_spec,
            combine=True,  # as the engine's store, which publishes in batches
        )
        for s, part in enumerate(split(pmap, PARAMS))
    ]
    rng = random.Random(seed)
    parts = [(s, key) for key in run.pushes for s in range(S)]
    parts += rng.sample(parts, 10)
    rng.shuffle(parts)
    for s, key in parts:
        slices[s].receive(*key, split(pmap, run.pushes[key][1])[s])
    served: dict[int, dict[str, np.ndarray]] = {0: dict(PARAMS)}
    for r in run.records:
        for sl in slices:
            sl.offer([r])
            assert sl.advance() == r.position
        if isinstance(r.entry, StepEntry):
            served[r.version] = join(pmap, [sl.params() for sl in slices])
    return slices, pmap, served


def _same(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> bool:
    return a.keys() == b.keys() and all(a[k].tobytes() == b[k].tobytes() for k in a)


def _ops(records: list[Record]) -> dict[type, int]:
    out: dict[type, int] = {}
    for r in records:
        out[type(r.entry)] = out.get(type(r.entry), 0) + 1
    return out


@pytest.mark.parametrize(
    ("policy", "opt"),
    [
        ("bsp", "adam"),
        ("asp", "adam"),
        pytest.param("bsp", "sgd", marks=pytest.mark.slow),
        pytest.param("asp", "sgd", marks=pytest.mark.slow),
    ],
)
def test_slices_replaying_the_engines_log_serve_every_version_it_sent_bit_for_bit(policy, opt):
    run = _run(policy, OPTIMIZERS[opt], pushes=36, seed=7)
    ops = _ops(run.records)
    # the log holds what the engine did, not a script: each kind of decision is there
    assert ops.get(StepEntry, 0) >= 5 and ops.get(ApplyEntry, 0) + ops.get(BufferEntry, 0) >= 30
    if policy == "bsp":
        assert ops.get(BufferEntry, 0) >= 10 and ops.get(FlushEntry, 0) >= 3
        assert ops.get(ApplyEntry, 0) >= 5  # after the swap to ssp
    else:
        assert ops.get(DropEntry, 0) >= 2  # too stale, and the guard's refusal
        assert ops.get(CheckpointEntry, 0) == 1
    logged = [(r.entry.worker, r.entry.pid) for r in run.records if hasattr(r.entry, "pid")]
    assert len(logged) == len(set(logged)) == len(run.pushes)  # every push once, the repeat not

    slices, pmap, served = _replay(run, OPTIMIZERS[opt], seed=3)
    assert all(sl.held() == 0 for sl in slices)  # every part consumed or freed
    end = run.engine.store.snapshot()
    got = join(pmap, [sl.params() for sl in slices])
    assert _same(got, dict(end.tensors)), f"{policy}/{opt}: the end differs"
    assert param_hash(got) == end.hash  # what a worker joining the slices checks
    assert sum(int(np.sum(got[k] != PARAMS[k])) for k in got) > 0.9 * sum(
        v.size for v in PARAMS.values()
    )  # training moved them
    # every version a worker was sent, as the slices serve it at that version's step
    assert len(run.sent) >= 8
    for version, params in run.sent.items():
        assert _same(served[version], params), f"{policy}/{opt}: version {version} differs"
    if run.checkpoint is not None:
        ref, version, params = run.checkpoint
        saved = [sl.saved[ref] for sl in slices]
        assert {s.version for s in saved} == {version}
        assert _same(join(pmap, [s.params for s in saved]), params)


def test_a_restore_is_logged_and_slices_load_their_checkpoint():
    """The engine restored from its own checkpoint: the log says so, and slices that replay it
    load the slice they saved at that checkpoint."""
    run = _run("asp", OPTIMIZERS["sgd"], pushes=12, seed=1)
    engine = run.engine
    log = engine.store.decisions
    assert isinstance(log, DecisionLog)
    st = engine.state()  # a checkpoint at the end
    ref = engine.applier.checkpoint_ref
    assert ref is not None
    engine.restore(st, ref=ref)
    last = log.since(0)[-1]
    assert isinstance(last.entry, RestoreEntry) and last.entry.ref == ref
    assert last.version == st.version == engine.store.version
    run.records = log.since(0)
    slices, pmap, _ = _replay(run, OPTIMIZERS["sgd"], seed=2)
    assert _same(join(pmap, [sl.params() for sl in slices]), dict(engine.store.snapshot().tensors))


def test_a_log_that_does_not_start_at_the_stores_version_is_refused():
    spec = EngineSpec(PARAMS, "asp", optimizers=OPTIMIZERS["sgd"])
    with pytest.raises(LogMismatch, match="starts where its store is"):
        assemble(spec).engine(FakeClock(), decisions=DecisionLog(version=3))


def test_the_last_checkpoint_after_the_engine_stops_combining_is_replayed_as_it_ran():
    """``Engine.run`` turns the store's combining off when it ends, and the daemon's last
    checkpoint runs what is still queued one step per update: the log's step says so, and the
    slices (built to combine, as the daemon's store runs) follow it."""
    spec = EngineSpec(PARAMS, "asp", optimizers=OPTIMIZERS["adam"])
    log = DecisionLog()
    engine = assemble(spec).engine(FakeClock(), decisions=log)
    engine.defer_publishing()
    peers = [FakePeer() for _ in range(2)]
    wids = [engine.join(_hello(f"w{i}"), peer) for i, peer in enumerate(peers)]
    pushes = {}
    for n in range(6):
        wid = wids[n % 2]
        grad = _gradient(PARAMS, 500 + n)
        pushes[(wid, n // 2 + 1)] = ("grad", grad)
        engine.push(
            PushIn(wid, n // 2 + 1, engine.store.version, "grad", grad, 32, 1, 1.0, None, None, 1)
        )
        if n == 2:
            engine.publish_batch()  # three summed into one step
    assert engine.store.pending == 3
    engine.publisher.deferred = engine.store.combine = False  # as Engine.run's end does
    engine.state()  # the last checkpoint: three steps, one per update
    steps = [r.entry for r in log.since(0) if isinstance(r.entry, StepEntry)]
    assert [s.combine for s in steps] == [True, False]
    run = Run(engine, log.since(0), pushes, {}, engine.store.outer_spec)
    slices, pmap, _ = _replay(run, OPTIMIZERS["adam"], seed=4)
    assert _same(join(pmap, [sl.params() for sl in slices]), dict(engine.store.snapshot().tensors))
