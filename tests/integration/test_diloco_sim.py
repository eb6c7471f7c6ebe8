"""The DiLoCo family in the simulator (the real engine, store and JAX compute under a virtual
clock; docs/policies.md §13): short S1 runs that train, in whole outer rounds for ``diloco``, with
DyLU's local steps for ``diloco_async``, and around the quorum gate."""

from __future__ import annotations

import dataclasses

from hetd.sim.loop import run_sim
from hetd.sim.results import PolicySpec
from hetd.sim.scenario import load_scenario, replace

BUDGET_S = 1.0


def test_diloco_trains_in_whole_outer_rounds_through_nesterov() -> None:
    sc = replace(
        load_scenario("S1"), budget_s=BUDGET_S, outer_optimizer="nesterov:lr=0.7,momentum=0.9"
    )
    run = run_sim(sc, PolicySpec("diloco", (("H", 5),)), seed=0)
    r, engine = run.result, run.engine
    assert r.curve[-1][1] > r.curve[0][1] + 0.3  # it learns
    # balance="steps": B/N each, the fastest H steps and the slow-downs 2 and 4 fewer
    steps = sorted(p.local_steps for p in engine.members.plans.values())
    assert steps[-1] == 5 and steps[0] < steps[-1]
    assert {p.batch_size for p in engine.members.plans.values()} == {sc.global_batch // 4}
    # one version per outer round, each the mean of the four workers' deltas
    assert r.pushes // 4 <= engine.applier.updates_applied <= r.pushes // 4 + 1
    assert r.bytes_to_target is None or 0 < r.bytes_to_target <= r.bytes_up + r.bytes_down


def test_diloco_async_gives_slow_workers_fewer_local_steps() -> None:
    sc = replace(
        load_scenario("S1"),
        budget_s=BUDGET_S,
        outer_optimizer="delayed_nesterov:lr=0.7,momentum=0.9,period=4",
    )
    run = run_sim(sc, PolicySpec("diloco_async", (("H", 8),)), seed=0)
    r, engine = run.result, run.engine
    assert r.curve[-1][1] > r.curve[0][1] + 0.3
    steps = sorted(p.local_steps for p in engine.members.plans.values())
    assert steps[-1] == 8 and steps[0] < steps[-1]  # slow-downs 1, 1, 2, 4: H, H, ~H/2, ~H/4
    assert engine.applier.updates_applied == r.pushes  # every delta applied on arrival
    assert max(r.idle_fraction.values()) < 0.2  # nobody is held


def test_quorum_around_diloco_loses_no_push() -> None:
    sc = replace(load_scenario("S1"), budget_s=BUDGET_S)
    spec = PolicySpec("quorum", (("H", 5), ("policy", "diloco"), ("shares", False)))
    run = run_sim(sc, spec, seed=0)
    r, engine = run.result, run.engine
    assert r.curve[-1][1] > r.curve[0][1] + 0.3
    st = engine.host.state
    assert st.closed >= 3
    applied = sum(s.applied + s.buffered for s in engine.members.stats.values())
    assert applied == r.pushes and sum(s.dropped for s in engine.members.stats.values()) == 0


def test_diloco_int8_pulls_the_outer_step_in_int8() -> None:
    """A worker whose pseudo-gradients go in int8 takes its parameters in int8 too: after its
    first (full) frame, each release is the outer step as an int8 delta against what it holds."""
    slow = tuple(dataclasses.replace(w, bandwidth=1e7) for w in load_scenario("S1").workers)
    sc = replace(load_scenario("S1"), budget_s=0.5, workers=slow)
    run = run_sim(sc, PolicySpec("diloco", (("H", 5), ("codec", "int8"))), seed=0)
    r = run.result
    assert r.curve[-1][1] > r.curve[0][1] + 0.2  # it learns
    full = 4 * run.engine.store.n_params  # one float32 frame: what every pull carried before
    assert r.releases > 8 and r.bytes_down / r.releases < full / 2  # int8: 1/4, but the first
