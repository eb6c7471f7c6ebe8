"""Synchronisation gates: BSP, ASP, SSP (docs/policies.md).

Each is stateless beyond its parameters: the clocks it needs are the engine's facts, so ``init``
returns ``None`` and a hot swap is always valid.
"""

from __future__ import annotations

from collections.abc import Sequence

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


def ssp_gate(staleness: int, weight: float | None) -> Policy:
    """The SSP rule shared by ``ssp`` and policies that build on it."""

    def init(view: ClusterView) -> None:
        return None

    def update(event: Event, state: None, view: ClusterView) -> tuple[Sequence[Decision], None]:
        out: list[Decision] = []
        if isinstance(event, Push):
            out.append(Apply(async_weight(weight, view)))
        lo = view.min_clock()
        out.extend(release_waiting(view, lambda f: f.clock - lo <= staleness))
        return out, None

    return Policy("ssp", init, update, {"staleness": staleness, "weight": weight})


@register("ssp")
def ssp(staleness: int = 3, weight: float | None = None) -> Policy:
    """Stale synchronous (Ho et al. 2013): apply on arrival; a replica may start its next step only
    while its clock is at most ``staleness`` ahead of the slowest active one."""
    if not isinstance(staleness, int) or isinstance(staleness, bool) or staleness < 0:
        raise ValueError(f"staleness must be an int >= 0, got {staleness!r}")
    check_weight(weight)
    return ssp_gate(staleness, weight)
