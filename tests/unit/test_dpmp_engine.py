"""dpmp in the engine's simulator: pipeline replicas run by the simulator's replica driver
(:mod:`hetd.sim.replicas`), a memory-poor worker that cannot run a whole-model step, and the
speed of workers only pipeline stages time (:mod:`policies.dpmp.calibrate`)."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from hetd.bench.dpmp import round_s, three_columns
from hetd.sim.dpmp import mlp_blocks
from hetd.sim.loop import OUT_OF_MEMORY, run_sim
from hetd.sim.results import PolicySpec
from hetd.sim.scenario import from_mapping, load_scenario, replace
from policies import make_policy
from policies.dpmp.calibrate import stage_speed
from policies.dpmp.costs import WorkerSpec, replica_cost
from policies.dpmp.policy import DpmpPolicyState, calibrated, measure, worker_specs
from policies.types import ClusterView, Push, Regroup, ReplicaShape, Tick, WorkerFacts

# bytes: the 784-128-128-128-10 block MLP with its gradients and a 16-sample micro-batch needs
# 1.10 MB; its first block alone (with the planner's 0.8 usable) fits
POOR = 1_060_000

TINY = {
    "name": "tiny-poor",
    "dataset": "mnist5k",
    "model": "hetd.zoo.blocks:mlp_model",
    "model_kwargs": {"hidden": [128, 128, 128]},
    "global_batch": 64,
    "base_batch": 32,
    "base_step_s": 0.01,
    "micro_batch": 16,
    "budget_s": 2.0,
    "eval_interval_s": 1.0,
    "workers": [
        {"slowdown": 1.0, "count": 2, "bandwidth": 1e8, "latency_s": 0.001},
        {"slowdown": 2.0, "count": 2, "bandwidth": 1e8, "latency_s": 0.001, "memory": POOR},
    ],
}


@pytest.mark.slow  # a 2 s run of the engine's simulator with a block model (its compiles)
def test_a_memory_poor_worker_released_for_a_whole_model_step_leaves_out_of_memory() -> None:
    run = run_sim(from_mapping(TINY), PolicySpec("lbbsp"), seed=0)
    poor = [w for w in run.workers if w.spec.memory is not None]
    assert poor and all(w.gone is not None and w.steps == 0 for w in poor)
    for w in poor:
        assert w.wid not in run.engine.members.facts  # it left: lbbsp goes on with the others
    fit = [w for w in run.workers if w.spec.memory is None]
    assert all(w.gone is None and w.steps > 5 for w in fit)
    assert OUT_OF_MEMORY.startswith("out of memory")


@pytest.mark.slow  # a 2 s run of the engine's simulator with a block model (its compiles)
def test_dpmp_runs_the_memory_poor_workers_as_a_pipeline_replica_in_the_simulator() -> None:
    run = run_sim(from_mapping(TINY), PolicySpec("dpmp"), seed=0)
    poor = {w.wid for w in run.workers if w.spec.memory is not None}
    assert all(w.gone is None for w in run.workers)  # nobody was asked for a step it cannot hold
    assert [frozenset(m) for m in run.engine.pipelines.view.values()] == [frozenset(poor)]
    head = next(iter(run.engine.pipelines.view))
    stats = run.engine.members.stats[head]
    assert stats.pushes >= 5  # the replica's assembled steps, as its head's pushes
    later = (poor - {head}).pop()
    assert run.engine.members.stats[later].pushes == 0  # a later stage pushes nothing of its own
    assert run.result.final_accuracy > 0.3


def test_stage_speed_finds_the_speed_that_predicts_the_measured_step() -> None:
    blocks = mlp_blocks()
    true = [
        WorkerSpec(0, 1e-3, bw_up=1e8, bw_down=1e8),
        WorkerSpec(1, 3e-3, bw_up=1e8, bw_down=1e8),
    ]
    cuts, micro, count = (0, 1, 4), 16, 8
    measured = replica_cost(blocks, true, cuts, micro, count).time(micro * count)
    guess = [true[0], dataclasses.replace(true[1], sample_s=1e-3)]
    found = stage_speed(blocks, guess, frozenset({1}), cuts, micro, count, measured)
    assert found == {1: pytest.approx(3e-3, rel=1e-6)}
    assert stage_speed(blocks, guess, frozenset(), cuts, micro, count, measured) == {}
    assert stage_speed(blocks, guess, frozenset({1}), cuts, micro, count, 0.0) == {}


def test_round_s_is_the_median_interval_after_the_warm_up() -> None:
    versions = [(0.1, 1), (0.5, 2), (4.0, 3), (4.2, 4), (4.6, 5), (4.8, 6)]
    assert round_s(versions, 9.0) == pytest.approx(0.2)  # from 3 s on: 0.2, 0.4, 0.2
    assert round_s(versions[:1], 9.0) != round_s(versions[:1], 9.0)  # nan: no interval


def test_three_columns_shows_what_was_run() -> None:
    scenario: dict[str, Any] = {"name": "B main", "dpmp_s": 0.24, "lbbsp_s": 0.30}
    scenario |= {"engine_dpmp_s": 0.25, "engine_lbbsp_s": 0.29, "engine_over_pipeline": 0.25 / 0.24}
    doc = {"engine_budget_s": 10.0, "real_budget_s": None, "scenarios": {"B": scenario}}
    row = three_columns(doc)[-1]
    assert row.startswith("| B main | 240.0 / 300.0 (-20.0%) | 250.0 / 290.0 (-13.8%) | — |")
    assert row.endswith("| 1.042 |")


@pytest.mark.slow  # two engine runs of scenario B (half a minute)
def test_the_packaged_scenario_b_gives_dpmp_its_pipeline_gain_in_the_engine() -> None:
    # 4 virtual s: the rounds (0.239 s against 0.287, seed 0) are those of 8 s, at half the cost
    sc = replace(load_scenario("B"), budget_s=4.0)
    rounds = {}
    for policy in ("dpmp", "lbbsp"):
        run = run_sim(sc, PolicySpec(policy), seed=0)
        rounds[policy] = round_s(run.versions, sc.budget_s)
    assert rounds["dpmp"] <= 0.85 * rounds["lbbsp"]


def _facts(wid: int, **kw: object) -> WorkerFacts:
    base = WorkerFacts(wid, f"w{wid}", 0, 0, False, 0.0, stages=True)
    return dataclasses.replace(base, **kw)  # type: ignore[arg-type]


def test_the_policy_times_a_stage_only_worker_by_its_replicas_steps() -> None:
    """Worker 3 (memory-poor) is stage 1 of replica 2 + 3 and never timed itself: the planner's
    speed for it is the median of the others until the replica's steps are measured, then the
    speed that predicts them; its unmeasured link is the median of the measured ones."""
    blocks = mlp_blocks()
    fast = {"sample_s": 1e-3, "link_bps": 1e8}
    view = ClusterView(
        now=0.0,
        version=0,
        workers={1: _facts(1, **fast), 2: _facts(2, profile={"sample_s": 1e-3}, link_bps=1e8)},
        global_batch=512,
        replicas={2: (2, 3)},
        stage_workers={3: _facts(3, free_mem=5_742_588)},
        blocks=tuple((b.param_bytes, b.act_bytes, b.flops) for b in blocks),
    )
    specs = worker_specs(view, 1.0)
    assert specs[3].sample_s == pytest.approx(1e-3) and specs[3].bw_up == pytest.approx(1e8)
    shape = ReplicaShape((2, 3), (0, 1, 4), 16, 8)
    true = [specs[2], dataclasses.replace(specs[3], sample_s=4e-3)]
    wall = replica_cost(blocks, true, shape.cuts, 16, 8).time(128)
    st = DpmpPolicyState(pipelines=(shape,))
    first = measure(st, Push(1.0, 2, 0, "grad", 128, 1, 10 * wall, None))  # its stages compile
    assert calibrated(view, blocks, 1.0, first) == {}  # the first step alone times nobody
    st = measure(first, Push(1.0, 2, 0, "grad", 128, 1, wall, None))
    st = measure(st, Push(1.0, 1, 0, "grad", 128, 1, 9.9, None))  # not a replica's: not kept
    assert list(st.measured.values()) == [((10 * wall, 128), (wall, 128))]
    speeds = calibrated(view, blocks, 1.0, st)
    assert speeds == {3: pytest.approx(4e-3, rel=1e-6)}  # worker 2 timed itself: kept
    assert worker_specs(view, 1.0, speeds)[3].sample_s == pytest.approx(4e-3, rel=1e-6)


def test_a_structure_planned_before_the_blocks_were_known_is_planned_again() -> None:
    """A policy swap's trial view has no blocks: the model is planned as one block, data
    parallel only. Once the blocks are in the view, the memory-poor pair is formed at once (the
    hysteresis does not hold a structure that could have had no pipeline)."""
    blocks = mlp_blocks()
    timed = {"sample_s": 1e-3, "link_bps": 1e8, "push_bytes": 3.7e6, "waiting": True}
    slow = {**timed, "sample_s": 2e-3}
    poor = {**slow, "free_mem": 5_742_588}
    facts = {
        1: _facts(1, **timed),
        2: _facts(2, **timed),
        3: _facts(3, **slow),
        4: _facts(4, **poor),
        5: _facts(5, **poor),
    }
    trial = ClusterView(now=0.0, version=0, workers=facts, global_batch=512)
    pol = make_policy("dpmp")
    out, st = pol.update(Tick(0.0), pol.init(trial), trial)
    assert not any(isinstance(d, Regroup) and d.replicas for d in out)
    view = dataclasses.replace(
        trial, blocks=tuple((b.param_bytes, b.act_bytes, b.flops) for b in blocks)
    )
    for wid in st.working:  # the round's pushes; the next round is planned with the blocks
        out, st = pol.update(Push(0.3, wid, 0, "grad", 100, 1, 0.1, None), st, view)
    groups = [d.replicas for d in out if isinstance(d, Regroup)]
    assert [frozenset(s.members) for s in groups[0]] == [frozenset({4, 5})]
