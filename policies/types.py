"""The policy interface's types: facts in, events in, decisions out, and the worker's :class:`Plan`.

A policy is ``Policy(name, init, update)`` in the style of optax's ``GradientTransformation``:
``init(view) -> state`` builds a valid state from the engine's facts (so a hot-swapped policy starts
between two events), and ``update(event, state, view) -> (decisions, state)`` is pure. Events carry
their own time (``event.now``). The engine's facts about the cluster live in :class:`ClusterView`.

This module owns those records: :class:`WorkerFacts`, :class:`ClusterView`, the events, the
decisions, :class:`Plan` (with its wire form) and :class:`Policy`. Combining policies and decisions
is :mod:`policies.compose`; names are :mod:`policies.registry`. No I/O, no clock, no jax.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple

# --- facts -----------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class WorkerFacts:
    """What the engine knows about one replica (one worker today; a pipeline group later)."""

    worker: int
    name: str
    clock: int  # pushes accounted so far (iterations, or commits for local-step methods)
    version: int  # the parameter version the worker holds (its last release; -1: none)
    waiting: bool  # it has pushed or pulled and awaits a release
    joined_at: float  # s, engine clock
    last_push_at: float | None = None  # s, arrival time of the last push
    prev_push_at: float | None = None  # s, arrival time of the push before it
    compute_s: float | None = None  # s per push, EWMA (a = 0.5)
    sample_s: float | None = None  # s per sample, EWMA
    push_bytes: float | None = None  # bytes per push, EWMA
    link_bps: float | None = None  # bytes/s measured on pushes, EWMA
    samples: int = 0  # samples pushed in total
    batch_size: int = 32  # current plan's batch
    free_mem: int | None = None  # bytes, last report
    codec: str = "none"
    waiting_since: float | None = None  # s, when its current wait began
    idle_s: float = 0.0  # s spent waiting for releases in total
    profile: Mapping[str, float] | None = None  # the worker's profile run: sample_s, push_s,
    # pull_s, compress_s (s; trimmed means), from the daemon's profile exchange
    stages: bool = False  # it runs pipeline stages (its hello named the ``stages`` feature)


@dataclass(frozen=True, slots=True)
class ClusterView:
    """A read-only picture of the cluster at one event. ``workers`` holds active replicas only."""

    now: float  # s, engine clock
    version: int  # global parameter version
    workers: Mapping[int, WorkerFacts]
    global_batch: int  # samples per round across all workers (BSP uses B/N each)
    buffered: int = 0  # pushes waiting in the aggregation buffer
    stage: str = "main"
    # Pipeline replicas (docs/policies.md §11): head -> members in stage order. The head stands
    # for its replica in ``workers``; the later stages are only in ``stage_workers`` (their
    # facts, for planners that place stages).
    replicas: Mapping[int, tuple[int, ...]] = dataclasses.field(default_factory=dict)
    stage_workers: Mapping[int, WorkerFacts] = dataclasses.field(default_factory=dict)
    # The model's blocks when it is block-structured (else empty), in order: (parameter bytes,
    # output bytes per sample, relative compute per sample).
    blocks: tuple[tuple[float, float, float], ...] = ()
    # The gradient noise scale in samples, measured from pairs of gradient pushes at the same
    # base version (policies.efficiency.NoiseScale); None until enough pairs came
    noise_scale: float | None = None
    # The workers' optimizer as the welcome names it (``adam``, ``sgd:momentum=0.9``); None: not
    # known
    optimizer: str | None = None

    @property
    def n(self) -> int:
        """Number of active replicas."""
        return len(self.workers)

    def min_clock(self) -> int:
        """The smallest clock among active replicas (0 with none)."""
        return min((f.clock for f in self.workers.values()), default=0)

    def max_clock(self) -> int:
        """The largest clock among active replicas (0 with none)."""
        return max((f.clock for f in self.workers.values()), default=0)


# --- events ------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Join:
    """A replica joined (or came back); its facts are already in the view."""

    now: float
    worker: int


@dataclass(frozen=True, slots=True)
class Leave:
    """A replica left or timed out; it is already gone from the view."""

    now: float
    worker: int
    reason: str = ""


@dataclass(frozen=True, slots=True)
class Push:
    """A validated update arrived; the pusher's clock in the view already counts it."""

    now: float
    worker: int
    base_version: int  # the version the work started from
    kind: Literal["grad", "delta"]
    samples: int
    steps: int
    compute_s: float  # s of compute (emulated slow-downs included)
    loss: float | None = None

    def staleness(self, view: ClusterView) -> int:
        """Applied updates since the work began: ``v_now - base_version``."""
        return max(0, view.version - self.base_version)


