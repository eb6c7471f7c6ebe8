"""The single writer: one asyncio task owns all training state and reads one queue of commands.

Sessions put commands on the queue (join, push, pull, heartbeat, leave); the admin API sends others
(swap policy, status, checkpoint). For each event the engine updates its facts, asks the policy for
decisions, applies them to the store, and hands frames to per-session :class:`Peer` outboxes, which
never block it. Time comes from an injected :class:`Clock`; the engine does not import aiohttp, so
the simulator drives the same code under a virtual clock.

Under :meth:`Engine.run` (the daemon) a released worker's parameters are not encoded at once: the
engine first takes whatever else is already queued (up to :data:`BATCH` commands), then *publishes*
once — runs the queued optimizer steps, takes the snapshot and encodes each (codec, held version)'s
frames once — in a worker thread for models of :data:`OFF_LOOP_PARAMS` or more, while the engine
task awaits it, so one writer still owns the state and the sockets keep flowing. Called directly
(the simulator, unit tests), every command publishes synchronously before it returns.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import math
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import numpy as np

from hetd.codecs import registry as codecs
from hetd.core.downlink import Downlink, Outgoing
from hetd.core.rates import LatencyRecorder, RateMeter
from hetd.core.store import Aggregator, Snapshot, Store, Tensors
from hetd.protocol import wire
from policies.compose import Resolved, describe_state, resolve
from policies.registry import make_policy
from policies.types import (
    Apply,
    Buffer,
    ClusterView,
    Drop,
    Eval,
    Event,
    Flush,
    Join,
    Leave,
    Plan,
    Policy,
    Pull,
    Push,
    PushDecision,
    Release,
    SetStage,
    Tick,
    WorkerFacts,
)

log = logging.getLogger("hetd.core.engine")

BATCH = 64  # commands at most taken before one publish
OFF_LOOP_PARAMS = (
    65_536  # models this big publish in a worker thread (smaller: a thread hop costs more)
)
PROFILE_KEYS = frozenset({"sample_s", "push_s", "pull_s", "compress_s"})
EWMA = 0.5  # smoothing of per-worker timing facts (docs/policies.md)


class Clock(Protocol):
    """Where the engine reads the time (seconds)."""

    def now(self) -> float: ...


class MonotonicClock:
    """Wall time for the real daemon."""

    def now(self) -> float:
        return time.monotonic()


class Peer(Protocol):
    """A session's outbox as the engine sees it: ``send`` never blocks."""

    def send(self, frame: bytes, *, params: bool = False, full: bool = False) -> None: ...

    def close(self, reason: str) -> None: ...


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """What the engine needs to know besides the store and the policy."""

    global_batch: int = 128
    batch_size: int = 32  # initial per-worker batch
    codec: str = "none"  # preferred codec
    downlink: str = "auto"  # lossy codecs' parameters: auto (by link speed), delta, full
    delta_s_per_param: float | None = None  # fixed delta cost for "auto" (None: measured)
    heartbeat_s: float = 2.0
    heartbeat_timeout_s: float = 10.0
    tick_s: float = 0.25
    eval_interval_s: float = 1.0
    max_staleness: int = 1000
    shards: int = 0  # 0: max(4, workers present), fixed per worker at its join
    profile_steps: int = 3  # steps a joining worker times for its profile (0: no profile)
    eval_inline: bool = False  # evaluate inside tick() (the simulator: virtual time, no threads)
    welcome: Mapping[str, Any] = field(default_factory=dict)  # model/dataset/train for the welcome


@dataclass
class WorkerStats:
    """Counters per worker, for status and metrics (engine-owned, mutable)."""

    pushes: int = 0
    applied: int = 0
    buffered: int = 0
    dropped: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    releases: int = 0  # parameter sends (a full set or a delta, however many frames)
    worker_idle_s: float = 0.0  # s the worker reported waiting for parameters
    staleness: list[int] = field(default_factory=list)
    last_seen: float = 0.0
    device: Mapping[str, Any] = field(default_factory=dict)
    slot: int = 0


