"""The single writer: one asyncio task owns all training state and reads one queue of commands.

Sessions put commands on the queue (join, push, pull, heartbeat, leave) with typed inputs
(:class:`~hetd.protocol.messages.JoinIn`, :class:`~hetd.protocol.messages.PushIn`); the admin API
sends others (swap policy, status, checkpoint). For each event the engine updates its facts, asks
the policy for decisions, applies them to the store, and hands typed replies (welcome, ack, plan,
profile request) and encoded parameter frames to per-session :class:`Peer` outboxes, which never
block it. Time comes from an injected :class:`Clock`; the engine imports neither aiohttp nor the
wire format, so the simulator drives the same code under a virtual clock.

The engine owns one :class:`WorkerEntry` per worker (facts, counters, plan, peer, the parameters
it holds), active or departed, and its whole training state as an :class:`EngineState`
(:meth:`Engine.state` / :meth:`Engine.restore`; checkpoints store that).

Under :meth:`Engine.run` (the daemon) a released worker's parameters are not encoded at once: the
engine first takes whatever else is already queued (up to :data:`BATCH` commands), then *publishes*
once — applies the batch's updates (one optimizer step of their weighted sum per kind:
:attr:`hetd.core.store.Store.combine`), takes the snapshot and encodes each (codec, held version)'s
frames once — in a worker thread for models of :data:`OFF_LOOP_PARAMS` or more, while the engine
task awaits it, so one writer still owns the state and the sockets keep flowing. Called directly
(unit tests), every command publishes synchronously before it returns; after
:meth:`Engine.defer_publishing` (the simulator) the caller publishes each batch with
:meth:`Engine.publish_batch`, as :meth:`Engine.run` does.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import logging
import math
import secrets
import statistics
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Generic, Literal, Protocol, TypeVar

import jax
import numpy as np

from hetd.codecs import registry as codecs
from hetd.core.downlink import Downlink, Outgoing
from hetd.core.ingest import update_norm
from hetd.core.rates import LatencyRecorder, RateMeter
from hetd.core.store import Aggregator, Snapshot, Store
from hetd.protocol.messages import (
    Ack,
    AckStatus,
    Bye,
    ErrorReply,
    JoinIn,
    PlanUpdate,
    ProfileRequest,
    PushIn,
    Reply,
    Welcome,
)
from policies.compose import Resolved, describe_state, resolve
from policies.registry import PolicyError, make_policy
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
# A worker's link is the fastest of its last pushes, send to receipt: a busy host (a worker not
# yet scheduled, a daemon loop with other work) only ever makes a transfer look slower, never
# faster, so the max of a short window reads the link and the mean reads the host's load (seen:
# 36-98 MB/s measured on 1 GB/s links under load, and H-PS cutting bits it did not need to).
LINK_WINDOW = 8
GUARD_WINDOW = 256  # accepted pushes' norms per kind the update guard takes its median over
MAX_NORM = math.sqrt(float(np.finfo(np.float32).max))  # a larger norm's square overflows float32


class Clock(Protocol):
    """Where the engine reads the time (seconds)."""

    def now(self) -> float: ...


class MonotonicClock:
    """Wall time for the real daemon."""

    def now(self) -> float:
        return time.monotonic()


class Peer(Protocol):
    """A session's outbox as the engine sees it; nothing here blocks."""

    def send(self, reply: Reply) -> None:
        """Queue a control reply (the peer encodes it, or reads it as it is)."""
        ...

    def send_params(self, frame: bytes, *, full: bool) -> None:
        """Queue one encoded ``params`` frame of a release (``full``: it replaces every
        parameter frame still queued)."""
        ...

    def close(self, reason: str) -> None:
        """End the session after what is queued."""
        ...


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """What the engine needs to know besides the store and the policy."""

    global_batch: int = 128
    batch_size: int = 32  # initial per-worker batch
    codec: str = "none"  # preferred codec
    downlink: str = "auto"  # lossy codecs' parameters: auto (by link speed), delta, full
    delta_s_per_param: float | None = None  # fixed delta cost for "auto" (None: measured)
    param_hashes: bool = True  # full params frames carry the version's hash (workers verify)
    heartbeat_s: float = 2.0
    heartbeat_timeout_s: float = 10.0
    tick_s: float = 0.25
    eval_interval_s: float = 1.0
    max_staleness: int = 1000
    shards: int = 0  # 0: max(4, workers present), fixed per worker at its join
    profile_steps: int = 3  # steps a joining worker times for its profile (0: no profile)
    eval_inline: bool = False  # evaluate inside tick() (the simulator: virtual time, no threads)
    # The update guard ([train] guard_factor, guard_warmup): refuse a push whose norm is over
    # guard_factor x the median norm of the accepted pushes of its kind, once guard_warmup of them
    # were accepted. 0: off (the default here: the simulator's emulated workers do not take an
    # ``error`` reply; the daemon sets it from its config).
    guard_factor: float = 0.0
    guard_warmup: int = 20
    welcome: Mapping[str, Any] = field(default_factory=dict)  # model/dataset/train for the welcome