@dataclass(frozen=True, slots=True)
class Pull:
    """A replica asks for parameters without pushing (start, resume)."""

    now: float
    worker: int


@dataclass(frozen=True, slots=True)
class Tick:
    """Periodic wake-up (and the first event after a policy swap)."""

    now: float


@dataclass(frozen=True, slots=True)
class Eval:
    """The global model was evaluated."""

    now: float
    loss: float
    accuracy: float


@dataclass(frozen=True, slots=True)
class Prediction:
    """One candidate policy run forward from the live cluster by a planner (the daemon's timing
    twin, :mod:`policies.twin`): what it would apply, and what that is worth."""

    name: str
    params: tuple[tuple[str, Any], ...]  # (key, value), sorted by key
    samples_per_s: float  # samples applied per second
    efficiency: float  # what an applied sample is worth, 0..1 (staleness, local steps) [D]
    staleness: float = 0.0  # mean versions behind of what it applies

    @property
    def goodput(self) -> float:
        """Useful samples per second: throughput × statistical efficiency."""
        return self.samples_per_s * self.efficiency


@dataclass(frozen=True, slots=True)
class Forecast:
    """A planner's predictions for its candidates, from the view at ``now`` over ``horizon_s``
    (sent only to a policy whose :attr:`Policy.reads_forecasts` is set)."""

    now: float
    horizon_s: float
    predictions: tuple[Prediction, ...]
    cost_s: float = 0.0  # CPU seconds the planning took


Event = Join | Leave | Push | Pull | Tick | Eval | Forecast


# --- decisions ---------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Apply:
    """Apply the current push now, its step scaled by ``weight`` (the lr scale λ)."""

    weight: float


@dataclass(frozen=True, slots=True)
class Buffer:
    """Keep the current push for a later flush of ``group`` (e.g. its round) with ``weight``."""

    weight: float
    group: int = 0


@dataclass(frozen=True, slots=True)
class Flush:
    """Aggregate each buffered group up to ``upto`` (Σ weight·update, divided by Σ weight when
    ``normalize``) and apply it once, scaled by ``scale``: one new version per group, in group
    order. ``upto=None`` flushes every group."""

    normalize: bool = True
    scale: float = 1.0
    upto: int | None = None


@dataclass(frozen=True, slots=True)
class Drop:
    """Discard the current push."""

    reason: str


@dataclass(frozen=True, slots=True)
class Scale:
    """Multiply the weight of the current push's Apply/Buffer (composable weight rules)."""

    factor: float


@dataclass(frozen=True, slots=True)
class Release:
    """``worker`` may start its next step: send it the current parameters if it is waiting."""

    worker: int


@dataclass(frozen=True, slots=True)
class SetPlan:
    """Change some of ``worker``'s plan fields (names and kinds of :class:`Plan`'s; a wrong one is
    an error when the decisions are resolved); sent with its next reply."""

    worker: int
    fields: Mapping[str, Any]


@dataclass(frozen=True, slots=True)
class SetStage:
    """Move training to another stage (e.g. ``AHL`` -> ``SHL``)."""

    stage: str


@dataclass(frozen=True, slots=True)
class RestartOptimizer:
    """Start the daemon's gradient optimizer afresh (its moments and step count), after what is
    queued: for a policy whose updates differ in size or staleness from those the moments were
    built on (an adaptive optimizer scales each step by them). Changes nothing under plain SGD."""


