"""A new pipeline stage shape's compile: dpmp runs a new replica's first step outside the round
and learns what the compile took from it; the planner's hysteresis charges that to a move to new
shapes; both simulators charge a worker's ``compile_s`` to a shape's first step, once."""

from __future__ import annotations

import dataclasses

import pytest

from hetd.sim.dpmp import SCENARIOS, mlp_blocks, round_time
from hetd.sim.loop import run_sim
from hetd.sim.results import PolicySpec
from hetd.sim.scenario import from_mapping
from policies.dpmp.costs import WorkerSpec
from policies.dpmp.groups import GroupConfig, Shape, candidates, switch_cost
from policies.dpmp.policy import DpmpPolicyState, compile_times, measure
from policies.types import Push, ReplicaShape
from tests.unit.test_dpmp_engine import TINY as ENGINE_TINY

COMPILE_S = 0.5

# test_dpmp_engine's cluster, its memory-poor workers compiling each new stage for COMPILE_S
TINY = {
    **ENGINE_TINY,
    "name": "tiny-poor-compiling",
    "workers": [
        ENGINE_TINY["workers"][0],
        {**ENGINE_TINY["workers"][1], "compile_s": COMPILE_S},
    ],
}


@pytest.mark.slow  # a 2 s run of the engine's simulator with a block model (its compiles)
def test_a_new_replica_compiles_outside_the_rounds_and_the_policy_learns_the_compile() -> None:
    run = run_sim(from_mapping(TINY), PolicySpec("dpmp"), seed=0)
    poor = {w.wid for w in run.workers if w.spec.memory is not None}
    assert [frozenset(m) for m in run.engine.pipelines.view.values()] == [frozenset(poor)]
    state = run.engine.host.state
    assert isinstance(state, DpmpPolicyState)
    # the first step took the compile longer than the next ones: the policy read it off them
    assert set(state.compiles) == poor
    assert all(COMPILE_S * 0.9 <= c <= COMPILE_S * 1.5 for c in state.compiles.values())
    # the data-parallel workers' rounds went on while the stages compiled: several versions in
    # the compile's time (a round that waited for the replica would publish one)
    formed = next(t for t, v in run.versions if v >= 2)
    during = [v for t, v in run.versions if formed < t < formed + COMPILE_S]
    assert len(during) >= 5


def test_the_policy_takes_a_shapes_compile_from_its_first_step() -> None:
    shape = ReplicaShape((1, 2), (0, 2, 4), 16, 4, (2, 1))
    st = DpmpPolicyState(pipelines=(shape,))
    for wall in (2.5, 0.3, 0.35, 0.3):
        st = measure(st, Push(0.0, 1, 0, "grad", 64, 1, wall))
    st = compile_times(st)
    assert st.compiles == {1: pytest.approx(2.2), 2: pytest.approx(2.2)}
    assert st.firsts == {}  # read once
    again = compile_times(measure(st, Push(0.0, 1, 0, "grad", 64, 1, 0.3)))
    assert again.compiles == st.compiles  # a later step is no first step


def test_a_move_to_new_shapes_costs_the_slowest_measured_compile_of_their_members() -> None:
    cfg = GroupConfig(switch_s=1.0)
    workers = {w: WorkerSpec(w, 1e-3, compile_s=c) for w, c in ((1, 3.0), (2, 4.5), (3, None))}
    new: list[Shape] = [((1, 2), (0, 2, 4), 16)]
    assert switch_cost(workers, new, [], cfg) == 4.5
    assert switch_cost(workers, new, new, cfg) == 1.0  # running already: nothing compiles
    unmeasured: list[Shape] = [((3, 1), (0, 1, 4), 16)]
    assert switch_cost({**workers, 1: WorkerSpec(1, 1e-3)}, unmeasured, [], cfg) == 1.0
    cheap = {w: dataclasses.replace(s, compile_s=0.2) for w, s in workers.items()}
    assert switch_cost(cheap, new, [], cfg) == 1.0  # the floor: slices move, a round goes without


def test_the_pipeline_simulator_charges_a_shapes_compile_to_its_first_round_only() -> None:
    blocks = mlp_blocks()
    sc = dataclasses.replace(SCENARIOS["B"], compile_s=2.0)
    workers = sc.specs(blocks)
    best = candidates(blocks, workers, sc.batch)[0]
    assert best.shapes  # B's best structure has a pipeline replica
    compiled: set[tuple[int, Shape]] = set()
    first = round_time(blocks, workers, best, compiled)
    steady = round_time(blocks, workers, best)
    assert steady + 1.5 < first <= steady + 2.0  # the pipeline's round, 2 s longer
    assert round_time(blocks, workers, best, compiled) == pytest.approx(steady)