@dataclass
class WorkerStats:
    """Counters per worker, for status and metrics (engine-owned, mutable)."""

    pushes: int = 0
    applied: int = 0
    buffered: int = 0
    dropped: int = 0
    refused: int = 0  # pushes the update guard refused (not counted in ``pushes``)
    duplicates: int = 0  # pushes acked ``duplicate``: seen before, never applied twice (ditto)
    bytes_in: int = 0
    bytes_out: int = 0
    releases: int = 0  # parameter sends (a full set or a delta, however many frames)
    worker_idle_s: float = 0.0  # s the worker reported waiting for parameters
    staleness: list[int] = field(default_factory=list)
    last_seen: float = 0.0
    device: Mapping[str, Any] = field(default_factory=dict)
    slot: int = 0
    # bytes/s of its last LINK_WINDOW pushes, send to receipt (the link estimate is their max)
    link_rates: deque[float] = field(default_factory=lambda: deque(maxlen=LINK_WINDOW))


@dataclass(eq=False, slots=True)
class WorkerEntry:
    """Everything the engine keeps about one worker (engine-owned, mutable). ``facts`` is what
    policies see (replaced, never mutated: the engine keeps its view index in step); ``peer`` is
    None once the worker left."""

    facts: WorkerFacts
    stats: WorkerStats
    plan: Plan
    peer: Peer | None
    held_ref: int | None = None  # the downlink reference it holds (its parameters' base)
    same_host: bool = False  # it connected over loopback: parameters in full are cheaper
    hashes: bool = False  # its hello named "hash": its full frames carry the parameters' hash
    # the request id of the last push the engine answered with an ack (applied, buffered or
    # dropped); a push with this id or an older one is a duplicate. Kept across reconnects and in
    # checkpoints: a worker's push ids increase for as long as it is that worker.
    last_push: int = 0
    # what the worker must show to resume this id (its welcome gave it; "" from an old
    # checkpoint: nobody can resume it)
    secret: str = ""


@dataclass(frozen=True, slots=True)
class SavedWorker:
    """A worker as a restart remembers it: enough to give it its clock back when it returns."""

    name: str
    clock: int
    samples: int = 0
    idle_s: float = 0.0
    batch_size: int = 32
    codec: str = "none"
    active: bool = False  # it was connected when the state was taken
    last_push: int = 0  # the request id of its last push answered (exactly-once)
    secret: str = ""  # what it must show to resume its id ("": nobody can)


@dataclass(frozen=True, slots=True)
class EngineState:
    """Everything a restart needs (what a checkpoint stores), as host values.

    ``policy_state`` is the policy's own state object; a checkpoint stores a serialised form of it
    (or None: the restored policy's ``init`` rebuilds one), turned back by :meth:`Engine.restore`'s
    ``revive``.
    """

    params: Mapping[str, np.ndarray]  # host copies
    opt_state: Any  # the store's optimizer state (host pytree)
    version: int
    buffers: Mapping[int, Mapping[str, Any]]  # round -> Aggregator.state(), non-empty ones only
    policy: str
    policy_params: Mapping[str, Any]
    policy_state: Any
    stage: str
    updates_applied: int
    next_id: int  # the id the next new worker gets
    workers: Mapping[int, SavedWorker]  # every worker known, active or departed


_V = TypeVar("_V")


class _Column(Mapping[int, _V], Generic[_V]):
    """One field of the worker entries of some tables, by worker id: read-only and live."""

    __slots__ = ("_attr", "_tables")

    def __init__(self, attr: str, *tables: Mapping[int, WorkerEntry]) -> None:
        self._attr = attr
        self._tables = tables

    def __getitem__(self, wid: int) -> _V:
        for table in self._tables:
            entry = table.get(wid)
            if entry is not None:
                value: _V = getattr(entry, self._attr)
                return value
        raise KeyError(wid)

    def __iter__(self) -> Iterator[int]:
        for table in self._tables:
            yield from table

    def __len__(self) -> int:
        return sum(len(table) for table in self._tables)