@dataclass(frozen=True, slots=True)
class PushIn:
    """A decoded, validated push from a session."""

    worker: int
    id: int
    base: int
    kind: str
    tensors: Tensors  # float32 arrays, or int8 ones the store's step dequantizes
    samples: int
    steps: int
    compute_s: float
    loss: float | None
    free_mem: int | None
    nbytes: int
    transfer_s: float | None = None  # s from the worker's send to our receipt, when known
    idle_s: float | None = None  # s the worker waited for parameters before this step


class Engine:
    """Owns facts, policy state, the store and the aggregation buffer."""

    def __init__(
        self,
        store: Store,
        policy: Policy,
        config: EngineConfig,
        clock: Clock | None = None,
        evaluator: Callable[[Snapshot], tuple[float, float]] | None = None,
    ) -> None:
        self.store = store
        self.config = config
        self.clock: Clock = clock or MonotonicClock()
        self.evaluator = evaluator
        self.policy = policy
        self.facts: dict[int, WorkerFacts] = {}
        self.stats: dict[int, WorkerStats] = {}
        self.plans: dict[int, Plan] = {}
        self.peers: dict[int, Peer] = {}
        self.departed: dict[int, WorkerFacts] = {}
        self.departures: deque[tuple[float, int, str]] = deque(maxlen=64)  # (t, worker, reason)
        self.buffers: dict[int, Aggregator] = {}  # group (e.g. round) -> buffered updates
        self.stage = "main"
        self.started_at = self.clock.now()
        self.updates_applied = 0
        self.max_release_gap = 0  # the largest clock lead any worker was released with
        self.evals: list[tuple[float, float, float]] = []  # (t since start, loss, accuracy)
        self.stages: list[tuple[float, str]] = []  # (t since start, stage entered), each switch
        self._next_id = 1
        self.downlink = Downlink(s_per_param=config.delta_s_per_param)
        self._held_refs: dict[int, int] = {}  # worker -> the downlink reference it holds
        self._same_host: set[int] = set()  # workers on loopback: parameters in full are cheaper
        self.bytes_in = 0  # push bytes received, all workers, since start
        self.bytes_out = 0  # parameter bytes sent, all workers, since start
        self.latency = LatencyRecorder()  # s to decide one event: policy, bookkeeping, acks
        self.publish_latency = LatencyRecorder()  # s per publish: steps, snapshot, param frames
        self.wait = LatencyRecorder()  # s a command waited in the queue
        self.rates = RateMeter()  # updates/s and MB/s over the last seconds, sampled on ticks
        self._queue: asyncio.Queue[tuple[float, Callable[[], Any]]] = asyncio.Queue()
        self._last_eval = -math.inf
        self._eval_task: asyncio.Task[None] | None = None
        self._deferred = False  # True while run() drives the engine: releases wait to be published
        self._releases: dict[int, None] = {}  # workers released, not yet sent parameters (ordered)
        self.policy_state: Any = policy.init(self.view())

    # --- the view --------------------------------------------------------------------------------

    def view(self) -> ClusterView:
        """The facts as the policy sees them (active replicas only)."""
        return ClusterView(
            now=self.clock.now(),
            version=self.store.version,
            workers=self.facts,
            global_batch=self.config.global_batch,
            buffered=self.buffered(),
            stage=self.stage,
        )

    # --- the single writer -----------------------------------------------------------------------

    def submit(self, command: Callable[[], Any]) -> None:
        """Queue a command (a closure over engine methods) for the engine task."""
        self._queue.put_nowait((time.perf_counter(), command))

    async def call(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` on the engine task and return its result (or raise its error)."""
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()

        def run() -> None:
            try:
                result = fn()
            except Exception as exc:
                if not fut.done():
                    fut.set_exception(exc)
            else:
                if not fut.done():
                    fut.set_result(result)

        self.submit(run)
        return await fut

    async def run(self) -> None:
        """Process commands until cancelled; a timer task feeds ticks."""
        ticker = asyncio.create_task(self._ticker())
        self._deferred = True
        try:
            while True:
                await self._run_batch(await self._queue.get())
        finally:
            self._deferred = False
            ticker.cancel()
            if self._eval_task is not None:
                self._eval_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await ticker

    async def _run_batch(self, first: tuple[float, Callable[[], Any]]) -> None:
        """Run ``first`` and whatever else is already queued (up to :data:`BATCH`), then publish
        once: one snapshot and one encode serve every release of the batch."""
        item: tuple[float, Callable[[], Any]] | None = first
        taken = 0
        while item is not None:
            queued_at, command = item
            start = time.perf_counter()
            self.wait.add(start - queued_at)
            self._run_command(command)
            self.latency.add(time.perf_counter() - start)
            taken += 1
            item = self._queue.get_nowait() if taken < BATCH and not self._queue.empty() else None
        if self._releases or self.store.pending:
            start = time.perf_counter()
            await self._publish()
            self.publish_latency.add(time.perf_counter() - start)

    def _run_command(self, command: Callable[[], Any]) -> None:
        try:
            command()
        except Exception:  # a bug in one command must not stop training
            log.exception("engine command failed")

    async def _publish(self) -> None:
        """Run queued steps and encode the released workers' frames (off the loop for big
        models, the engine task awaiting), then hand the frames to their outboxes."""
        wants = [
            (
                wid,
                self.facts[wid].codec,
                self.facts[wid].version,
                self._held_refs.get(wid),
                self._link(wid),
            )
            for wid in self._releases
            if wid in self.facts and wid in self.peers
        ]
        self._releases = {}
        try:
            if self.store.n_params >= OFF_LOOP_PARAMS:
                frames = await asyncio.to_thread(self._encode_releases, wants)
            else:
                frames = self._encode_releases(wants)
        except Exception:
            # Nothing to send: rather than leave the released workers waiting for parameters,
            # drop their sessions; they reconnect as themselves and get parameters in full.
            log.exception("publishing parameters failed; dropping %d session(s)", len(wants))
            for wid, *_ in wants:
                peer = self.peers.get(wid)
                if peer is not None:
                    peer.close("the daemon could not encode parameters for this worker; reconnect")
            return
        for wid, *_ in wants:
            self._send_params(wid, frames[wid])

    def _encode_releases(
        self, wants: list[tuple[int, str, int, int | None, float | None]]
    ) -> dict[int, Outgoing]:
        """The release for each (worker, codec, held version, held reference, link bytes/s); one
        encoding per (codec, version, reference), shared by every worker holding it."""
        self.store.flush()
        if not wants:
            return {}
        snap = self.store.snapshot()
        made: dict[tuple[str, int, int | None], Outgoing] = {}
        out = {}
        for wid, codec, held, ref, link in wants:
            key = (codec, held, ref)
            if key not in made:
                made[key] = self.downlink.frames(codec, held, snap, ref, link)
            out[wid] = made[key]
        return out

    async def _ticker(self) -> None:
        while True:
            await asyncio.sleep(self.config.tick_s)
            self.submit(self.tick)

    # --- commands (run on the engine task only) -----------------------------------------------------

    def join(self, hello: wire.Message, peer: Peer, same_host: bool = False) -> int:
        """Admit a worker: facts, plan, welcome; the policy decides when it may start.
        ``same_host``: it connected over loopback (no link worth compressing parameters for)."""
        now = self.clock.now()
        resume = hello.get("resume") or {}
        old_id = resume.get("worker_id")
        offered = [c for c in hello["codecs"] if isinstance(c, str)]
        codec = codecs.negotiate(offered, self.config.codec)  # raises before anything changes
        saved: WorkerFacts | None = None
        if isinstance(old_id, int) and old_id in self.departed and old_id not in self.facts:
            wid = old_id
            saved = self.departed.pop(wid)
        else:
            wid = self._next_id
            self._next_id += 1
        start_clock = self.view().min_clock() if self.facts else 0
        if saved is not None:  # a returning worker keeps its clock, never below the slowest
            start_clock = max(saved.clock, start_clock) if self.facts else saved.clock
        used = {s.slot for w, s in self.stats.items() if w in self.facts}
        slot = next(i for i in range(len(used) + 1) if i not in used)
        device = hello["device"]
        free_mem = device.get("free_memory") if isinstance(device.get("free_memory"), int) else None
        self.facts[wid] = WorkerFacts(
            worker=wid,
            name=hello["name"],
            clock=start_clock,
            version=-1,  # holds nothing yet: its first parameters go in full
            waiting=True,
            joined_at=now,
            batch_size=self.config.batch_size,
            free_mem=free_mem,
            codec=codec,
            waiting_since=now,
        )
        self.stats[wid] = WorkerStats(last_seen=now, device=dict(device), slot=slot)
        self.plans[wid] = Plan(batch_size=self.config.batch_size, codec=codec, stage=self.stage)
        self.peers[wid] = peer
        if same_host:
            self._same_host.add(wid)
        # Automatic shards are disjoint for up to 4 workers (fewer workers leave some data unused:
        # set [train] shards to their number). Overlapping shares (the first worker on everything,
        # the k-th on 1/k) covered all data but trained the 4-worker demo ~30 % slower.
        shards = self.config.shards or max(4, len(self.facts))
        peer.send(
            wire.encode(
                "welcome",
                hello.id,
                worker_id=wid,
                plan=self.plans[wid].to_wire(),
                heartbeat_s=self.config.heartbeat_s,
                shard={"index": slot % shards, "count": shards},
                **self.config.welcome,
            )
        )
        if self.config.profile_steps > 0:
            spec = {"steps": self.config.profile_steps, "batch_size": self.config.batch_size}
            peer.send(wire.encode("profile", 0, spec=spec))
        log.info("worker %d (%s) joined on slot %d, codec %s", wid, hello["name"], slot, codec)
        self._dispatch(Join(now, wid))
        return wid

    def leave(self, wid: int, reason: str) -> None:
        """A worker left; it leaves every barrier at once."""
        facts = self.facts.pop(wid, None)
        if facts is None:
            return
        self.departed[wid] = facts
        self._held_refs.pop(wid, None)
        self._same_host.discard(wid)
        peer = self.peers.pop(wid, None)
        if peer is not None:
            peer.close(reason)
        self.departures.append((self.clock.now() - self.started_at, wid, reason))
        log.info("worker %d left: %s", wid, reason)
        self._dispatch(Leave(self.clock.now(), wid, reason))

    def profile_result(self, wid: int, result: Mapping[str, Any]) -> None:
        """A worker's profile run: finite, non-negative seconds for the known keys go into its
        facts (anything else is ignored); policies see it with the next event."""
        facts = self.facts.get(wid)
        if facts is None:
            return
        clean = {
            k: float(v)
            for k, v in result.items()
            if k in PROFILE_KEYS
            and isinstance(v, int | float)
            and not isinstance(v, bool)
            and math.isfinite(v)
            and v >= 0
        }
        self.facts[wid] = dataclasses.replace(facts, profile=clean)
        self.stats[wid].last_seen = self.clock.now()
        log.info("worker %d profile: %s", wid, clean)
        self._dispatch(Tick(self.clock.now()))

    def heartbeat(self, wid: int) -> None:
        """A sign of life."""
        if wid in self.stats:
            self.stats[wid].last_seen = self.clock.now()

    def pull(self, wid: int, have: int | None = None) -> None:
        """A worker asks for parameters (``have``: the version it holds; None: send them in full);
        the gate decides when it gets them."""
        facts = self.facts.get(wid)
        if facts is None:
            return
        now = self.clock.now()
        self.stats[wid].last_seen = now
        held = facts.version if have is not None and have == facts.version else -1
        self.facts[wid] = dataclasses.replace(
            facts, waiting=True, waiting_since=facts.waiting_since or now, version=held
        )
        self._dispatch(Pull(now, wid))

    def push(self, p: PushIn) -> None:
        """One validated update: facts, policy, store, ack."""
        facts = self.facts.get(p.worker)
        if facts is None:
            return
        now = self.clock.now()
        st = self.stats[p.worker]
        st.last_seen = now
        st.pushes += 1
        st.bytes_in += p.nbytes
        self.bytes_in += p.nbytes
        st.worker_idle_s += p.idle_s or 0.0
        staleness = max(0, self.store.version - p.base)
        st.staleness.append(staleness)
        if len(st.staleness) > 4096:
            del st.staleness[:2048]

        def ewma(old: float | None, new: float) -> float:
            return new if old is None else EWMA * new + (1 - EWMA) * old

        self.facts[p.worker] = dataclasses.replace(
            facts,
            clock=facts.clock + 1,
            waiting=True,
            waiting_since=now,
            prev_push_at=facts.last_push_at,
            last_push_at=now,
            compute_s=ewma(facts.compute_s, p.compute_s),
            sample_s=ewma(facts.sample_s, p.compute_s / max(1, p.samples))
            if p.samples
            else facts.sample_s,
            push_bytes=ewma(facts.push_bytes, float(p.nbytes)),
            link_bps=ewma(facts.link_bps, p.nbytes / p.transfer_s)
            if p.transfer_s and p.transfer_s > 0
            else facts.link_bps,
            samples=facts.samples + p.samples,
            free_mem=p.free_mem if p.free_mem is not None else facts.free_mem,
        )
        kind: Literal["grad", "delta"] = "grad" if p.kind == "grad" else "delta"
        event = Push(now, p.worker, p.base, kind, p.samples, p.steps, p.compute_s, p.loss)
        if p.base > self.store.version or staleness > self.config.max_staleness:
            why = "base version from the future" if p.base > self.store.version else "too stale"
            self._ack(p, "dropped", why)
            st.dropped += 1
            self._dispatch(Tick(now))  # the clock moved: gates may open
            return
        self._dispatch(event, p)

    def swap_policy(self, name: str, params: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """Replace the policy between two events; on any error the old one stays."""
        new = make_policy(name, params)
        state = new.init(self.view())
        if self.buffered():  # never lose buffered updates: apply them before the change
            self._flush(Flush(normalize=True))
        old = self.policy.name
        self.policy, self.policy_state = new, state
        log.info("policy swapped: %s -> %s %s", old, new.name, dict(new.params))
        self._dispatch(Tick(self.clock.now()))
        return new.describe()

    def tick(self) -> None:
        """Time passes: heartbeats, evaluation, and a chance for gates to open."""
        now = self.clock.now()
        self.rates.sample(now, self.updates_applied, self.bytes_in, self.bytes_out)
        for wid, st in list(self.stats.items()):
            if wid in self.facts and now - st.last_seen > self.config.heartbeat_timeout_s:
                self.leave(wid, "heartbeat timeout")
        if (
            self.evaluator is not None
            and self._eval_task is None
            and now - self._last_eval >= self.config.eval_interval_s
        ):
            self._last_eval = now
            if self.config.eval_inline:
                loss, acc = self.evaluator(self.store.snapshot())
                self.record_eval(loss, acc)
            else:
                self._eval_task = asyncio.get_running_loop().create_task(
                    self._evaluate(self.store.snapshot())
                )
        self._dispatch(Tick(now))

    async def _evaluate(self, snap: Snapshot) -> None:
        assert self.evaluator is not None  # checked by the caller; not network input
        try:
            loss, acc = await asyncio.to_thread(self.evaluator, snap)
        finally:
            self._eval_task = None
        self.submit(lambda: self.record_eval(loss, acc))

    def record_eval(self, loss: float, accuracy: float) -> None:
        """Store an evaluation and tell the policy."""
        now = self.clock.now()
        self.evals.append((now - self.started_at, loss, accuracy))
        self._dispatch(Eval(now, loss, accuracy))

    # --- decisions -------------------------------------------------------------------------------

    def _dispatch(self, event: Event, push: PushIn | None = None) -> None:
        try:
            decisions, state = self.policy.update(event, self.policy_state, self.view())
            resolved = resolve(decisions)  # raises on a policy bug (e.g. an unknown plan field)
        except Exception:
            log.exception(
                "policy %s failed on %s; applying asynchronously", self.policy.name, event
            )
            state = self.policy_state
            fallback = () if push is None else (Apply(1.0 / max(1, len(self.facts))),)
            resolved = resolve(fallback)
        self.policy_state = state
        self._execute(resolved, push)

    def _execute(self, r: Resolved, push: PushIn | None) -> None:
        """Carry out one event's resolved decisions (the rules are :func:`policies.resolve`'s)."""
        # Plans first, so a worker released by this event computes under its new plan.
        for d in r.plans:
            if isinstance(d, SetStage):
                self._set_stage(d.stage)
            else:
                self._set_plan(d.worker, d.fields)
        for a in r.actions:
            if isinstance(a, Flush):
                self._flush(a)
            elif isinstance(a, Release):
                self._release(a.worker)
            elif push is not None:
                self._decide_push(a, push, r.scale)
        if push is not None and r.push is None:
            # A policy that says nothing about a push must not lose it.
            log.warning("policy %s made no decision on a push; applying it", self.policy.name)
            self._decide_push(Apply(1.0 / max(1, len(self.facts))), push, r.scale)

    def _decide_push(self, d: PushDecision, p: PushIn, factor: float) -> None:
        st = self.stats[p.worker]
        if isinstance(d, Apply):
            self.store.apply(p.kind, p.tensors, d.weight * factor)
            self.updates_applied += 1
            st.applied += 1
            self._ack(p, "applied")
        elif isinstance(d, Buffer):
            self.buffers.setdefault(d.group, Aggregator()).add(p.kind, p.tensors, d.weight * factor)
            st.buffered += 1
            self._ack(p, "buffered")
        elif isinstance(d, Drop):
            st.dropped += 1
            self._ack(p, "dropped", d.reason)

    def buffered(self) -> int:
        """Pushes waiting in aggregation buffers."""
        return sum(b.count for b in self.buffers.values())

    def _flush(self, d: Flush) -> None:
        groups = sorted(g for g in self.buffers if d.upto is None or g <= d.upto)
        for g in groups:
            agg = self.buffers.pop(g, None)
            if agg is None or not agg.count:
                continue
            for kind, tensors in agg.take(d.normalize):
                self.store.apply(kind, tensors, d.scale)
            self.updates_applied += 1

    def _release(self, wid: int) -> None:
        facts = self.facts.get(wid)
        peer = self.peers.get(wid)
        if facts is None or peer is None or not facts.waiting:
            return
        now = self.clock.now()
        gap = facts.clock - min(f.clock for f in self.facts.values())
        self.max_release_gap = max(self.max_release_gap, gap)
        idle = now - facts.waiting_since if facts.waiting_since is not None else 0.0
        self.facts[wid] = dataclasses.replace(
            facts,
            waiting=False,
            waiting_since=None,
            idle_s=facts.idle_s + idle,
        )
        if self._deferred:
            self._releases[wid] = None
            return
        release = self.downlink.frames(
            facts.codec,
            facts.version,
            self.store.snapshot(),
            self._held_refs.get(wid),
            self._link(wid),
        )
        self._send_params(wid, release)

    def _link(self, wid: int) -> float | None:
        """The worker's link in bytes/s for the downlink's choice: unbounded for loopback or
        ``downlink = "full"``, unknown (deltas) for ``"delta"``."""
        mode = self.config.downlink
        if mode == "full" or (mode == "auto" and wid in self._same_host):
            return math.inf
        return None if mode == "delta" else self.facts[wid].link_bps

    def _send_params(self, wid: int, release: Outgoing) -> None:
        facts, peer = self.facts.get(wid), self.peers.get(wid)
        if facts is None or peer is None:
            return
        self.facts[wid] = dataclasses.replace(facts, version=release.version)
        if release.ref is None:
            self._held_refs.pop(wid, None)
        else:
            self._held_refs[wid] = release.ref
        self.stats[wid].releases += 1
        for frame in release.frames:
            self.stats[wid].bytes_out += len(frame)
            self.bytes_out += len(frame)
            peer.send(frame, params=True, full=release.full)

    def _set_plan(self, wid: int, fields: Mapping[str, Any]) -> None:
        plan = self.plans.get(wid)
        if plan is None:
            return
        new = plan.merge(fields)  # checked: resolve() raised on unknown fields already
        if new == plan:
            return
        self.plans[wid] = new
        self.facts[wid] = dataclasses.replace(self.facts[wid], batch_size=new.batch_size)
        self.peers[wid].send(wire.encode("plan", 0, plan=new.to_wire()))

    def _set_stage(self, stage: str) -> None:
        if stage == self.stage:
            return
        at = self.clock.now() - self.started_at
        log.info("stage %s -> %s at %.2f s", self.stage, stage, at)
        self.stage = stage
        self.stages.append((at, stage))
        for wid in list(self.plans):
            self._set_plan(wid, {"stage": stage})

    def _ack(self, p: PushIn, status: str, reason: str | None = None) -> None:
        peer = self.peers.get(p.worker)
        if peer is not None:
            peer.send(
                wire.encode("ack", p.id, version=self.store.version, status=status, reason=reason)
            )

    # --- read-only summaries (call through ``call`` from other tasks) ----------------------------

    def status(self) -> dict[str, Any]:
        """The daemon at a glance."""
        last = self.evals[-1] if self.evals else None
        return {
            "version": self.store.version,
            "stage": self.stage,
            "stage_switches": [{"at_s": t, "stage": st} for t, st in self.stages[-20:]],
            "policy": self.policy.describe(),
            "policy_state": describe_state(self.policy_state),
            "uptime_s": self.clock.now() - self.started_at,
            "workers": len(self.facts),
            "updates_applied": self.updates_applied,
            "max_release_gap": self.max_release_gap,
            "accuracy": None if last is None else last[2],
            "loss": None if last is None else last[1],
            "throughput": self.rates.rates(),
            "engine_latency": self.latency.summary(),
            "publish_latency": self.publish_latency.summary(),
            "queue_wait": self.wait.summary(),
        }

    def workers(self) -> list[dict[str, Any]]:
        """One row per active worker."""
        now = self.clock.now()
        rows = []
        for wid, f in sorted(self.facts.items()):
            st = self.stats[wid]
            alive = max(1e-9, now - f.joined_at)
            rows.append(
                {
                    "worker": wid,
                    "name": f.name,
                    "device": dict(st.device),
                    "clock": f.clock,
                    "samples": f.samples,
                    "samples_per_s": f.samples / alive,
                    "compute_s": f.compute_s,
                    "batch_size": f.batch_size,
                    "codec": self.plans[wid].codec,  # what its pushes use (the plan's)
                    "params_codec": f.codec,  # what its parameters come in (negotiated)
                    "pushes": st.pushes,
                    "applied": st.applied,
                    "dropped": st.dropped,
                    "staleness_mean": float(np.mean(st.staleness)) if st.staleness else 0.0,
                    "idle_fraction": min(1.0, f.idle_s / alive),
                    "worker_idle_s": st.worker_idle_s,
                    "link_bps": f.link_bps,
                    "bytes_in": st.bytes_in,
                    "bytes_out": st.bytes_out,
                    "bytes_per_push": st.bytes_in / max(1, st.pushes),
                    # encoded push bytes / the same update in float32 (frame overhead included)
                    "push_ratio": st.bytes_in / max(1, st.pushes) / (4 * self.store.n_params),
                    "bytes_per_pull": st.bytes_out / max(1, st.releases),
                    "pull_ratio": st.bytes_out / max(1, st.releases) / (4 * self.store.n_params),
                    "last_seen_s": now - st.last_seen,
                    "plan": self.plans[wid].to_wire(),
                }
            )
        return rows
