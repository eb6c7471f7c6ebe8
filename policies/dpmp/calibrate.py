"""The speed of workers known only as pipeline stages, from their replica's measured steps.

A memory-poor worker never runs a whole-model step: no data-parallel push and no profile (both
need the whole model) ever time it, so the planner knows its speed only as a guess (the median
of the others). Its replica's steps are timed, though: the head's push of an assembled step
carries the step's wall time, release to last part. :func:`stage_speed` finds the one factor
on the guessed workers' seconds per sample that makes the cost model's prediction for the step
(:func:`policies.dpmp.costs.replica_cost`, the step's cuts, micro-batch and count) equal to the
measured time; the stage workers' speeds are then the guess times that factor. Workers already
timed keep their speeds. Pure: no clock, no I/O.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from policies.dpmp.costs import Block, WorkerSpec, replica_cost

LO, HI = 1e-3, 1e3  # the factor's range
ITERS = 60  # bisection steps on log(factor): a relative error far below the timings' noise


def stage_speed(
    blocks: Sequence[Block],
    group: Sequence[WorkerSpec],
    guessed: frozenset[int],
    cuts: Sequence[int],
    micro: int,
    micro_batches: int,
    measured_s: float,
) -> dict[int, float]:
    """Seconds per sample of the ``guessed`` members of ``group`` (stage order) that make the
    predicted step of ``micro_batches`` micro-batches of ``micro`` last ``measured_s``; empty
    when no member is guessed or the measurement is not positive. The factor is clipped to
    [``LO``, ``HI``] (a step slower than any compute explains: the links or a straggler)."""
    if not guessed & {w.wid for w in group} or not measured_s > 0 or micro_batches < 1:
        return {}

    def predicted(factor: float) -> float:
        scaled = [
            dataclasses.replace(w, sample_s=w.sample_s * factor) if w.wid in guessed else w
            for w in group
        ]
        cost = replica_cost(blocks, scaled, cuts, micro, micro_batches)
        return cost.time(micro * micro_batches)

    lo, hi = math.log(LO), math.log(HI)
    for _ in range(ITERS):
        mid = (lo + hi) / 2
        if predicted(math.exp(mid)) < measured_s:
            lo = mid
        else:
            hi = mid
    factor = math.exp((lo + hi) / 2)
    return {w.wid: w.sample_s * factor for w in group if w.wid in guessed}
