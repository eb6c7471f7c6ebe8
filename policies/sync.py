"""Synchronisation gates: BSP, ASP, SSP (docs/policies.md).

BSP and ASP are stateless beyond their parameters: the clocks they need are the engine's facts, so
``init`` returns ``None`` and a hot swap is always valid. SSP keeps only what ``init`` can start
from nothing: which workers are silent, the clock offsets of those that came back, and each
worker's recent push intervals (its cadence, against which its silence is measured).
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType

from policies.compose import release_waiting
from policies.registry import register
from policies.types import (
    Apply,
    Buffer,
    ClusterView,
    Decision,
    Event,
    Flush,
    Join,
    Leave,
    Policy,
    Pull,
    Push,
    Tick,
    WorkerFacts,
)


def async_weight(weight: float | None, view: ClusterView) -> float:
    """λ for asynchronous application: ``weight`` if set, else ``1/N`` over active replicas."""
    if weight is not None:
        return weight
    return 1.0 / max(1, view.n)


def check_weight(weight: float | None) -> None:
    """Validate a gate's ``weight`` parameter: ``> 0``, or None for ``1/N``; raises ValueError."""
    if weight is not None and not weight > 0:
        raise ValueError(f"weight must be > 0 (or omitted for 1/N), got {weight!r}")


@register("bsp")
def bsp() -> Policy:
    """Bulk synchronous: buffer every push of a round, flush the sample-weighted mean when every
    active replica has pushed, then release everyone (gate: all clocks ≥ own)."""

    def init(view: ClusterView) -> None:
        return None

    def update(event: Event, state: None, view: ClusterView) -> tuple[Sequence[Decision], None]:
        out: list[Decision] = []
        if isinstance(event, Push):
            out.append(Buffer(float(event.samples)))
        buffered = view.buffered + (1 if isinstance(event, Push) else 0)
        if not view.workers:
            return out, None
        lo, hi = view.min_clock(), view.max_clock()
        # A round is done when every active replica reached the same clock; a leaver may complete it.
        if buffered and lo == hi and isinstance(event, Push | Leave | Tick):
            out.append(Flush(normalize=True))
        if isinstance(event, Push | Leave | Join | Pull | Tick):
            out.extend(release_waiting(view, lambda f: f.clock <= lo))
        return out, None

    return Policy("bsp", init, update, {})


@register("asp")
def asp(weight: float | None = None) -> Policy:
    """Asynchronous: apply every push on arrival with λ = ``weight`` (default 1/N); never hold."""
    check_weight(weight)

    def init(view: ClusterView) -> None:
        return None

    def update(event: Event, state: None, view: ClusterView) -> tuple[Sequence[Decision], None]:
        out: list[Decision] = []
        if isinstance(event, Push):
            out.append(Apply(async_weight(weight, view)))
        out.extend(release_waiting(view, lambda f: True))
        return out, None

    return Policy("asp", init, update, {"weight": weight})


MIN_SILENCE_S = 0.25  # nobody is silent sooner: a loaded host's short scheduling stalls
RECENT = 8  # push intervals kept per worker: its cadence is their median


@dataclass(frozen=True, slots=True)
class SspState:
    """What the SSP gate remembers: per worker, clocks added when it came back from a silence or
    joined behind (``offset``: its gate clock is its clock plus this, so it re-enters at the
    slowest responsive clock, as the engine places a worker that reconnects), which workers
    were silent at the last event (``silent``, sorted), and each worker's last :data:`RECENT`
    push intervals in s (``intervals``; an interval that was a silence is not kept)."""

    offset: Mapping[int, int]
    silent: tuple[int, ...] = ()
    intervals: Mapping[int, tuple[float, ...]] = field(default_factory=lambda: MappingProxyType({}))


def _pace(f: WorkerFacts) -> float | None:
    """A worker's own time per push: its last push interval, else its compute time."""
    if f.last_push_at is not None and f.prev_push_at is not None:
        return f.last_push_at - f.prev_push_at
    return f.compute_s


def cadence(f: WorkerFacts, recent: Sequence[float] = ()) -> float | None:
    """A worker's own time per push: the median of its ``recent`` push intervals (one slow or
    fast push does not move it), else what its facts say (:func:`_pace`)."""
    return statistics.median(recent) if recent else _pace(f)


def silence_limit(pace: float, patience: float) -> float:
    """How long a worker whose cadence is ``pace`` may compute without a push before it is
    silent: ``patience`` of its own push intervals, and never less than :data:`MIN_SILENCE_S`."""
    return max(patience * pace, MIN_SILENCE_S)


