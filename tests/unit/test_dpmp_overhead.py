"""dpmp's figure for a step's fixed work (:func:`policies.dpmp.policy.overhead`): measured on the
data-parallel steps (release to push, less compute and the model's transfers both ways) and added
to their predicted steps. A pipeline replica's predicted step is calibrated on its measured
steps, which carry its fixed work: without the figure the split weighed the replica with its
fixed work and the data-parallel workers without theirs, and gave them too much of the batch."""

from __future__ import annotations

import dataclasses

import pytest

from hetd.sim.dpmp import mlp_blocks
from policies.dpmp.costs import WorkerSpec, replica_cost
from policies.dpmp.policy import (
    MIN_OVERHEADS,
    DpmpPolicyState,
    calibrated,
    measure,
    overhead,
    step_overhead,
    worker_specs,
)
from policies.types import ClusterView, Push, ReplicaShape, WorkerFacts

FIXED_S = 0.08  # the truth: every step, data parallel or pipeline, takes this beyond the model
BLOCKS = mlp_blocks()
PARAMS = sum(b.param_bytes for b in BLOCKS)
SHAPE = ReplicaShape((2, 3), (0, 1, 4), 16, 8)


def _facts(wid: int, **kw: object) -> WorkerFacts:
    base = WorkerFacts(wid, f"w{wid}", 0, 0, False, 0.0, stages=True)
    return dataclasses.replace(base, **kw)  # type: ignore[arg-type]


VIEW = ClusterView(
    now=0.0,
    version=0,
    workers={
        1: _facts(1, sample_s=1e-3, link_bps=1e8),
        2: _facts(2, profile={"sample_s": 1e-3}, link_bps=1e8),
    },
    global_batch=512,
    replicas={2: (2, 3)},
    stage_workers={3: _facts(3, free_mem=5_742_588)},
    blocks=tuple((b.param_bytes, b.act_bytes, b.flops) for b in BLOCKS),
)


def _dp_rounds(st: DpmpPolicyState, n: int) -> DpmpPolicyState:
    """``n`` rounds in which worker 1 (data parallel) computes 160 samples in 0.16 s and its
    push arrives the model's transfers and :data:`FIXED_S` later."""
    for r in range(n):
        start = 10.0 * r
        st = dataclasses.replace(
            st, started=start, working=(1, 2), pushed=frozenset(), released=frozenset({1, 2})
        )
        took = 0.16 + 2 * PARAMS / 1e8 + FIXED_S
        st = overhead(st, Push(start + took, 1, 0, "grad", 160, 1, 0.16, None), VIEW, BLOCKS, 1.0)
        st = dataclasses.replace(st, pushed=frozenset({1}))
        # a second push of the round and the replica's head: neither is a data-parallel step
        # released at the round's start
        st = overhead(st, Push(start + 5.0, 1, 0, "grad", 160, 1, 0.16, None), VIEW, BLOCKS, 1.0)
        st = overhead(st, Push(start + 5.0, 2, 0, "grad", 128, 1, 0.3, None), VIEW, BLOCKS, 1.0)
    return st


def test_the_fixed_work_of_a_step_is_measured_on_the_data_parallel_steps() -> None:
    st = DpmpPolicyState(pipelines=(SHAPE,))
    few = _dp_rounds(st, MIN_OVERHEADS - 1)
    assert step_overhead(few) == 0.0  # not enough steps yet
    st = _dp_rounds(st, MIN_OVERHEADS)
    assert st.overheads == pytest.approx([FIXED_S] * MIN_OVERHEADS)
    assert step_overhead(st) == pytest.approx(FIXED_S)
    spec = worker_specs(VIEW, 1.0, None, step_overhead(st))[1]
    dp = replica_cost(BLOCKS, [spec], (0, len(BLOCKS)), 160, 1)
    assert dp.time(160) == pytest.approx(0.16 + 2 * PARAMS / 1e8 + FIXED_S)  # as measured


