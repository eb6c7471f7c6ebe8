"""Dynamic staleness and staleness-aware weights: DSSP and DynSGD (docs/policies.md).

``dssp`` is SSP whose bound moves within ``[s_lo, s_lo + r_max]``: only the fastest worker may run
extra iterations, as many as make it stop closest to the slowest worker's next predicted push.
``staleness_weight`` is a concern that multiplies each push's weight by ``1/(d+1)`` (d = applied
updates since the work began), composable with any gate; ``dynsgd`` is that concern on a gate.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from policies.compose import compose
from policies.registry import make_policy, register
from policies.sync import async_weight, check_weight
from policies.types import (
    Apply,
    ClusterView,
    Decision,
    Event,
    Leave,
    Policy,
    Push,
    Release,
    Scale,
    WorkerFacts,
)


def closest_stop(
    fast_last: float, fast_interval: float, slow_last: float, slow_interval: float, r_max: int
) -> int:
    """DSSP's synchronisation controller: the number of extra iterations ``r*`` in ``0..r_max``
    after which the fastest worker's predicted push time ``F_k = fast_last + k·I_f`` is closest to
    one of the slowest worker's predicted pushes ``S_j = slow_last + j·I_s`` (j = 1..r_max).

    A two-pointer merge over both sorted lists; ties go to the smaller ``k`` (less staleness).
    """
    if fast_interval <= 0 or slow_interval <= 0 or r_max <= 0:
        return 0
    best_k, best_d = 0, float("inf")
    j = 1
    for k in range(r_max + 1):
        f = fast_last + k * fast_interval
        # Advance j while the next slow push is no farther from f than the current one.
        while j < r_max and abs(slow_last + (j + 1) * slow_interval - f) <= abs(
            slow_last + j * slow_interval - f
        ):
            j += 1
        d = abs(slow_last + j * slow_interval - f)
        if d < best_d:
            best_k, best_d = k, d
    return best_k


def _interval(f: WorkerFacts) -> float | None:
    if f.last_push_at is None or f.prev_push_at is None:
        return None
    return f.last_push_at - f.prev_push_at


@dataclass(frozen=True, slots=True)
class DsspState:
    """Extra iterations still granted per worker (``r_i``)."""

    granted: Mapping[int, int]


@register("dssp")
def dssp(s_lo: int = 3, r_max: int = 12, weight: float | None = None) -> Policy:
    """DSSP (Zhao et al., ICDCS 2019): SSP with lower bound ``s_lo``; the fastest worker, when past
    it, gets ``r*`` extra iterations (at most ``r_max``) from the predicted push times of the fastest
    and slowest workers; unknown intervals fall back to SSP(``s_lo``)."""
    for name, v in (("s_lo", s_lo), ("r_max", r_max)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise ValueError(f"{name} must be an int >= 0, got {v!r}")
    check_weight(weight)

    def init(view: ClusterView) -> DsspState:
        return DsspState(MappingProxyType({}))

    def update(
        event: Event, state: DsspState, view: ClusterView
    ) -> tuple[Sequence[Decision], DsspState]:
        out: list[Decision] = []
        granted = dict(state.granted)
        if isinstance(event, Leave):
            granted.pop(event.worker, None)
        lo = view.min_clock()
        if isinstance(event, Push) and event.worker in view.workers:
            out.append(Apply(async_weight(weight, view)))
            p = view.workers[event.worker]
            r = granted.get(p.worker, 0)
            if r > 0:
                granted[p.worker] = r - 1
                out.append(Release(p.worker))
            elif p.clock - lo > s_lo and p.clock == view.max_clock():
                slowest = min(view.workers.values(), key=lambda f: (f.clock, f.worker))
                i_f, i_s = _interval(p), _interval(slowest)
                r_star = 0
                if i_f is not None and i_s is not None and p.last_push_at and slowest.last_push_at:
                    r_star = closest_stop(p.last_push_at, i_f, slowest.last_push_at, i_s, r_max)
                # The bound stays within [s_lo, s_lo + r_max]: no grant past it.
                r_star = max(0, min(r_star, s_lo + r_max + 1 - (p.clock - lo)))
                if r_star > 0:
                    granted[p.worker] = r_star - 1
                    out.append(Release(p.worker))
        for w, f in view.workers.items():
            if f.waiting and f.clock - lo <= s_lo:
                out.append(Release(w))
        return out, DsspState(MappingProxyType(granted))

    return Policy("dssp", init, update, {"s_lo": s_lo, "r_max": r_max, "weight": weight})


@dataclass(frozen=True, slots=True)
class VersionCounts:
    """Pushes applied per base version (recent versions only), for ``version_avg``."""

    counts: Mapping[int, int]


@register("staleness_weight")
def staleness_weight(mode: str = "inverse") -> Policy:
    """A weight concern: ``inverse`` scales each push by ``1/(d+1)`` with ``d = v_now - base``
    (dist-keras' DynSGD); ``version_avg`` scales it by ``1/(n_v+1)``, ``n_v`` being the pushes
    already applied from the same base version — the new update's share of a running average of
    same-version updates. (The paper's full variant also re-weights the earlier ones, which needs the
    updates themselves; this weight-only form is our [D] simplification.)"""
    if mode not in ("inverse", "version_avg"):
        raise ValueError(f"mode must be 'inverse' or 'version_avg', got {mode!r}")

    def init(view: ClusterView) -> VersionCounts:
        return VersionCounts(MappingProxyType({}))

    def update(
        event: Event, state: VersionCounts, view: ClusterView
    ) -> tuple[Sequence[Decision], VersionCounts]:
        if not isinstance(event, Push):
            return (), state
        if mode == "inverse":
            return (Scale(1.0 / (event.staleness(view) + 1)),), state
        n_v = state.counts.get(event.base_version, 0)
        keep = {v: n for v, n in state.counts.items() if v > view.version - 64}
        keep[event.base_version] = n_v + 1
        return (Scale(1.0 / (n_v + 1)),), VersionCounts(MappingProxyType(keep))

    return Policy("staleness_weight", init, update, {"mode": mode})


@register("dynsgd")
def dynsgd(gate: str = "ssp", mode: str = "inverse", **gate_params: Any) -> Policy:
    """DynSGD (Jiang et al., SIGMOD 2017): the gate ``gate`` (asp, ssp or dssp, with its own
    parameters) applying every push with weight 1, scaled by ``staleness_weight(mode)``. In steady
    ASP ``d ≈ N-1``, so the weight is about ``1/N`` by itself."""
    if gate not in ("asp", "ssp", "dssp"):
        raise ValueError(f"gate must be asp, ssp or dssp, got {gate!r}")
    if "weight" in gate_params:
        raise ValueError("dynsgd sets the gate's weight to 1; the staleness rule scales it")
    inner = make_policy(gate, {**gate_params, "weight": 1.0})
    p = compose(inner, staleness_weight(mode), name="dynsgd")
    return replace_params(p, {"gate": gate, "mode": mode, **gate_params})


def replace_params(policy: Policy, params: Mapping[str, Any]) -> Policy:
    """The same policy showing ``params`` (composed policies otherwise show their members)."""
    return policy._replace(params=dict(params))


__all__ = ["DsspState", "closest_stop", "dssp", "dynsgd", "replace_params", "staleness_weight"]
