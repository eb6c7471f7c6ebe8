"""The policy interface: events in, decisions out, state replaced — no I/O, no clock, no jax.

A policy is ``Policy(name, init, update)`` in the style of optax's ``GradientTransformation``:
``init(view) -> state`` builds a valid state from the engine's facts (so a hot-swapped policy starts
between two events), and ``update(event, state, view) -> (decisions, state)`` is pure. Events carry
their own time (``event.now``). The engine's facts about the cluster live in :class:`ClusterView`.

This module also owns the policy registry (with the entry-point group ``hetd.policies``) and
:func:`compose`, which chains concerns (a gate, a weight rule, a batch-share planner) like
``optax.chain``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from importlib.metadata import entry_points
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


@dataclass(frozen=True, slots=True)
class ClusterView:
    """A read-only picture of the cluster at one event. ``workers`` holds active replicas only."""

    now: float  # s, engine clock
    version: int  # global parameter version
    workers: Mapping[int, WorkerFacts]
    global_batch: int  # samples per round across all workers (BSP uses B/N each)
    buffered: int = 0  # pushes waiting in the aggregation buffer
    stage: str = "main"

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


Event = Join | Leave | Push | Pull | Tick | Eval


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
class Hold:
    """``worker`` must wait (recorded for wait-time metrics; waiting is the default)."""

    worker: int


@dataclass(frozen=True, slots=True)
class SetPlan:
    """Change some of ``worker``'s plan fields (see :class:`Plan`); sent with its next reply."""

    worker: int
    fields: Mapping[str, Any]


@dataclass(frozen=True, slots=True)
class SetStage:
    """Move training to another stage (e.g. ``AHL`` -> ``SHL``)."""

    stage: str


Decision = Apply | Buffer | Flush | Drop | Scale | Release | Hold | SetPlan | SetStage


@dataclass(frozen=True, slots=True)
class Plan:
    """What a worker does next; piggy-backed on replies."""

    batch_size: int = 32  # samples per step
    local_steps: int = 1  # > 1 means k local SGD steps pushed as a delta
    codec: str = "none"  # codec for the worker's pushes
    bits: int = 32
    topk: float = 1.0  # kept fraction for sparsifying codecs
    lr_scale: float = 1.0  # the worker's local learning-rate scale
    stage: str = "main"
    extra: Mapping[str, Any] = field(default_factory=dict)

    def to_wire(self) -> dict[str, Any]:
        """The plan as a plain map for the wire."""
        return {
            "batch_size": self.batch_size,
            "local_steps": self.local_steps,
            "codec": self.codec,
            "bits": self.bits,
            "topk": self.topk,
            "lr_scale": self.lr_scale,
            "stage": self.stage,
            **dict(self.extra),
        }


PLAN_FIELDS = frozenset(Plan.__dataclass_fields__) - {"extra"}


# --- the interface -----------------------------------------------------------------------------------

Update = Callable[[Event, Any, ClusterView], tuple[Sequence[Decision], Any]]


class Policy(NamedTuple):
    """A named pair of pure functions, made by a factory that closes over its parameters."""

    name: str
    init: Callable[[ClusterView], Any]
    update: Update
    params: Mapping[str, Any] = {}

    def describe(self) -> dict[str, Any]:
        """Name and parameters, for status pages."""
        return {"name": self.name, "params": dict(self.params)}


def compose(*policies: Policy, name: str | None = None) -> Policy:
    """Chain concerns: each sees every event; their decisions are concatenated in order.

    The first is usually the gate (Apply/Buffer, Release); later ones add ``Scale`` (weights),
    ``SetPlan`` (batch shares, codecs) or ``SetStage``. The state is the tuple of member states.
    """
    if not policies:
        raise ValueError("compose needs at least one policy")

    def init(view: ClusterView) -> tuple[Any, ...]:
        return tuple(p.init(view) for p in policies)

    def update(
        event: Event, state: tuple[Any, ...], view: ClusterView
    ) -> tuple[Sequence[Decision], tuple[Any, ...]]:
        out: list[Decision] = []
        new_states = []
        for p, s in zip(policies, state, strict=True):
            decisions, s2 = p.update(event, s, view)
            out.extend(decisions)
            new_states.append(s2)
        return out, tuple(new_states)

    params = {p.name: dict(p.params) for p in policies}
    return Policy(name or "+".join(p.name for p in policies), init, update, params)


def describe_state(state: Any, depth: int = 0) -> Any:
    """A policy state as plain JSON values for status pages: its own ``describe()`` when it has one,
    else its fields (mappings with string keys, sequences as lists)."""
    if depth > 6:
        return None
    describe = getattr(state, "describe", None)
    if callable(describe):
        return describe()
    if dataclasses.is_dataclass(state) and not isinstance(state, type):
        return {
            f.name: describe_state(getattr(state, f.name), depth + 1)
            for f in dataclasses.fields(state)
        }
    if isinstance(state, Mapping):
        return {str(k): describe_state(v, depth + 1) for k, v in state.items()}
    if isinstance(state, list | tuple):
        return [describe_state(v, depth + 1) for v in state]
    if state is None or isinstance(state, bool | int | float | str):
        return state
    return repr(state)


def release_waiting(view: ClusterView, may_proceed: Callable[[WorkerFacts], bool]) -> list[Release]:
    """Release every waiting replica for which ``may_proceed`` holds."""
    return [Release(w) for w, f in view.workers.items() if f.waiting and may_proceed(f)]


# --- registry ----------------------------------------------------------------------------------------

Factory = Callable[..., Policy]
_REGISTRY: dict[str, Factory] = {}
_ENTRY_POINTS_LOADED = False


def register(name: str) -> Callable[[Factory], Factory]:
    """Decorator: register a policy factory under ``name``; a duplicate name raises."""

    def deco(factory: Factory) -> Factory:
        if name in _REGISTRY:
            raise ValueError(f"policy {name!r} is already registered")
        _REGISTRY[name] = factory
        return factory

    return deco


def _load_entry_points() -> None:
    global _ENTRY_POINTS_LOADED
    if _ENTRY_POINTS_LOADED:
        return
    _ENTRY_POINTS_LOADED = True
    for ep in entry_points(group="hetd.policies"):
        if ep.name not in _REGISTRY:
            _REGISTRY[ep.name] = ep.load()


def policy_names() -> list[str]:
    """Every registered policy name, sorted."""
    _load_entry_points()
    return sorted(_REGISTRY)


class PolicyError(ValueError):
    """An unknown policy name or parameters its factory does not accept."""


def make_policy(name: str, params: Mapping[str, Any] | None = None) -> Policy:
    """Build policy ``name`` with ``params``; errors say what is valid."""
    _load_entry_points()
    try:
        factory = _REGISTRY[name]
    except KeyError:
        raise PolicyError(
            f"unknown policy {name!r}; known policies: {', '.join(sorted(_REGISTRY))}"
        ) from None
    try:
        return factory(**dict(params or {}))
    except TypeError as exc:
        raise PolicyError(
            f"policy {name!r}: bad parameters {dict(params or {})!r}: {exc}"
        ) from None
    except ValueError as exc:
        raise PolicyError(f"policy {name!r}: {exc}") from None
