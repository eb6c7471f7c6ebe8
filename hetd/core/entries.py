"""The engine's parts that every other part builds on: the clock and the peer it is given, its
configuration, one :class:`WorkerEntry` per worker, and :class:`EngineBase`, which holds the
engine's fields, the tables of workers and the policy's view (:mod:`hetd.core.engine` adds the
commands; :mod:`hetd.core.publish`, :mod:`hetd.core.saved` and :mod:`hetd.core.views` the
releases, checkpoints and summaries).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from hetd.core.downlink import Downlink
from hetd.core.evals import Evaluations
from hetd.core.guard import UpdateGuard
from hetd.core.peers import Clock, MonotonicClock, Peer
from hetd.core.rates import LatencyRecorder, RateMeter
from hetd.core.store import Aggregator, Snapshot, Store
from hetd.protocol.messages import PushIn
from policies.types import ClusterView, Event, Plan, Policy, ReplicaShape, WorkerFacts

if TYPE_CHECKING:
    from hetd.core.commands import Command

# A worker's link is the fastest of its last pushes, send to receipt: a busy host (a worker not
# yet scheduled, a daemon loop with other work) only ever makes a transfer look slower, never
# faster, so the max of a short window reads the link and the mean reads the host's load (seen:
# 36-98 MB/s measured on 1 GB/s links under load, and H-PS cutting bits it did not need to).
LINK_WINDOW = 8


def block_facts(shapes: Mapping[str, tuple[int, ...]]) -> tuple[tuple[float, float, float], ...]:
    """A block-structured model's blocks (parameters ``b00/...``, ``b01/...``) as planners see
    them: (parameter bytes, output bytes per sample, relative compute per sample); empty for any
    other model. Estimates from the shapes alone: a block's output is as wide as its last
    one-dimensional parameter (a dense layer's bias), its compute is its parameter count."""
    blocks: dict[str, list[tuple[int, ...]]] = {}
    for path, shape in shapes.items():
        head, _, _ = path.partition("/")
        if not (len(head) == 3 and head[0] == "b" and head[1:].isdigit()):
            return ()
        blocks.setdefault(head, []).append(tuple(shape))
    names = sorted(blocks)
    if names != [f"b{j:02d}" for j in range(len(names))]:
        return ()
    out = []
    for name in names:
        params = sum(math.prod(s) for s in blocks[name])
        width = next((s[0] for s in reversed(blocks[name]) if len(s) == 1), 1)
        out.append((4.0 * params, 4.0 * width, float(params)))
    return tuple(out)


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
    # a user's Task: one shard per active worker, cut again at every join and leave (workers
    # that take "shard" messages); shards is then ignored
    recut_shards: bool = False
    profile_steps: int = 3  # steps a joining worker times for its profile (0: no profile)
    eval_inline: bool = False  # evaluate inside tick() (the simulator: virtual time, no threads)
    # The update guard ([train] guard_factor, guard_warmup): refuse a push whose norm is over
    # guard_factor x the median norm of the accepted pushes of its kind, once guard_warmup of them
    # were accepted. 0: off (the default here: the simulator's emulated workers do not take an
    # ``error`` reply; the daemon sets it from its config).
    guard_factor: float = 0.0
    guard_warmup: int = 20
    welcome: Mapping[str, Any] = field(default_factory=dict)  # model/dataset/train for the welcome
    # The outer optimizer spec a policy runs with (name, params) -> spec, as the daemon resolved
    # it at start ([train] outer_optimizer; "auto": policies.diloco.outer_for); a policy swap
    # rebuilds the store's outer optimizer from it. None: the store's stays as it is.
    outer_for: Callable[[str, Mapping[str, Any]], str] | None = None


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
    same_host: bool = False  # on loopback, emulating no slower link: parameters in full are cheaper
    hashes: bool = False  # its hello named "hash": its full frames carry the parameters' hash
    reshard: bool = False  # its hello named "reshard": it takes "shard" messages
    shard: tuple[int, int] = (0, 1)  # (index, count) it was last told
    # how its big frames travel: "ws" (its websocket) or "shm" (the same host's shared memory)
    transport: str = "ws"
    # the request id of the last push the engine answered with an ack (applied, buffered or
    # dropped); a push with this id or an older one is a duplicate. Kept across reconnects and in
    # checkpoints: a worker's push ids increase for as long as it is that worker.
    last_push: int = 0
    # what the worker must show to resume this id (its welcome gave it; "" from an old
    # checkpoint: nobody can resume it)
    secret: str = ""
    # pushes that came while it already waited for parameters (a pipelined worker's next push
    # before the last one was released): the release that ends the wait answers each with a
    # frame, as a worker counts one frame per push it sent (workers.inbox.Inbox)
    joined_pushes: int = 0


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


class EngineBase:
    """The engine's fields, its tables of workers and the policy's view (see
    :class:`hetd.core.engine.Engine`)."""

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
        self.policy = policy
        self._workers: dict[int, WorkerEntry] = {}  # active workers
        self._departed: dict[int, WorkerEntry] = {}  # left (or known from a checkpoint)
        self._facts: dict[int, WorkerFacts] = {}  # the active workers' facts: the policy's view
        self.departures: deque[tuple[float, int, str]] = deque(maxlen=64)  # (t, worker, reason)
        self.buffers: dict[int, Aggregator] = {}  # group (e.g. round) -> buffered updates
        self.stage = "main"
        self.started_at = self.clock.now()
        self.evaluations = Evaluations(
            self.clock,
            self.started_at,
            config.eval_interval_s,
            config.eval_inline,
            self.submit,
            evaluator,
        )
        self.updates_applied = 0
        self.publishes = 0  # batches published by run() (updates_applied / publishes: batch size)
        self.max_release_gap = 0  # the largest clock lead any worker was released with
        self.stages: list[tuple[float, str]] = []  # (t since start, stage entered), each switch
        self._next_id = 1
        self.downlink = Downlink(s_per_param=config.delta_s_per_param, hashes=config.param_hashes)
        self.bytes_in = 0  # push bytes received, all workers, since start
        self.bytes_out = 0  # parameter bytes sent, all workers, since start
        self.latency = LatencyRecorder()  # s to decide one event: policy, bookkeeping, acks
        self.publish_latency = LatencyRecorder()  # s per publish: steps, snapshot, param frames
        self.wait = LatencyRecorder()  # s a command waited in the queue
        self.rates = RateMeter()  # updates/s and MB/s over the last seconds, sampled on ticks
        self.guard = UpdateGuard(config.guard_factor, config.guard_warmup)
        self._queue: asyncio.Queue[tuple[float, Command]] = asyncio.Queue()
        self._deferred = False  # True while run() drives the engine: releases wait to be published
        self._releases: dict[int, None] = {}  # workers released, not yet sent parameters (ordered)
        # Pipeline replicas (hetd.core.replicas): head (stage 0) -> members in stage order. The
        # head stands for its replica in the policy's view; the later stages are not in it.
        self._replicas: dict[int, tuple[int, ...]] = {}
        self._stages: dict[int, int] = {}  # a replica's later stages -> its head
        self._replica_releases: dict[int, None] = {}  # heads released, their step not yet sent
        self.blocks = block_facts(store.shapes)  # what planners of replicas know of the model
        # Who forms and dissolves pipeline replicas on a policy's Regroup (the daemon's driver).
        self.replica_regroup: Callable[[tuple[ReplicaShape, ...]], None] | None = None
        # Who runs a released replica's next step (the daemon's replica driver): called with the
        # head's id once the release's updates are applied.
        self.replica_release: Callable[[int], None] | None = None
        self.policy_state: Any = policy.init(self.view())

    def submit(self, command: Command) -> None:
        """Queue a command for the engine task (:meth:`hetd.core.engine.Engine.handle` runs it)."""
        self._queue.put_nowait((time.perf_counter(), command))

    @property
    def evals(self) -> list[tuple[float, float, float]]:
        """Every evaluation: (s since start, loss, accuracy)."""
        return self.evaluations.evals

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
        """Replace an active worker's facts (in its entry and, unless it is a later stage of a
        replica, in the policy's view)."""
        entry.facts = facts
        if facts.worker not in self._stages:
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
            replicas=self._replicas,
            stage_workers={w: self._workers[w].facts for w in self._stages if w in self._workers},
            blocks=self.blocks,
        )

    def _dispatch(self, event: Event, push: PushIn | None = None) -> None:
        """Ask the policy about ``event`` and carry out its decisions (the engine's own)."""
        raise NotImplementedError

    def buffered(self) -> int:
        """Pushes waiting in aggregation buffers."""
        return sum(b.count for b in self.buffers.values())