@dataclass(frozen=True, slots=True)
class ReplicaShape:
    """One pipeline replica: workers in stage order, stage ``s`` holding blocks
    ``[cuts[s], cuts[s+1])``, steps of ``micro_batches`` micro-batches of ``micro`` samples,
    stage ``s`` keeping at most ``inflight[s]`` in flight (empty: ``S − s``)."""

    members: tuple[int, ...]
    cuts: tuple[int, ...]
    micro: int
    micro_batches: int
    inflight: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class Regroup:
    """Run exactly these pipeline replicas: one not running is formed, one running that is not
    named (or named with other cuts or micro-batches) is dissolved (its workers go back to data
    parallel)."""

    replicas: tuple[ReplicaShape, ...]


Decision = (
    Apply
    | Buffer
    | Flush
    | Drop
    | Scale
    | Release
    | SetPlan
    | SetStage
    | Regroup
    | RestartOptimizer
)
PushDecision = Apply | Buffer | Drop  # what may become of the current push


# --- the plan ------------------------------------------------------------------------------------------

PushKind = Literal["grad", "delta"]
PUSH_KINDS: tuple[PushKind, ...] = ("grad", "delta")


@dataclass(frozen=True, slots=True)
class Plan:
    """What a worker does next; piggy-backed on replies.

    The first seven fields are always on the wire. The others only some policies set: their default
    ``None`` means "not set" (the worker keeps its own default) and keeps them off the wire. Change a
    plan with :meth:`merge` (a ``SetPlan``'s fields); read one off the wire with :meth:`from_wire`.
    """

    batch_size: int = 32  # samples per step
    local_steps: int = 1  # > 1 means k local SGD steps pushed as a delta
    codec: str = "none"  # codec spec for the worker's pushes ("int8:block=1024", "topk", ...)
    bits: int = 32  # bits per value the plan's codec stands for (H-PS); reported
    topk: float = 1.0  # kept fraction for sparsifying codecs, in (0, 1]
    lr_scale: float = 1.0  # multiplies the worker's local learning rate ([train] worker_lr)
    stage: str = "main"  # the training stage the daemon is in
    # The fraction of one seed-fixed permutation of the training set the worker samples, in (0, 1]
    # (ASHL's p_i), and where it starts, in [0, 1). None: its shard; an offset of None: 0.
    data_share: float | None = None
    data_offset: float | None = None
    local_time_s: float | None = None  # s of local steps per push (ADSP's time mode); None: steps
    # "delta": push local SGD's delta even for one step; None: a gradient when local_steps == 1.
    push_kind: PushKind | None = None
    pipeline: bool | None = None  # True: the next step overlaps the push in flight (H-PS); None: no
    commit_quota: int | None = None  # commits per check period (ADSP's m_i); reported
    period_s: float | None = None  # s, ADSP's check period Γ; reported
    staleness_bound: int | None = (
        None  # commits it may run ahead of the slowest (ASHL SHL); reported
    )

    def to_wire(self) -> dict[str, Any]:
        """The plan as a plain map for the wire: every core field, and each optional one that is
        set (absent keys mean their defaults, as :meth:`from_wire` reads them)."""
        out = {name: getattr(self, name) for name in CORE_PLAN_FIELDS}
        for name in OPTIONAL_PLAN_FIELDS:
            value = getattr(self, name)
            if value is not None:
                out[name] = value
        return out

    @classmethod
    def from_wire(cls, wire: Mapping[str, Any]) -> Plan:
        """The plan a wire map describes: absent keys take their defaults and unknown keys are
        ignored (a newer daemon may send more); a known key of the wrong type raises ValueError."""
        if not isinstance(wire, Mapping):
            raise ValueError(f"a plan must be a map, got {type(wire).__name__}")
        return cls(**{k: _field_value(k, v) for k, v in wire.items() if k in _KINDS})

    def merge(self, changes: Mapping[str, Any]) -> Plan:
        """This plan with ``changes`` (a ``SetPlan``'s fields) applied. An unknown field name or a
        value of the wrong type raises ValueError: a policy bug, never carried to the worker."""
        return dataclasses.replace(self, **check_plan_fields(changes))