def silent_workers(
    view: ClusterView,
    patience: float | None,
    intervals: Mapping[int, Sequence[float]] = MappingProxyType({}),
) -> frozenset[int]:
    """Workers computing (not waiting) with no push for more than :func:`silence_limit`: stopped,
    cut off or hung. Each is measured against its own cadence (:func:`cadence` of its recent
    ``intervals``), so a worker that pushes every 50 ms is silent after 0.5 s (patience 10) and
    one that pushes every 2 s only after 20 s. A worker that has not pushed since it joined
    (loading, compiling) is measured from its join against the others' typical (median) cadence;
    nobody is silent before anyone has a cadence. ``patience=None``: nobody ever is."""
    if patience is None:
        return frozenset()
    paces = {
        w: p for w, f in view.workers.items() if (p := cadence(f, intervals.get(w, ()))) is not None
    }
    typical = statistics.median(paces.values()) if paces else None
    out = set()
    for w, f in view.workers.items():
        since, pace = (
            (f.joined_at, typical) if f.last_push_at is None else (f.last_push_at, paces.get(w))
        )
        if f.waiting or pace is None:
            continue
        if view.now - since > silence_limit(pace, patience):
            out.add(w)
    return frozenset(out)


def _intervals(
    state: SspState, event: Event, view: ClusterView, patience: float | None
) -> dict[int, tuple[float, ...]]:
    """``state.intervals`` of the workers still in, with the interval a push just closed: unless
    it was a silence (the worker was silent at the last event, or the interval is longer than
    its silence limit), which says nothing of its cadence."""
    out = {w: h for w, h in state.intervals.items() if w in view.workers}
    if not isinstance(event, Push) or event.worker not in view.workers:
        return out
    w, f = event.worker, view.workers[event.worker]
    if f.last_push_at is None or f.prev_push_at is None or w in state.silent:
        return out
    gap = f.last_push_at - f.prev_push_at
    recent = out.get(w, ())
    pace = statistics.median(recent) if recent else None
    if patience is not None and pace is not None and gap > silence_limit(pace, patience):
        return out
    out[w] = (*recent[-(RECENT - 1) :], gap)
    return out


def ssp_gate(staleness: int, weight: float | None, patience: float | None) -> Policy:
    """The SSP rule shared by ``ssp`` and policies that build on it."""

    def init(view: ClusterView) -> SspState:
        return SspState(MappingProxyType({}))

    def update(
        event: Event, state: SspState | None, view: ClusterView
    ) -> tuple[Sequence[Decision], SspState]:
        st = state if state is not None else init(view)
        out: list[Decision] = []
        if isinstance(event, Push):
            out.append(Apply(async_weight(weight, view)))
        off = {w: o for w, o in st.offset.items() if w in view.workers}
        intervals = _intervals(st, event, view, patience)
        silent = silent_workers(view, patience, intervals)
        gate = {w: f.clock + off.get(w, 0) for w, f in view.workers.items()}
        # A worker back from a silence, or joining behind, starts at the slowest responsive gate
        # clock: the others do not wait while it works off a gap it could never close.
        entering = {w for w in st.silent if w in view.workers and w not in silent}
        if isinstance(event, Join) and event.worker in view.workers:
            entering.add(event.worker)
        for w in sorted(entering):
            others = [c for v, c in gate.items() if v != w and v not in silent]
            if others and min(others) > gate[w]:
                off[w] = off.get(w, 0) + min(others) - gate[w]
                gate[w] = min(others)
        responsive = [c for w, c in gate.items() if w not in silent]
        lo = min(responsive or gate.values() or [0])
        out.extend(release_waiting(view, lambda f: gate[f.worker] - lo <= staleness))
        kept = MappingProxyType({w: o for w, o in off.items() if o > 0})
        return out, SspState(kept, tuple(sorted(silent)), MappingProxyType(intervals))

    params = {"staleness": staleness, "weight": weight, "patience": patience}
    return Policy("ssp", init, update, params)


@register("ssp")
def ssp(staleness: int = 3, weight: float | None = None, patience: float | None = 10.0) -> Policy:
    """Stale synchronous (Ho et al. 2013): apply on arrival; a replica may start its next step only
    while its clock is at most ``staleness`` ahead of the slowest responsive one.

    A worker that has been computing for more than ``patience`` times its own push interval (the
    median of its last 8, and at least 0.25 s) without a push is *silent* (stopped, cut off, hung):
    the others stop waiting for it at once, not after the daemon's heartbeat timeout drops it.
    When it pushes again it re-enters at the slowest responsive clock. ``patience=None``: wait for
    every active worker, always."""
    if not isinstance(staleness, int) or isinstance(staleness, bool) or staleness < 0:
        raise ValueError(f"staleness must be an int >= 0, got {staleness!r}")
    if patience is not None and (
        isinstance(patience, bool) or not isinstance(patience, int | float) or not patience > 0
    ):
        raise ValueError(f"patience must be > 0 (or omitted/None to always wait), got {patience!r}")
    check_weight(weight)
    return ssp_gate(staleness, weight, None if patience is None else float(patience))
