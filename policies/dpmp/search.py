"""The search for a pipeline replica's cuts and stage order.

:func:`best_cuts` finds the cuts of one ordered group, lexicographically: the smallest bottleneck
unit ``max u`` (:mod:`policies.dpmp.costs`), then the smallest ``Σu``, under each stage's memory.
It is a two-phase dynamic program over (blocks so far, stages so far), :func:`dp_cuts`: phase 1
finds the smallest feasible bottleneck ``β``, phase 2 the smallest sum with every unit within
``β``. One pass over (max, sum) pairs would not be exact (a prefix with a lower max may have the
larger sum once a later stage sets the max); the two phases equal :func:`brute_force_cuts`.
:func:`best_partition` also tries the stage orders.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

from policies.dpmp.costs import (
    RHO,
    Block,
    ReplicaCost,
    WorkerSpec,
    base_inflight,
    fits,
    replica_cost,
    stage_terms,
)

_TIE = 1e-9  # relative tolerance when comparing bottlenecks


def _better(a: tuple[float, float], b: tuple[float, float]) -> bool:
    """Lexicographic (bottleneck, sum) with a relative tolerance on the bottleneck."""
    if a[0] < b[0] * (1 - _TIE):
        return True
    if a[0] > b[0] * (1 + _TIE):
        return False
    return a[1] < b[1]


def brute_force_cuts(
    blocks: Sequence[Block],
    group: Sequence[WorkerSpec],
    micro: int,
    micro_batches: int | None = None,
) -> ReplicaCost | None:
    """Every cut vector tried: the best that fits memory (None if none fits)."""
    best: ReplicaCost | None = None
    n, n_blocks = len(group), len(blocks)
    for inner in itertools.combinations(range(1, n_blocks), n - 1):
        cost = replica_cost(blocks, group, (0, *inner, n_blocks), micro, micro_batches)
        if not fits(cost, group):
            continue
        key = (cost.bottleneck, sum(cost.units))
        if best is None or _better(key, (best.bottleneck, sum(best.units))):
            best = cost
    return best


def dp_cuts(
    blocks: Sequence[Block],
    group: Sequence[WorkerSpec],
    micro: int,
    micro_batches: int | None = None,
) -> ReplicaCost | None:
    """The cuts by dynamic programming over (blocks so far, stages so far), O(S·L²) stage
    evaluations: phase 1 finds the smallest feasible bottleneck β, phase 2 the smallest Σu with
    every unit ≤ β. Equals :func:`brute_force_cuts`; None when no cut vector fits memory."""
    n, n_blocks = len(group), len(blocks)
    if n < 1 or n > n_blocks:
        return None
    taus = [w.taus(blocks) for w in group]
    stage: dict[tuple[int, int, int], tuple[float, float] | None] = {}
    for s in range(n):
        inflight = base_inflight(s, n, micro_batches)
        for i in range(s, n_blocks - (n - s) + 1):
            for j in range(i + 1, n_blocks - (n - s - 1) + 1):
                units, mem, _ = stage_terms(blocks, taus[s], group[s], i, j, s, n, micro, inflight)
                ok = mem <= RHO * group[s].mem_bytes
                stage[(s, i, j)] = (max(units), sum(units)) if ok else None
    inf = math.inf
    # phase 1: bottleneck[s][j] = best max over stages 0..s-1 covering blocks [0, j)
    neck = [[inf] * (n_blocks + 1) for _ in range(n + 1)]
    neck[0][0] = 0.0
    for s in range(n):
        for (ss, i, j), val in stage.items():
            if ss == s and val is not None and neck[s][i] < inf:
                neck[s + 1][j] = min(neck[s + 1][j], max(neck[s][i], val[0]))
    beta = neck[n][n_blocks]
    if beta == inf:
        return None
    limit = beta * (1 + _TIE) + 1e-300
    # phase 2: the smallest Σu with every stage's max unit within β
    total = [[inf] * (n_blocks + 1) for _ in range(n + 1)]
    back: dict[tuple[int, int], int] = {}
    total[0][0] = 0.0
    for s in range(n):
        for (ss, i, j), val in stage.items():
            if ss != s or val is None or val[0] > limit or total[s][i] == inf:
                continue
            if total[s][i] + val[1] < total[s + 1][j]:
                total[s + 1][j] = total[s][i] + val[1]
                back[(s + 1, j)] = i
    cuts = [n_blocks]
    for s in range(n, 0, -1):
        cuts.append(back[(s, cuts[-1])])
    return replica_cost(blocks, group, cuts[::-1], micro, micro_batches)


def best_cuts(
    blocks: Sequence[Block],
    group: Sequence[WorkerSpec],
    micro: int,
    micro_batches: int | None = None,
) -> ReplicaCost | None:
    """The best cuts of one ordered group (the dynamic program); None if memory allows none."""
    return dp_cuts(blocks, group, micro, micro_batches)


def _orders(group: Sequence[WorkerSpec]) -> list[tuple[WorkerSpec, ...]]:
    """All orders up to 4 stages; beyond, by memory (most first) and its adjacent swaps."""
    if len(group) <= 4:
        return list(itertools.permutations(group))
    base = tuple(sorted(group, key=lambda w: (-w.mem_bytes, w.sample_s, w.wid)))
    out = [base]
    for k in range(len(base) - 1):
        swapped = list(base)
        swapped[k], swapped[k + 1] = swapped[k + 1], swapped[k]
        out.append(tuple(swapped))
    return out


def best_partition(
    blocks: Sequence[Block],
    group: Sequence[WorkerSpec],
    micro: int,
    micro_batches: int | None = None,
) -> ReplicaCost | None:
    """The best order and cuts of ``group`` (lexicographic bottleneck, Σu, then fewer bytes on
    the slowest uplink); None when no order and cuts fit memory."""
    best: ReplicaCost | None = None
    for order in _orders(group):
        cost = best_cuts(blocks, order, micro, micro_batches)
        if cost is None:
            continue
        if best is None or _better(
            (cost.bottleneck, sum(cost.units)), (best.bottleneck, sum(best.units))
        ):
            best = cost
    return best