class Engine:
    """Owns the workers' entries, policy state, the store and the aggregation buffers."""

    def __init__(
        self,
        store: Store,
        policy: Policy,
        config: EngineConfig,
        clock: Clock | None = None,
        evaluator: Callable[[Snapshot], tuple[float, float]] | None = None,
    ) -> None:
        self.store = store
        store.hashes = config.param_hashes  # a snapshot's frame carries its hash (or not)
        self.config = config
        self.clock: Clock = clock or MonotonicClock()
        self.evaluator = evaluator
        self.policy = policy
        self._workers: dict[int, WorkerEntry] = {}  # active workers
        self._departed: dict[int, WorkerEntry] = {}  # left (or known from a checkpoint)
        self._facts: dict[int, WorkerFacts] = {}  # the active workers' facts: the policy's view
        self.departures: deque[tuple[float, int, str]] = deque(maxlen=64)  # (t, worker, reason)
        self.buffers: dict[int, Aggregator] = {}  # group (e.g. round) -> buffered updates
        self.stage = "main"
        self.started_at = self.clock.now()
        self.updates_applied = 0
        self.publishes = 0  # batches published by run() (updates_applied / publishes: batch size)
        self.max_release_gap = 0  # the largest clock lead any worker was released with
        self.evals: list[tuple[float, float, float]] = []  # (t since start, loss, accuracy)
        self.stages: list[tuple[float, str]] = []  # (t since start, stage entered), each switch
        self._next_id = 1
        self.downlink = Downlink(s_per_param=config.delta_s_per_param, hashes=config.param_hashes)
        self.bytes_in = 0  # push bytes received, all workers, since start
        self.bytes_out = 0  # parameter bytes sent, all workers, since start
        self.latency = LatencyRecorder()  # s to decide one event: policy, bookkeeping, acks
        self.publish_latency = LatencyRecorder()  # s per publish: steps, snapshot, param frames
        self.wait = LatencyRecorder()  # s a command waited in the queue
        self.rates = RateMeter()  # updates/s and MB/s over the last seconds, sampled on ticks
        # the update guard's window: kind -> the norms of its last accepted pushes, newest last
        self.guard_norms: dict[str, deque[float]] = {}
        self._queue: asyncio.Queue[tuple[float, Callable[[], Any]]] = asyncio.Queue()
        self._last_eval = -math.inf
        self._eval_task: asyncio.Task[None] | None = None
        self._deferred = False  # True while run() drives the engine: releases wait to be published
        self._releases: dict[int, None] = {}  # workers released, not yet sent parameters (ordered)
        self.policy_state: Any = policy.init(self.view())

    # --- the workers -----------------------------------------------------------------------------

    @property
    def entries(self) -> Mapping[int, WorkerEntry]:
        """The active workers' entries, by id (read-only, live)."""
        return MappingProxyType(self._workers)

    @property
    def facts(self) -> Mapping[int, WorkerFacts]:
        """The active workers' facts, by id (read-only, live)."""
        return MappingProxyType(self._facts)

    @property
    def departed(self) -> Mapping[int, WorkerFacts]:
        """The facts of workers that left (or that a restored checkpoint knows), by id: each gets
        its clock back when it reconnects (read-only, live)."""
        return _Column("facts", self._departed)

    @property
    def stats(self) -> Mapping[int, WorkerStats]:
        """Every worker's counters, active or departed, by id (read-only, live)."""
        return _Column("stats", self._workers, self._departed)

    @property
    def plans(self) -> Mapping[int, Plan]:
        """The active workers' plans, by id (read-only, live)."""
        return _Column("plan", self._workers)

    def _put(self, entry: WorkerEntry, facts: WorkerFacts) -> None:
        """Replace an active worker's facts (in its entry and in the policy's view)."""
        entry.facts = facts
        self._facts[facts.worker] = facts

    # --- the view --------------------------------------------------------------------------------

    def view(self) -> ClusterView:
        """The facts as the policy sees them (active replicas only)."""
        return ClusterView(
            now=self.clock.now(),
            version=self.store.version,
            workers=self._facts,
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
        evals = asyncio.create_task(self._eval_timer())
        self._deferred = True
        self.store.combine = True  # a batch's updates: one optimizer step of their weighted sum
        try:
            while True:
                await self._run_batch(await self._queue.get())
        finally:
            self._deferred = False
            self.store.combine = False
            ticker.cancel()
            evals.cancel()
            if self._eval_task is not None:
                self._eval_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await ticker
            with contextlib.suppress(asyncio.CancelledError):
                await evals

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
            self.publishes += 1
            await self._publish()
            self.publish_latency.add(time.perf_counter() - start)

    def _run_command(self, command: Callable[[], Any]) -> None:
        try:
            command()
        except Exception:  # a bug in one command must not stop training
            log.exception("engine command failed")

    def defer_publishing(self) -> None:
        """Publish as the daemon does, for a caller that runs commands in batches without
        :meth:`run` (the simulator's daemon server): releases wait for :meth:`publish_batch`,
        and the updates queued in between go through one optimizer step of their weighted sum."""
        self._deferred = True
        self.store.combine = True

    def publish_batch(self) -> None:
        """What :meth:`run` does after each batch, synchronously: apply the batch's updates,
        encode the released workers' frames once per (codec, held version) and send them."""
        if self._releases or self.store.pending:
            self.publishes += 1
            wants = self._take_releases()
            frames = self._encode_releases(wants)
            for wid, *_ in wants:
                self._send_params(wid, frames[wid])

    def _take_releases(self) -> list[tuple[int, str, int, int | None, float | None, bool]]:
        wants = [
            (
                wid,
                entry.facts.codec,
                entry.facts.version,
                entry.held_ref,
                self._link(entry),
                entry.hashes,
            )
            for wid in self._releases
            if (entry := self._workers.get(wid)) is not None
        ]
        self._releases = {}
        return wants

    async def _publish(self) -> None:
        """Run queued steps and encode the released workers' frames (off the loop for big
        models, the engine task awaiting), then hand the frames to their outboxes."""
        wants = self._take_releases()
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
                entry = self._workers.get(wid)
                if entry is not None and entry.peer is not None:
                    entry.peer.close(
                        "the daemon could not encode parameters for this worker; reconnect"
                    )
            return
        for wid, *_ in wants:
            self._send_params(wid, frames[wid])

    def _encode_releases(
        self, wants: list[tuple[int, str, int, int | None, float | None, bool]]
    ) -> dict[int, Outgoing]:
        """The release for each (worker, codec, held version, held reference, link bytes/s, takes
        the hash); one encoding per (codec, version, reference, hash), shared by every worker
        holding it."""
        self.store.flush()
        if not wants:
            return {}
        snap = self.store.snapshot()
        made: dict[tuple[str, int, int | None, bool], Outgoing] = {}
        out = {}
        for wid, codec, held, ref, link, hashes in wants:
            key = (codec, held, ref, hashes)
            if key not in made:
                made[key] = self.downlink.frames(codec, held, snap, ref, link, hashes=hashes)
            out[wid] = made[key]
        return out

    async def _ticker(self) -> None:
        while True:
            await asyncio.sleep(self.config.tick_s)
            self.submit(self.tick)

    async def _eval_timer(self) -> None:
        """Evaluations on their grid, not at the first tick after it (ticks are 0.25 s apart)."""
        while True:
            due = self._last_eval + self.config.eval_interval_s - self.clock.now()
            await asyncio.sleep(max(0.01, due) if math.isfinite(due) else self.config.tick_s)
            self.submit(lambda: self._evaluate_if_due(self.clock.now()))

    # --- commands (run on the engine task only) -----------------------------------------------------

    def join(self, hello: JoinIn, peer: Peer) -> int:
        """Admit a worker: facts, plan, welcome with a new random secret; the policy decides when
        it may start. A worker that says it is a known one (``resume_id``) and shows that worker's
        secret gets its id, clock, last push id and secret back (an active one's old session
        leaves first: it reconnected before its old socket was seen to die); a wrong or missing
        secret makes it a new worker."""
        now = self.clock.now()
        codec = codecs.negotiate(list(hello.codecs), self.config.codec)  # raises before any change
        saved: WorkerFacts | None = None
        last_push = 0
        secret = ""
        rid = hello.resume_id
        if rid is not None and self._may_resume(rid, hello.resume_secret):
            if rid in self._workers:
                self.leave(rid, "resumed on a new connection")
            old = self._departed.pop(rid)
            wid, saved, last_push, secret = rid, old.facts, old.last_push, old.secret
        else:
            if rid is not None:
                log.warning("worker %s: resume refused (wrong or no secret); a new id", rid)
            wid = self._next_id
            self._next_id += 1
        secret = secret or secrets.token_urlsafe(32)
        start_clock = self.view().min_clock() if self._workers else 0
        if saved is not None:  # a returning worker keeps its clock, never below the slowest
            start_clock = max(saved.clock, start_clock) if self._workers else saved.clock
        used = {e.stats.slot for e in self._workers.values()}
        slot = next(i for i in range(len(used) + 1) if i not in used)
        facts = WorkerFacts(
            worker=wid,
            name=hello.name,
            clock=start_clock,
            version=-1,  # holds nothing yet: its first parameters go in full
            waiting=True,
            joined_at=now,
            batch_size=self.config.batch_size,
            free_mem=hello.free_mem,
            codec=codec,
            waiting_since=now,
        )
        entry = WorkerEntry(
            facts=facts,
            stats=WorkerStats(last_seen=now, device=dict(hello.device), slot=slot),
            plan=self._default_plan(facts, self.stage),
            peer=peer,
            same_host=hello.same_host,
            hashes="hash" in hello.features,
            last_push=last_push,
            secret=secret,
        )
        self._workers[wid] = entry
        self._facts[wid] = facts
        # Automatic shards are disjoint for up to 4 workers (fewer workers leave some data unused:
        # set [train] shards to their number). Overlapping shares (the first worker on everything,
        # the k-th on 1/k) covered all data but trained the 4-worker demo ~30 % slower.
        shards = self.config.shards or max(4, len(self._workers))
        peer.send(
            Welcome(
                id=hello.id,
                worker_id=wid,
                plan=entry.plan,
                heartbeat_s=self.config.heartbeat_s,
                shard=slot % shards,
                shards=shards,
                setup=self.config.welcome,
                secret=secret,
            )
        )
        if self.config.profile_steps > 0:
            peer.send(ProfileRequest(self.config.profile_steps, self.config.batch_size))
        log.info("worker %d (%s) joined on slot %d, codec %s", wid, hello.name, slot, codec)
        self._dispatch(Join(now, wid))
        return wid

    def _may_resume(self, wid: int, secret: str | None) -> bool:
        """Whether ``secret`` is known worker ``wid``'s (compared in constant time)."""
        entry = self._workers.get(wid) or self._departed.get(wid)
        if entry is None or not entry.secret or not secret:
            return False
        return hmac.compare_digest(secret.encode(), entry.secret.encode())

    def leave(self, wid: int, reason: str, peer: Peer | None = None) -> None:
        """A worker left; it leaves every barrier at once (its entry is kept as departed).
        ``peer``: the session that ended; nothing happens when the worker is now on another one
        (it resumed on a new connection first)."""
        entry = self._workers.get(wid)
        if entry is None or (peer is not None and entry.peer is not peer):
            return
        del self._workers[wid]
        del self._facts[wid]
        peer, entry.peer, entry.held_ref, entry.same_host = entry.peer, None, None, False
        entry.hashes = False
        self._departed[wid] = entry
        if peer is not None:
            peer.close(reason)
        self.departures.append((self.clock.now() - self.started_at, wid, reason))
        log.info("worker %d left: %s", wid, reason)
        self._dispatch(Leave(self.clock.now(), wid, reason))

    def bye_all(self, reason: str) -> None:
        """Say bye to every worker and let it leave (they may reconnect later)."""
        for wid, entry in list(self._workers.items()):
            if entry.peer is not None:
                entry.peer.send(Bye(reason))
            self.leave(wid, reason)

    def profile_result(self, wid: int, result: Mapping[str, Any]) -> None:
        """A worker's profile run: finite, non-negative seconds for the known keys go into its
        facts (anything else is ignored); policies see it with the next event."""
        entry = self._workers.get(wid)
        if entry is None:
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
        self._put(entry, dataclasses.replace(entry.facts, profile=clean))
        entry.stats.last_seen = self.clock.now()
        log.info("worker %d profile: %s", wid, clean)
        self._dispatch(Tick(self.clock.now()))

    def heartbeat(self, wid: int) -> None:
        """A sign of life."""
        entry = self._workers.get(wid)
        if entry is not None:
            entry.stats.last_seen = self.clock.now()

    def pull(self, wid: int, have: int | None = None) -> None:
        """A worker asks for parameters (``have``: the version it holds; None: send them in full);
        the gate decides when it gets them."""
        entry = self._workers.get(wid)
        if entry is None:
            return
        facts = entry.facts
        now = self.clock.now()
        entry.stats.last_seen = now
        held = facts.version if have is not None and have == facts.version else -1
        self._put(
            entry,
            dataclasses.replace(
                facts, waiting=True, waiting_since=facts.waiting_since or now, version=held
            ),
        )
        self._dispatch(Pull(now, wid))

    def push(self, p: PushIn) -> None:
        """One validated update: facts, policy, store, ack."""
        entry = self._workers.get(p.worker)
        if entry is None:
            return
        facts = entry.facts
        now = self.clock.now()
        st = entry.stats
        st.last_seen = now
        if p.id <= entry.last_push:  # seen before (sent again, or after a reconnect): never twice
            st.duplicates += 1
            why = (
                f"push {p.id} was received before (last push {entry.last_push}); not applied again"
            )
            self._ack(p, "duplicate", why)
            return
        refusal = self._guard(p)
        if refusal is not None:  # nothing of it counts: the worker goes on from what it holds
            st.refused += 1
            log.warning("worker %d: push %d refused: %s", p.worker, p.id, refusal)
            if entry.peer is not None:
                entry.peer.send(ErrorReply(p.id, "out_of_range", refusal))
            return
        entry.last_push = p.id  # from here on, this push is answered with an ack
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

        new = dataclasses.replace(
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
            link_bps=self._link_rate(st, p.nbytes, p.transfer_s, facts.link_bps),
            samples=facts.samples + p.samples,
            free_mem=p.free_mem if p.free_mem is not None else facts.free_mem,
        )
        self._put(entry, new)
        kind: Literal["grad", "delta"] = "grad" if p.kind == "grad" else "delta"
        event = Push(now, p.worker, p.base, kind, p.samples, p.steps, p.compute_s, p.loss)
        if p.base > self.store.version or staleness > self.config.max_staleness:
            why = "base version from the future" if p.base > self.store.version else "too stale"
            self._ack(p, "dropped", why)
            st.dropped += 1
            self._dispatch(Tick(now))  # the clock moved: gates may open
            return
        self._dispatch(event, p)

    def _guard(self, p: PushIn) -> str | None:
        """Why the update guard refuses push ``p`` (None: it passes, and its norm joins the
        median window of its kind). A norm whose square overflows float32 is refused whenever the
        guard is on, warm-up included."""
        factor = self.config.guard_factor
        if factor <= 0:
            return None
        norm = p.norm if p.norm is not None else update_norm(p.tensors)
        if not norm < MAX_NORM:
            return f"update norm {norm:.3g} is out of range for a float32 model; not applied"
        window = self.guard_norms.get(p.kind)
        if window is None:
            window = self.guard_norms[p.kind] = deque(
                maxlen=max(GUARD_WINDOW, self.config.guard_warmup)
            )
        if window and len(window) >= self.config.guard_warmup:
            median = statistics.median(window)
            if median > 0 and norm > factor * median:
                return (
                    f"update norm {norm:.3g} is over {factor:g} x the median {median:.3g} of the "
                    f"last {len(window)} accepted {p.kind} pushes; not applied"
                )
        window.append(norm)
        return None

    def swap_policy(self, name: str, params: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """Replace the policy between two events, all or nothing.

        The new policy is built, initialised and asked for its first decisions (a ``Tick``) on a
        trial view in which every active worker's plan is back at its defaults (a join's plan),
        the stage is ``"main"`` and nothing is buffered; its plans and stage are worked out from
        those decisions. Any error on the way raises :class:`PolicyError` and nothing has changed:
        the old policy, its state, the stage and every plan stay. Then the swap is carried out:
        buffered pushes are applied (never lost), the policy, its state, the stage and the plans
        change together (each worker whose plan changed is told once), and the first decisions'
        releases and flushes are carried out.
        """
        new = make_policy(name, params)
        now = self.clock.now()
        plans = {wid: self._default_plan(e.facts, "main") for wid, e in self._workers.items()}
        # Every worker starts the new policy's first round together: clocks counted under the
        # old one (under asp the fast workers run rounds ahead) would make a synchronous policy
        # hold them until the slowest caught up (seen: 2 s without an update after asp -> bsp).
        top = max((e.facts.clock for e in self._workers.values()), default=0)
        trial = ClusterView(
            now=now,
            version=self.store.version,
            workers={
                wid: dataclasses.replace(e.facts, batch_size=plans[wid].batch_size, clock=top)
                for wid, e in self._workers.items()
            },
            global_batch=self.config.global_batch,
            buffered=0,
            stage="main",
        )
        stage = "main"
        try:
            decisions, state = new.update(Tick(now), new.init(trial), trial)
            first = resolve(decisions)  # raises on an unknown plan field or a wrong value
            for d in first.plans:
                if isinstance(d, SetStage):
                    stage = d.stage
                    plans = {wid: plan.merge({"stage": stage}) for wid, plan in plans.items()}
                elif d.worker in plans:
                    plans[d.worker] = plans[d.worker].merge(d.fields)
        except Exception as exc:
            raise PolicyError(
                f"policy {name!r} failed to start: {type(exc).__name__}: {exc}"
            ) from exc
        # Nothing below refuses: the swap happens as a whole.
        if self.buffered():  # never lose buffered updates: apply them before the change
            self._flush(Flush(normalize=True))
        old = self.policy.name
        self.policy, self.policy_state = new, state
        if stage != self.stage:
            at = now - self.started_at
            log.info("stage %s -> %s at %.2f s (policy swap)", self.stage, stage, at)
            self.stage = stage
            self.stages.append((at, stage))
        for wid, plan in plans.items():
            entry = self._workers[wid]
            changed = plan != entry.plan
            entry.plan = plan
            self._put(
                entry, dataclasses.replace(entry.facts, batch_size=plan.batch_size, clock=top)
            )
            if changed and entry.peer is not None:
                entry.peer.send(PlanUpdate(plan))
        for entry in self._departed.values():  # one that returns rejoins the same round
            entry.facts = dataclasses.replace(entry.facts, clock=min(entry.facts.clock, top))
        log.info("policy swapped: %s -> %s %s", old, new.name, dict(new.params))
        self._execute(Resolved((), first.scale, first.actions), None)
        return new.describe()

    def _default_plan(self, facts: WorkerFacts, stage: str) -> Plan:
        """A worker's plan before any policy changes it: the configured batch, pushes in the
        codec its parameters come in, nothing else set."""
        return Plan(batch_size=self.config.batch_size, codec=facts.codec, stage=stage)

    def tick(self) -> None:
        """Time passes: heartbeats, evaluation, and a chance for gates to open."""
        now = self.clock.now()
        self.rates.sample(now, self.updates_applied, self.bytes_in, self.bytes_out)
        for wid, entry in list(self._workers.items()):
            if now - entry.stats.last_seen > self.config.heartbeat_timeout_s:
                self.leave(wid, "heartbeat timeout")
        self._evaluate_if_due(now)
        self._dispatch(Tick(now))

    def anchor_evals(self, at: float) -> None:
        """Evaluate at ``at`` + k × ``eval_interval_s`` from now on (engine clock): the real bench
        puts the grid on its t = 0, where the simulator evaluates."""
        self._last_eval = at

    def _evaluate_if_due(self, now: float) -> None:
        """Start an evaluation when the next point of the grid (``eval_interval_s`` apart, at a
        fixed rate: a late one does not move the next) is due and none is running."""
        interval = self.config.eval_interval_s
        if (
            self.evaluator is not None
            and self._eval_task is None
            and now - self._last_eval >= interval
        ):
            last = self._last_eval
            self._last_eval = now if not math.isfinite(last) else now - (now - last) % interval
            if self.config.eval_inline:
                loss, acc = self.evaluator(self.store.snapshot())
                self.record_eval(loss, acc)
            else:
                self._eval_task = asyncio.get_running_loop().create_task(
                    self._evaluate(self.store.snapshot())
                )

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
        entry = self._workers.get(wid)
        if entry is None or not entry.facts.waiting:
            return
        facts = entry.facts
        now = self.clock.now()
        gap = facts.clock - min(f.clock for f in self._facts.values())
        self.max_release_gap = max(self.max_release_gap, gap)
        idle = now - facts.waiting_since if facts.waiting_since is not None else 0.0
        self._put(
            entry,
            dataclasses.replace(
                facts,
                waiting=False,
                waiting_since=None,
                idle_s=facts.idle_s + idle,
            ),
        )
        if self._deferred:
            self._releases[wid] = None
            return
        release = self.downlink.frames(
            facts.codec,
            facts.version,
            self.store.snapshot(),
            entry.held_ref,
            self._link(entry),
            hashes=entry.hashes,
        )
        self._send_params(wid, release)

    def resend(self, wid: int, peer: Peer | None = None) -> None:
        """Send a worker the newest parameters in full, in place of a full frame its outbox
        dropped because it was still writing an earlier one (a slow reader: the dropped frame
        would have pinned one more snapshot). Not a release: the policy is not asked and the
        worker's gates do not change; what the engine records it holds is what goes now.
        ``peer``: the session that asked (nothing happens when the worker is on another one)."""
        entry = self._workers.get(wid)
        if entry is None or entry.peer is None or (peer is not None and entry.peer is not peer):
            return
        self._put(entry, dataclasses.replace(entry.facts, version=-1))  # full, not a delta
        entry.held_ref = None
        if self._deferred:
            self._releases[wid] = None
            return
        snap = self.store.snapshot()
        release = self.downlink.frames(
            entry.facts.codec, -1, snap, None, self._link(entry), hashes=entry.hashes
        )
        self._send_params(wid, release)

    @staticmethod
    def _link_rate(
        st: WorkerStats, nbytes: int, transfer_s: float | None, old: float | None
    ) -> float | None:
        """The worker's link estimate after a push of ``nbytes`` taking ``transfer_s``."""
        if not transfer_s or transfer_s <= 0:
            return old
        st.link_rates.append(nbytes / transfer_s)
        return max(st.link_rates)

    def _link(self, entry: WorkerEntry) -> float | None:
        """The worker's link in bytes/s for the downlink's choice: unbounded for loopback or
        ``downlink = "full"``, unknown (deltas) for ``"delta"``."""
        mode = self.config.downlink
        if mode == "full" or (mode == "auto" and entry.same_host):
            return math.inf
        return None if mode == "delta" else entry.facts.link_bps

    def _send_params(self, wid: int, release: Outgoing) -> None:
        entry = self._workers.get(wid)
        if entry is None or entry.peer is None:
            return
        self._put(entry, dataclasses.replace(entry.facts, version=release.version))
        entry.held_ref = release.ref
        entry.stats.releases += 1
        for frame in release.frames:
            entry.stats.bytes_out += len(frame)
            self.bytes_out += len(frame)
            entry.peer.send_params(frame, full=release.full)

    def _set_plan(self, wid: int, fields: Mapping[str, Any]) -> None:
        entry = self._workers.get(wid)
        if entry is None:
            return
        plan = entry.plan
        new = plan.merge(fields)  # checked: resolve() raised on unknown fields already
        if new == plan:
            return
        entry.plan = new
        self._put(entry, dataclasses.replace(entry.facts, batch_size=new.batch_size))
        if entry.peer is not None:
            entry.peer.send(PlanUpdate(new))

    def _set_stage(self, stage: str) -> None:
        if stage == self.stage:
            return
        at = self.clock.now() - self.started_at
        log.info("stage %s -> %s at %.2f s", self.stage, stage, at)
        self.stage = stage
        self.stages.append((at, stage))
        for wid in list(self._workers):
            self._set_plan(wid, {"stage": stage})

    def _ack(self, p: PushIn, status: AckStatus, reason: str | None = None) -> None:
        entry = self._workers.get(p.worker)
        if entry is not None and entry.peer is not None:
            entry.peer.send(Ack(p.id, self.store.version, status, reason))

    # --- the whole state (checkpoints) -------------------------------------------------------------

    def state(self) -> EngineState:
        """Everything a restart needs, as host copies: parameters, optimizer state and version,
        the non-empty aggregation buffers (a half-finished round is not lost), the policy's name,
        parameters and state, the stage, the counters, and every worker's clock by id and name,
        departed or active (so a reconnecting worker gets its clock back). Run on the engine task.
        """
        params, opt_state, version = self.store.state()
        workers: dict[int, SavedWorker] = {}
        for active, table in ((False, self._departed), (True, self._workers)):
            for wid, entry in table.items():
                f = entry.facts
                workers[wid] = SavedWorker(
                    name=f.name,
                    clock=f.clock,
                    samples=f.samples,
                    idle_s=f.idle_s,
                    batch_size=f.batch_size,
                    codec=f.codec,
                    active=active,
                    last_push=entry.last_push,
                    secret=entry.secret,
                )
        return EngineState(
            params={k: np.array(v, copy=True) for k, v in params.items()},
            # the next step may donate (reuse) the buffers a host view would share
            opt_state=jax.tree.map(lambda x: np.array(x, copy=True), opt_state),
            version=version,
            buffers={g: agg.state() for g, agg in self.buffers.items() if agg.count},
            policy=self.policy.name,
            policy_params=dict(self.policy.params),
            policy_state=self.policy_state,
            stage=self.stage,
            updates_applied=self.updates_applied,
            next_id=self._next_id,
            workers=workers,
        )

    def restore(self, state: EngineState, revive: Callable[[Any, Any], Any] | None = None) -> None:
        """Put a saved state into this engine before it serves anyone. Every saved worker is
        known as departed (it gets its id and clock back when it reconnects).

        Raises ValueError, before anything changes, when the parameters do not fit the store's
        model. A saved policy that cannot be made here (:class:`policies.PolicyError`: a plug-in
        went missing) leaves the current one in place, with a warning. ``revive(fresh, saved)``
        turns a saved policy state back into the policy's own (``fresh``: the restored policy's
        ``init``); without it the saved state is taken as it is; a saved None means ``fresh``.
        """
        self.store.restore(state.params, state.opt_state, state.version)
        self.buffers = {int(g): Aggregator.from_state(b) for g, b in state.buffers.items()}
        self.stage = state.stage
        self.updates_applied = state.updates_applied
        now = self.clock.now()
        for wid, w in state.workers.items():
            facts = WorkerFacts(
                worker=wid,
                name=w.name,
                clock=w.clock,
                version=self.store.version,
                waiting=True,
                joined_at=now,
                samples=w.samples,
                batch_size=w.batch_size,
                codec=w.codec,
                idle_s=w.idle_s,
            )
            plan = Plan(batch_size=w.batch_size, codec=w.codec, stage=self.stage)
            self._departed[wid] = WorkerEntry(
                facts, WorkerStats(), plan, peer=None, last_push=w.last_push, secret=w.secret
            )
        self._next_id = max([self._next_id, state.next_id, *(w + 1 for w in state.workers)])
        try:
            policy = make_policy(state.policy, state.policy_params)
        except PolicyError as exc:
            log.warning("saved policy not restored (%s); keeping %s", exc, self.policy.name)
            return
        fresh = policy.init(self.view())
        policy_state = fresh
        if state.policy_state is not None:
            policy_state = (
                state.policy_state if revive is None else revive(fresh, state.policy_state)
            )
        self.policy, self.policy_state = policy, policy_state

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
            "workers": len(self._workers),
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
        for wid in sorted(self._workers):
            entry = self._workers[wid]
            f, st = entry.facts, entry.stats
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
                    "codec": entry.plan.codec,  # what its pushes use (the plan's)
                    "params_codec": f.codec,  # what its parameters come in (negotiated)
                    "pushes": st.pushes,
                    "applied": st.applied,
                    "dropped": st.dropped,
                    "refused": st.refused,
                    "duplicates": st.duplicates,
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
                    "plan": entry.plan.to_wire(),
                }
            )
        return rows
