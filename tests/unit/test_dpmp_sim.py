"""The dpmp simulator: event-simulated pipelines against the planner, and the scenarios' batch
time figures (DP+MP against DP-only)."""

from __future__ import annotations

import math
import random
import statistics

import pytest

from hetd.sim.dpmp import SCENARIOS, budget_run, compare, pipeline_makespan
from policies.dpmp.costs import Block, WorkerSpec, replica_cost, stage_order
from policies.dpmp.search import dp_cuts


def test_stage_order_is_1f1b() -> None:
    assert stage_order(1, 3) == [("F", 0), ("B", 0), ("F", 1), ("B", 1), ("F", 2), ("B", 2)]
    assert stage_order(3, 4) == [
        ("F", 0), ("F", 1), ("F", 2), ("B", 0), ("F", 3), ("B", 1), ("B", 2), ("B", 3)
    ]  # fmt: skip
    assert stage_order(5, 2) == [("F", 0), ("F", 1), ("B", 0), ("B", 1)]
    with pytest.raises(ValueError, match="inflight"):
        stage_order(0, 2)


def test_equal_stages_without_links_follow_the_pipeline_formula() -> None:
    blocks = [Block(f"b{j}", 1.0, 4.0, 1.0) for j in range(4)]
    for n in (1, 2, 4):
        group = [WorkerSpec(i, 4e-3) for i in range(n)]  # 1 ms per block per sample
        cuts = [k * 4 // n for k in range(n + 1)]
        for big_m in (1, 3, 8):
            cost = replica_cost(blocks, group, cuts, 8, big_m)
            sim = pipeline_makespan(blocks, group, cuts, 8, big_m, cost.inflight)
            pushpull = cost.time(0) - (sum(cost.units) - cost.period)
            bound = cost.time(big_m * 8) - pushpull  # Σu + (M-1)·max u
            assert big_m * cost.period <= sim + 1e-12  # the bottleneck works M times
            # 1F1B's cool-down (backwards twice the forwards) costs a little over the formula
            # in deep pipelines: 93.3 ms against 88 for S = 4, M = 8
            assert sim <= 1.07 * bound
            if n <= 2 or big_m == 1:
                assert sim == pytest.approx(bound)


def test_the_planner_predicts_event_simulated_pipelines() -> None:
    rng = random.Random(5)
    ratios = []
    while len(ratios) < 400:
        n_blocks = rng.randint(2, 8)
        blocks = [
            Block(f"b{j}", rng.uniform(1e3, 1e5), rng.uniform(10, 2000), rng.uniform(0.1, 5))
            for j in range(n_blocks)
        ]
        group = [
            WorkerSpec(
                k,
                rng.uniform(1e-3, 4e-3),
                mem_bytes=rng.choice([math.inf, rng.uniform(1e5, 1e7)]),
                bw_up=rng.uniform(1e6, 1e8),
                bw_down=rng.uniform(1e6, 1e8),
                lat_s=rng.uniform(0, 5e-3),
            )
            for k in range(rng.randint(1, min(5, n_blocks)))
        ]
        m, big_m = rng.choice([4, 8, 16]), rng.randint(1, 12)
        cost = dp_cuts(blocks, group, m, big_m)
        if cost is None:
            continue
        sim = pipeline_makespan(blocks, group, cost.cuts, m, big_m, cost.inflight)
        pushpull = max(
            2 * w.lat_s + p / w.bw_up + p / w.bw_down
            for w, p in zip(group, cost.slice_bytes, strict=True)
        )
        ratios.append(sim / (cost.time(big_m * m) - pushpull))
    ratios.sort()
    assert statistics.median(ratios) == pytest.approx(1.0, abs=0.02)
    inside = sum(0.65 <= r <= 1.10 for r in ratios) / len(ratios)
    # the rest: deep pipelines whose relay latencies are long against their stages (98.8 % of
    # 1,975 instances were within; the worst of these 400 is 1.53)
    assert inside >= 0.95
    assert ratios[-1] <= 1.6


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_scenario_figures(seed: int) -> None:
    b = compare(SCENARIOS["B"], seed=seed)
    assert b.reduction >= 0.15  # DP+MP ≥ 15 % less batch time than DP-only
    assert abs(b.dpmp / b.predicted - 1) <= 0.15  # measured within ±15 % of the prediction
    assert b.bsp > b.lbbsp > b.dpmp
    d = compare(SCENARIOS["D"], seed=seed)
    assert d.reduction >= 0.45
    for key in ("C", "E"):  # where model parallelism cannot help it must not lose
        f = compare(SCENARIOS[key], seed=seed)
        assert f.dpmp <= 1.05 * f.lbbsp


def test_budget_run_meets_the_budget_and_v_trades_time_for_cost() -> None:
    low = budget_run(SCENARIOS["B"], v=1.0, rounds=400)
    mid = budget_run(SCENARIOS["B"], v=10.0, rounds=400)
    assert abs(mid.money / mid.budget - 1) <= 0.05  # time-averaged cost within 5 % of budget
    assert mid.tau > mid.fastest_tau  # the budget costs speed
    assert low.tau >= mid.tau and low.money <= mid.money  # larger V: faster, dearer
    assert low.max_queue < mid.max_queue
