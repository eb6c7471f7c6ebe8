"""Synchronisation gates: BSP, ASP, SSP (docs/policies.md).

BSP and ASP are stateless beyond their parameters: the clocks they need are the engine's facts, so
``init`` returns ``None`` and a hot swap is always valid. SSP keeps only what ``init`` can start
from nothing: which workers are silent and the clock offsets of those that came back.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
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


MIN_SILENCE_S = 1.0  # no worker is silent sooner: a fast worker's jitter never counts


@dataclass(frozen=True, slots=True)
class SspState:
    """What the SSP gate remembers: per worker, clocks added when it came back from a silence or
    joined behind (``offset``: its gate clock is its clock plus this, so it re-enters at the
    slowest responsive clock, as the engine places a worker that reconnects), and which workers
    were silent at the last event (``silent``, sorted)."""

    offset: Mapping[int, int]
    silent: tuple[int, ...] = ()


def _pace(f: WorkerFacts) -> float | None:
    """A worker's own time per push: its last push interval, else its compute time."""
    if f.last_push_at is not None and f.prev_push_at is not None:
        return f.last_push_at - f.prev_push_at
    return f.compute_s


def silent_workers(view: ClusterView, patience: float | None) -> frozenset[int]:
    """Workers computing (not waiting) with no push for more than ``patience`` times their own
    pace and at least :data:`MIN_SILENCE_S`: stopped, cut off or hung. A worker that has not
    pushed since it joined (loading, compiling) is measured from its join against the others'
    typical (median) pace; nobody is silent before anyone has a pace. ``patience=None``: nobody
    ever is."""
    if patience is None:
        return frozenset()
    paces = [p for f in view.workers.values() if (p := _pace(f)) is not None]
    typical = statistics.median(paces) if paces else None
    out = set()
    for w, f in view.workers.items():
        since, pace = (
            (f.joined_at, typical) if f.last_push_at is None else (f.last_push_at, _pace(f))
        )
        if f.waiting or pace is None:
            continue
        if view.now - since > max(patience * pace, MIN_SILENCE_S):
            out.add(w)
    return frozenset(out)


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
        silent = silent_workers(view, patience)
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
        return out, SspState(kept, tuple(sorted(silent)))

    params = {"staleness": staleness, "weight": weight, "patience": patience}
    return Policy("ssp", init, update, params)


@register("ssp")
def ssp(staleness: int = 3, weight: float | None = None, patience: float | None = 10.0) -> Policy:
    """Stale synchronous (Ho et al. 2013): apply on arrival; a replica may start its next step only
    while its clock is at most ``staleness`` ahead of the slowest responsive one.

    A worker that has been computing for more than ``patience`` times its own push interval (and at
    least 1 s) without a push is *silent* (stopped, cut off, hung): the others stop waiting for it
    at once, not after the daemon's heartbeat timeout drops it. When it pushes again it re-enters
    at the slowest responsive clock. ``patience=None``: wait for every active worker, always."""
    if not isinstance(staleness, int) or isinstance(staleness, bool) or staleness < 0:
        raise ValueError(f"staleness must be an int >= 0, got {staleness!r}")
    if patience is not None and (
        isinstance(patience, bool) or not isinstance(patience, int | float) or not patience > 0
    ):
        raise ValueError(f"patience must be > 0 (or omitted/None to always wait), got {patience!r}")
    check_weight(weight)
    return ssp_gate(staleness, weight, None if patience is None else float(patience))
