"""The calibrated simulator: ``hetd calibrate`` writes a complete profile; the simulator charges it
where a real run pays (the daemon as one server, the workers' codecs, late evaluations); the
default profile changes nothing."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import optax
import pytest

from hetd.cli.bench import main as bench_main
from hetd.cli.main import main
from hetd.codecs import registry as codecs
from hetd.sim.costs import FIELDS, CostProfile, load_costs, write_costs
from hetd.sim.loop import run_sim
from hetd.sim.results import PolicySpec
from hetd.sim.scenario import Scenario, from_mapping

DIGITS: dict[str, Any] = {
    "name": "digits-costs",
    "dataset": "digits",
    "model": "mlp",
    "model_kwargs": {"hidden": [32]},
    "global_batch": 128,
    "base_batch": 32,
    "base_step_s": 0.01,
    "target_accuracy": 0.9,
    "budget_s": 1.0,
    "eval_interval_s": 0.25,
    "lr": 0.2,
    "workers": [{"slowdown": 1.0, "count": 4}],
}


def digits(**changes: Any) -> Scenario:
    return from_mapping({**DIGITS, **changes}, "digits-costs")


def test_the_default_profile_charges_nothing(tmp_path: Path) -> None:
    """No profile, the default one, and a file of zeros (profile steps emulated) give the same
    run: the golden runs (tests/golden) pin that run."""
    two = [{"slowdown": 1.0}, {"slowdown": 3.0, "bandwidth": 5e6}]
    plain = run_sim(digits(workers=two), PolicySpec("ssp"), seed=1).result.to_json()
    default = run_sim(digits(workers=two), PolicySpec("ssp"), seed=1, costs=CostProfile())
    assert default.result.to_json() == plain
    zeros = {name: 0.0 for name in codecs.names()}
    flat = CostProfile(
        push_decode_s_per_param=zeros,
        apply_s={"grad": 0.0, "delta": 0.0},
        publish_s_per_param=zeros,
        worker_encode_s_per_param=zeros,
        worker_decode_s_per_param=zeros,
        off_loop_bytes=0,
    )
    write_costs(tmp_path / "zeros.json", flat)
    sc = digits(workers=two, costs=str(tmp_path / "zeros.json"))
    assert run_sim(sc, PolicySpec("ssp"), seed=1).result.to_json() == plain


def test_an_apply_cost_longer_than_a_step_serialises_pushes() -> None:
    """The daemon is one writer: with each update taking 50 ms to apply, four workers of 10 ms
    steps get at most one update per 50 ms through, however fast they push."""
    apply_s = 0.05
    sc = digits()
    free = run_sim(sc, PolicySpec("asp")).engine.applier.updates_applied
    busy = CostProfile(apply_s={"grad": apply_s, "delta": apply_s})
    run = run_sim(sc, PolicySpec("asp"), costs=busy)
    bound = sc.budget_s / apply_s
    applied = run.engine.applier.updates_applied
    assert applied <= bound + 1
    assert applied >= 0.8 * bound  # the daemon was the bottleneck all along
    assert free > 4 * bound  # without the cost the workers set the pace


def _adam_steps(run: Any) -> int:
    _, opt_state, _ = run.engine.store.state()
    return int(optax.tree_utils.tree_get(opt_state, "count"))


def test_a_busy_daemon_combines_its_batch_into_one_optimizer_step() -> None:
    """As under the daemon: the pushes that queue while it is busy are applied as one Adam step of
    their weighted sum, however many; with nothing queued every update is its own step."""
    sc = digits(optimizer="adam", lr=0.001)
    free = run_sim(sc, PolicySpec("asp"))
    assert _adam_steps(free) == free.engine.applier.updates_applied
    busy = CostProfile(apply_s={"grad": 0.02, "delta": 0.02})
    run = run_sim(sc, PolicySpec("asp"), costs=busy)
    applied = run.engine.applier.updates_applied
    assert _adam_steps(run) <= run.engine.meters.publishes < applied  # several updates per publish
    assert _adam_steps(run) < 0.75 * applied
    again = run_sim(sc, PolicySpec("asp"), costs=busy)
    assert again.result.to_json() == run.result.to_json()  # deterministic for a given profile


def test_worker_codecs_and_overheads_lengthen_the_step() -> None:
    """One worker, no waiting: each step is compute + encode + fixed overhead, then the push,
    then the parameters, which take their decode time too."""
    n_params = 64 * 32 + 32 + 32 * 10 + 10
    per = 1e-6  # s per parameter: encode and decode each take n_params µs
    costs = CostProfile(
        worker_encode_s_per_param={"none": per},
        worker_decode_s_per_param={"none": per},
        worker_step_s=0.002,
    )
    sc = digits(global_batch=32, workers=[{"slowdown": 1.0, "bandwidth": 1e12}])
    plain = run_sim(sc, PolicySpec("asp")).result.trace.timeline["0"]
    spans = run_sim(sc, PolicySpec("asp"), costs=costs).result.trace.timeline["0"]
    computes = [b - a for a, b, kind in spans if kind == "compute"]
    assert computes[1] == pytest.approx(0.01 + n_params * per + 0.002)  # [0] is the profile
    starts = [a for a, _, kind in spans if kind == "compute"][1:]
    plain_starts = [a for a, _, kind in plain if kind == "compute"][1:]
    added = 2 * n_params * per + 0.002
    assert starts[2] - starts[1] == pytest.approx(plain_starts[2] - plain_starts[1] + added)


def test_evaluations_are_recorded_eval_s_late_and_profiles_take_profile_s() -> None:
    costs = CostProfile(eval_s=0.1, profile_s=0.001)
    run = run_sim(digits(), PolicySpec("asp"), costs=costs)
    times = [t for t, _ in run.result.curve]
    assert times == pytest.approx([0.0, 0.35, 0.6, 0.85, 1.0])  # first and last at their times
    first = run.result.trace.timeline["0"][1]  # the profile exchange, as compute
    assert first[1] - first[0] == pytest.approx(0.001)


def test_hetd_calibrate_writes_every_field(tmp_path: Path) -> None:
    out = tmp_path / "costs.json"
    args = ["calibrate", "--model", "mlp", "--dataset", "digits", "--out", str(out)]
    assert main([*args, "--repeats", "2", "--quiet"]) == 0
    doc = json.loads(out.read_text())
    assert list(doc["costs"]) == list(FIELDS)
    assert doc["about"]["dataset"] == "digits" and doc["about"]["n_params"] > 0
    # the end-to-end terms are fitted from real runs of a scenario's setting: none given here
    assert doc["costs"]["exchange_s"] == doc["costs"]["release_stagger_s"] == 0.0
    for name, value in doc["costs"].items():
        if name in ("exchange_s", "release_stagger_s"):
            continue
        values = list(value.values()) if isinstance(value, dict) else [value]
        assert values, name
        for v in values:
            assert isinstance(v, int | float) and math.isfinite(v) and v > 0, (name, v)
    for table in ("push_decode_s_per_param", "publish_s_per_param", "worker_encode_s_per_param"):
        assert set(doc["costs"][table]) == set(codecs.names())
    assert set(doc["costs"]["apply_s"]) == {"grad", "delta", "grad:int8", "delta:int8"}
    load_costs(out)  # and it reads back
    scenario = tmp_path / "digits.json"
    scenario.write_text(json.dumps({**DIGITS, "budget_s": 0.5}))
    sim = ["sim", "--scenario", str(scenario), "--costs", str(out), "--quiet"]
    assert bench_main(sim) == 0


def test_calibrate_belongs_to_the_parity_suite(capsys: pytest.CaptureFixture[str]) -> None:
    assert bench_main(["bench", "--calibrate", "--scenario", "S1", "--quiet"]) == 2
    assert "--calibrate belongs to --suite parity" in capsys.readouterr().err


def test_the_end_to_end_terms_make_the_simulated_step_the_real_one() -> None:
    """A real daemon with one real worker, then two: the fitted ``exchange_s`` is what a real step
    costs beyond the pieces (never nothing: websockets, thread hops), and charging it makes the
    simulator's step exactly the real one measured; a synchronous round of two workers costs the
    simulator at least what one worker's step does."""
    from hetd.bench.cluster_costs import fit_cluster, fit_scenario
    from hetd.bench.real import run_real

    sc = digits(workers=[{"slowdown": 1.0, "count": 2}], global_batch=64)
    exchange, stagger, measured = fit_cluster(sc, CostProfile(), run_real, fit_s=2.0)
    assert exchange > 0 and stagger >= 0
    assert measured["step_real_1_s"] > measured["step_sim_1_s"]
    one = fit_scenario(sc, 1, 2.0)
    fitted = CostProfile(exchange_s=exchange, release_stagger_s=stagger)
    run = run_sim(one, PolicySpec("bsp"), costs=fitted).result
    assert one.budget_s / run.pushes == pytest.approx(measured["step_real_1_s"], rel=0.05)
    two = run_sim(fit_scenario(sc, 2, 2.0), PolicySpec("bsp"), costs=fitted).result
    assert 2 * one.budget_s / two.pushes >= one.budget_s / run.pushes * 0.95
