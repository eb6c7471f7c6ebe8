"""Equal-finish batch sizing, shared by the policies that size batches and by the pipeline planner:
a worker's timing model ``T(b) = a + c·b`` fitted to its pushes (:class:`Timing`), and the split
of a total that makes every worker finish together (:func:`fluid_finish`, in integers
:func:`equal_finish`, in whole quanta :func:`quantized`).

Plain arithmetic with no policy of its own: LB-BSP and H-PS (:mod:`policies.shares`), DiLoCo's
shares (:mod:`policies.diloco`) and the pipeline replicas' split (:mod:`policies.dpmp.costs`) import
it, and it imports nothing of theirs.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

ALPHA = 0.3  # EWMA weight of a new timing observation


@dataclass(frozen=True, slots=True)
class Timing:
    """EWMA moments of (batch b, seconds t) for one worker."""

    n: int = 0
    b: float = 0.0
    t: float = 0.0
    bb: float = 0.0
    bt: float = 0.0

    def add(self, b: float, t: float) -> Timing:
        """Fold in one observation."""
        if self.n == 0:
            return Timing(1, b, t, b * b, b * t)
        a = ALPHA
        return Timing(
            self.n + 1,
            (1 - a) * self.b + a * b,
            (1 - a) * self.t + a * t,
            (1 - a) * self.bb + a * b * b,
            (1 - a) * self.bt + a * b * t,
        )

    def fit(self) -> tuple[float, float] | None:
        """``(a, c)`` with ``T(b) = a + c·b``; proportional (a = 0) until batches have varied."""
        if self.n == 0 or self.b <= 0:
            return None
        var = self.bb - self.b * self.b
        if var > 1e-6 * self.b * self.b:
            c = (self.bt - self.b * self.t) / var
            a = self.t - c * self.b
            if c > 0 and a >= 0:
                return a, c
        return 0.0, max(self.t, 1e-9) / self.b


def fluid_finish(
    total: float,
    a: Sequence[float],
    c: Sequence[float],
    lo: Sequence[float],
    hi: Sequence[float],
    iters: int = 100,
) -> list[float]:
    """Fractional shares ``x_i = clip((τ-a_i)/c_i, lo_i, hi_i)`` with ``Σ x_i = total``: the
    equal-finish point, found by bisection on ``τ`` (the sum is non-decreasing in ``τ``). The
    integer planners (:func:`equal_finish`, the pipeline replicas' split) round it their way."""
    n = len(c)

    def sizes(tau: float) -> list[float]:
        return [min(hi[i], max(lo[i], (tau - a[i]) / c[i])) for i in range(n)]

    t_lo = min(a[i] + c[i] * lo[i] for i in range(n))
    t_hi = max(a[i] + c[i] * hi[i] for i in range(n))
    for _ in range(iters):
        mid = (t_lo + t_hi) / 2
        if sum(sizes(mid)) < total:
            t_lo = mid
        else:
            t_hi = mid
    return sizes(t_hi)


def equal_finish(
    total: int, a: Sequence[float], c: Sequence[float], lo: Sequence[int], hi: Sequence[int]
) -> list[int]:
    """Integer batches ``b_i`` with ``Σ b_i = total`` and ``lo_i ≤ b_i ≤ hi_i`` that equalise the
    predicted finish times ``a_i + c_i·b_i``: ``τ = (B + Σ a_i/c_i) / Σ 1/c_i``, ``b_i = (τ-a_i)/c_i``;
    with bounds, ``τ`` solves ``Σ clip((τ-a_i)/c_i, lo_i, hi_i) = B`` (bisection); largest
    remainders round.
    ``total`` is first clamped into ``[Σ lo, Σ hi]``."""
    n = len(c)
    if n == 0:
        return []
    if any(ci <= 0 for ci in c) or any(lo[i] > hi[i] for i in range(n)):
        raise ValueError("equal_finish needs c_i > 0 and lo_i <= hi_i")
    total = max(sum(lo), min(sum(hi), total))
    x = fluid_finish(total, a, c, lo, hi)
    base = [min(hi[i], max(lo[i], math.floor(x[i]))) for i in range(n)]
    short = total - sum(base)
    order = sorted(range(n), key=lambda i: (-(x[i] - math.floor(x[i])), i))
    while short > 0:
        moved = False
        for i in order:
            if short and base[i] < hi[i]:
                base[i] += 1
                short -= 1
                moved = True
        if not moved:
            break
    while short < 0:
        moved = False
        for i in reversed(order):
            if short and base[i] > lo[i]:
                base[i] -= 1
                short += 1
                moved = True
        if not moved:
            break
    return base


def quantized(
    total: int,
    a: Sequence[float],
    c: Sequence[float],
    lo: Sequence[int],
    hi: Sequence[int],
    quantum: int,
) -> list[int]:
    """:func:`equal_finish` in units of ``quantum`` samples, so that a worker sees few distinct
    batch sizes (each new size costs it a compilation); the remainder of ``total`` goes to the
    fastest worker. Bounds that do not fit the quantum fall back to single samples."""
    q = quantum or _auto_quantum(total, len(c))
    units, rem = divmod(total, q)
    qlo = [-(-v // q) for v in lo]
    qhi = [v // q for v in hi]
    if q == 1 or units < len(c) or any(qlo[i] > qhi[i] for i in range(len(c))):
        return equal_finish(total, a, c, lo, hi)
    sizes = [v * q for v in equal_finish(units, a, [ci * q for ci in c], qlo, qhi)]
    for i in sorted(range(len(c)), key=lambda i: c[i]):  # the remainder, fastest first
        extra = min(rem, hi[i] - sizes[i])
        sizes[i] += extra
        rem -= extra
    return sizes


def _auto_quantum(total: int, n: int) -> int:
    """A power of two near an eighth of the mean share: few sizes, balance within ~1/8."""
    q = 1
    while q * 2 <= total / (8 * max(1, n)):
        q *= 2
    return q