def test_the_fixed_work_is_not_added_to_a_pipeline_its_steps_calibrate() -> None:
    """A pipeline's measured steps carry its own fixed work, which the stage-speed calibration
    reads: the data-parallel figure is not added to it on top (its steps may hold less than a
    whole-model step's frames; read twice, the stages would look faster than they are)."""
    base = worker_specs(VIEW, 1.0)
    true = [base[2], dataclasses.replace(base[3], sample_s=4e-3)]
    wall = replica_cost(BLOCKS, true, SHAPE.cuts, 16, 8).time(128)
    st = DpmpPolicyState(pipelines=(SHAPE,))
    for _ in range(3):  # the first step compiles and is left out: the same walls here
        st = measure(st, Push(1.0, 2, 0, "grad", 128, 1, wall, None))
    assert calibrated(VIEW, BLOCKS, 1.0, st) == {3: pytest.approx(4e-3, rel=1e-6)}
    st = _dp_rounds(st, MIN_OVERHEADS)
    assert step_overhead(st) == pytest.approx(FIXED_S)
    assert calibrated(VIEW, BLOCKS, 1.0, st) == {3: pytest.approx(4e-3, rel=1e-6)}
    fixed = [dataclasses.replace(w, step_s=FIXED_S) for w in true]
    assert replica_cost(BLOCKS, fixed, SHAPE.cuts, 16, 8).time(128) == pytest.approx(wall)


def test_a_worker_spec_without_fixed_work_costs_as_before() -> None:
    w = WorkerSpec(1, 1e-3, bw_up=1e8, bw_down=1e8, lat_s=2e-3)
    plain = replica_cost(BLOCKS, [w], (0, len(BLOCKS)), 32, 4)
    more = replica_cost(BLOCKS, [dataclasses.replace(w, step_s=0.05)], (0, 4), 32, 4)
    assert more.fill_s == pytest.approx(plain.fill_s + 0.05)
    assert more.per_sample_s == plain.per_sample_s


def test_a_replicas_step_is_timed_as_the_round_waits_for_it() -> None:
    """The round waits from its start to the replica's push, which comes after the driver's
    wall (release to last part) by the head's work around the step: the step is timed so,
    except a push of a round it was not released at the start of."""
    st = DpmpPolicyState(pipelines=(SHAPE,), working=(1, 2), started=10.0)
    late = measure(st, Push(10.35, 2, 0, "grad", 128, 1, 0.3, None))  # released later
    assert list(late.measured.values()) == [((0.3, 128),)]
    st = measure(
        dataclasses.replace(st, released=frozenset({1, 2})),
        Push(10.35, 2, 0, "grad", 128, 1, 0.3, None),
    )
    assert list(st.measured.values()) == [((pytest.approx(0.35), 128),)]
    again = dataclasses.replace(st, pushed=frozenset({2}))  # pushed this round already
    again = measure(again, Push(12.0, 2, 0, "grad", 128, 1, 0.3, None))
    assert next(iter(again.measured.values()))[-1] == (0.3, 128)


def test_a_step_released_after_the_rounds_start_is_not_timed_from_it() -> None:
    """A worker that joined (or pulled) after the round began was released then: its push's
    distance from the round's start is not its step's work."""
    st = DpmpPolicyState(pipelines=(SHAPE,), working=(1, 2), started=0.0, released=frozenset({2}))
    took = 0.16 + 2 * PARAMS / 1e8
    st = overhead(st, Push(0.6 + took, 1, 0, "grad", 160, 1, 0.16, None), VIEW, BLOCKS, 1.0)
    assert st.overheads == ()


def test_the_figure_is_the_floor_of_the_steps_not_their_median() -> None:
    """A step after a join carries the worker's profile or compile too: the figure is what every
    step takes, the least of them."""
    st = _dp_rounds(DpmpPolicyState(pipelines=(SHAPE,)), MIN_OVERHEADS)
    st = dataclasses.replace(st, overheads=(0.5, 0.26, *st.overheads))
    assert step_overhead(st) == pytest.approx(FIXED_S)
