"""What the engine keeps per worker and is configured with: :class:`EngineConfig`, one
:class:`WorkerEntry` per worker (facts, counters, plan, peer), and a live read-only column of the
entries' fields (:class:`Column`); :func:`block_facts` reads a block-structured model's blocks
from its shapes. Plain data: the parts of :mod:`hetd.core` own and change it."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from hetd.core.peers import Peer
from policies.types import Plan, WorkerFacts

if TYPE_CHECKING:
    pass

# A worker's link is the fastest of its last pushes, send to receipt: a busy host (a worker not
# yet scheduled, a daemon loop with other work) only ever makes a transfer look slower, never
# faster, so the max of a short window reads the link and the mean reads the host's load (seen:
# 36-98 MB/s measured on 1 GB/s links under load, and H-PS cutting bits it did not need to).
LINK_WINDOW = 8


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
    # departed workers: kept this long, at most this many (one without an answered push: not kept)
    departed_retention_s: float = 86400.0
    max_departed: int = 4096
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

    @property
    def inner_optimizer(self) -> str | None:
        """The workers' optimizer spec, as the welcome's ``train`` names it (None: not named)."""
        train = self.welcome.get("train") if isinstance(self.welcome, Mapping) else None
        spec = train.get("inner_optimizer") if isinstance(train, Mapping) else None
        return spec if isinstance(spec, str) else None


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
    pulls: bool = False  # its hello named "pulls": a full release may name a log position instead
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
    left_at: float | None = None  # engine clock when it left (or was restored as departed)


_V = TypeVar("_V")


class Column(Mapping[int, _V], Generic[_V]):
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