PLAN_FIELDS = frozenset(f.name for f in dataclasses.fields(Plan))
CORE_PLAN_FIELDS: tuple[str, ...] = (
    "batch_size",
    "local_steps",
    "codec",
    "bits",
    "topk",
    "lr_scale",
    "stage",
)
OPTIONAL_PLAN_FIELDS: tuple[str, ...] = tuple(
    f.name for f in dataclasses.fields(Plan) if f.name not in CORE_PLAN_FIELDS
)
# What each field holds on the wire: a type (ints exclude bools; floats are finite and take ints),
# or the allowed values. Optional fields also take None.
_KINDS: Mapping[str, type | tuple[str, ...]] = {
    "batch_size": int,
    "local_steps": int,
    "codec": str,
    "bits": int,
    "topk": float,
    "lr_scale": float,
    "stage": str,
    "data_share": float,
    "data_offset": float,
    "local_time_s": float,
    "push_kind": PUSH_KINDS,
    "pipeline": bool,
    "commit_quota": int,
    "period_s": float,
    "staleness_bound": int,
}
_KIND_WORDS: Mapping[type, str] = {
    int: "an int",
    float: "a finite number",
    str: "a string",
    bool: "a bool",
}
if set(_KINDS) != PLAN_FIELDS:  # a new Plan field needs its wire kind
    raise TypeError(f"plan fields without a wire kind: {sorted(PLAN_FIELDS ^ set(_KINDS))}")


def _field_value(name: str, value: Any) -> Any:
    """``value`` checked against field ``name``'s kind (a float field's int becomes a float)."""
    kind = _KINDS[name]
    if value is None and name in OPTIONAL_PLAN_FIELDS:
        return None
    if kind is int and isinstance(value, int) and not isinstance(value, bool):
        return int(value)
    if (
        kind is float
        and isinstance(value, int | float)
        and not isinstance(value, bool)
        and math.isfinite(value)
    ):
        return float(value)
    if kind is str and isinstance(value, str):
        return value
    if kind is bool and isinstance(value, bool):
        return value
    if isinstance(kind, tuple) and isinstance(value, str) and value in kind:
        return value
    wanted = " or ".join(map(repr, kind)) if isinstance(kind, tuple) else _KIND_WORDS[kind]
    if name in OPTIONAL_PLAN_FIELDS:
        wanted += " or None"
    raise ValueError(f"plan field {name!r} must be {wanted}, got {value!r}")


def check_plan_fields(changes: Mapping[str, Any]) -> dict[str, Any]:
    """``changes`` to a plan, checked: every name a :class:`Plan` field and every value of its
    kind (ints given for float fields become floats). Raises ValueError naming the problem."""
    unknown = sorted(str(k) for k in changes if k not in PLAN_FIELDS)
    if unknown:
        known = ", ".join(f.name for f in dataclasses.fields(Plan))
        raise ValueError(f"unknown plan field(s) {', '.join(unknown)}; a plan has {known}")
    return {k: _field_value(k, v) for k, v in changes.items()}


# --- the interface -----------------------------------------------------------------------------------

Update = Callable[[Event, Any, ClusterView], tuple[Sequence[Decision], Any]]


class Policy(NamedTuple):
    """A named pair of pure functions, made by a factory that closes over its parameters."""

    name: str
    init: Callable[[ClusterView], Any]
    update: Update
    params: Mapping[str, Any] = {}
    # whether ``update`` reads ``Eval`` events (ashl switches stages on the loss): a runner that
    # would otherwise evaluate after the run (``hetd bench --mode real --evals deferred``)
    # evaluates live for such a policy; one that ignores them may get none
    reads_evals: bool = False
    # whether ``update`` reads ``Forecast`` events (``auto`` chooses among policies with them): the
    # daemon runs its planner only for such a policy, and no other policy ever gets one
    reads_forecasts: bool = False

    def describe(self) -> dict[str, Any]:
        """Name and parameters, for status pages."""
        return {"name": self.name, "params": dict(self.params)}
