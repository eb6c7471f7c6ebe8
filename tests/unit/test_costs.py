"""The simulator's cost profile: the file round-trips, a bad or incomplete one is refused with a
message that names the field, lookups by codec, and the scenario's ``costs`` key."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from hetd.bench.parity import parity_markdown
from hetd.sim.costs import FIELDS, CostError, CostProfile, load_costs, write_costs
from hetd.sim.scenario import ScenarioError, load_file

CODECS = {"none": 1e-9, "int8": 2e-9}


def profile() -> CostProfile:
    return CostProfile(
        message_s=1e-4,
        push_decode_s_per_param=dict(CODECS),
        apply_s={"grad": 3e-4, "delta": 2e-4, "grad:int8": 2.5e-4, "delta:int8": 2e-4},
        buffer_s_per_param=3e-10,
        publish_s_per_param=dict(CODECS),
        worker_encode_s_per_param=dict(CODECS),
        worker_decode_s_per_param=dict(CODECS),
        worker_step_s=4e-4,
        eval_s=5e-3,
        profile_s=4e-3,
        off_loop_bytes=262144,
        about={"model": "mlp", "n_params": 9610},
    )


def doc() -> dict[str, Any]:
    return profile().to_json()


def test_a_profile_round_trips_through_its_file(tmp_path: Path) -> None:
    path = tmp_path / "costs.json"
    write_costs(path, profile())
    assert load_costs(path) == profile()
    written = json.loads(path.read_text())
    assert list(written["costs"]) == list(FIELDS)  # every field, in the documented order
    assert written["units"]["apply_s"] == "s per update by kind"
    none = CostProfile(profile_s=None)
    write_costs(path, none)
    assert load_costs(path) == none  # the default: empty tables, profile steps emulated


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda d: d["costs"].pop("apply_s"), "missing 'apply_s'"),
        (lambda d: d["costs"].pop("eval_s") and d["costs"].pop("message_s"), "'message_s'"),
        (lambda d: d["costs"].update(compile_s=1.0), "unknown 'compile_s'"),
        (lambda d: d["costs"].update(eval_s=-1.0), "costs.eval_s must be finite and >= 0"),
        (lambda d: d["costs"].update(eval_s=math.nan), "costs.eval_s must be finite"),
        (lambda d: d["costs"].update(eval_s="5 ms"), "costs.eval_s must be a number"),
        (lambda d: d["costs"].update(eval_s=True), "costs.eval_s must be a number"),
        (lambda d: d["costs"].update(apply_s=0.1), "costs.apply_s must be an object"),
        (lambda d: d["costs"]["apply_s"].pop("delta"), "apply_s lacks 'delta'"),
        (lambda d: d["costs"]["apply_s"].update(sparse=1.0), "unknown key(s) 'sparse'"),
        (
            lambda d: d["costs"]["publish_s_per_param"].update(int8=-1.0),
            "costs.publish_s_per_param['int8'] must be finite and >= 0",
        ),
        (lambda d: d["costs"].update(off_loop_bytes=2.5), "off_loop_bytes must be an integer"),
        (lambda d: d["units"].update(eval_s="ms"), "units['eval_s'] is 'ms'"),
        (lambda d: d.update(format="other"), "not a hetd cost profile"),
        (lambda d: d.update(version=2), "not a hetd cost profile of version 1"),
        (lambda d: d.update(extra=1), "unknown top-level key(s) 'extra'"),
        (lambda d: d.pop("costs"), "'costs' must be an object"),
    ],
)
def test_a_bad_or_incomplete_profile_is_refused_naming_the_field(
    tmp_path: Path, change: Any, message: str
) -> None:
    d = doc()
    change(d)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(d))
    with pytest.raises(CostError) as info:
        load_costs(path)
    assert message in str(info.value)
    assert str(path) in str(info.value)


def test_unreadable_files_are_refused(tmp_path: Path) -> None:
    with pytest.raises(CostError, match="cannot read cost profile"):
        load_costs(tmp_path / "nowhere.json")
    (tmp_path / "x.json").write_text("{not json")
    with pytest.raises(CostError, match="not valid JSON"):
        load_costs(tmp_path / "x.json")
    with pytest.raises(CostError, match="is a JSON object"):
        CostProfile.from_json([1, 2])


def test_profile_s_may_be_null_meaning_emulated_profile_steps() -> None:
    d = doc()
    d["costs"]["profile_s"] = None
    assert CostProfile.from_json(d).profile_s is None


def test_figures_are_looked_up_by_codec_name() -> None:
    p = profile()
    assert p.push_decode("int8:block=1024", 1000) == pytest.approx(2e-6)
    assert p.publish("none", 10) == pytest.approx(1e-8)
    assert p.apply("grad", int8=True) == 2.5e-4
    assert p.apply("delta") == 2e-4
    with pytest.raises(
        CostError,
        match=r"no worker_encode_s_per_param for codec .topk:k=0.1. \(it has int8, none\)",
    ):
        p.worker_encode("topk:k=0.1", 10)
    zero = CostProfile()
    assert zero.worker_decode("topk", 10**6) == 0.0
    assert zero.apply("grad", int8=True) == 0.0


def test_a_scenario_names_its_profile_beside_it(tmp_path: Path) -> None:
    text = 'name = "x"\ndataset = "digits"\nmodel = "mlp"\n{}\n[[workers]]\nslowdown = 1.0\n'
    (tmp_path / "a.toml").write_text(text.format('costs = "costs.json"'))
    assert load_file(tmp_path / "a.toml").costs == str(tmp_path / "costs.json")
    (tmp_path / "b.toml").write_text(text.format(f'costs = "{tmp_path / "c.json"}"'))
    assert load_file(tmp_path / "b.toml").costs == str(tmp_path / "c.json")
    (tmp_path / "c.toml").write_text(text.format(""))
    assert load_file(tmp_path / "c.toml").costs == ""
    (tmp_path / "d.toml").write_text(text.format("costs = 1"))
    with pytest.raises(ScenarioError, match="'costs' must be a string"):
        load_file(tmp_path / "d.toml")


def test_parity_md_names_the_profile_the_sim_charged() -> None:
    verdict = {"scenario": "S1", "budget_s": 10.0, "seeds": 1, "sentence": "S1: fine.", "band": 1.3}
    verdict["rank_rule"] = "rule"
    base = {"policies": {}, "verdict": verdict}
    assert "cost profile" not in parity_markdown(base)
    with_costs = {**base, "costs": {"file": "out/costs.json", **doc()}}
    text = parity_markdown(with_costs)
    assert "cost profile `out/costs.json`" in text and "apply (grad) 0.300 ms" in text


def _bsp_run(periods: list[float], workers: int = 2) -> Any:
    """A real-mode-like BSP result: every worker released at the start of each round."""
    from hetd.sim.results import RunResult, Trace

    starts = [sum(periods[:k]) for k in range(len(periods) + 1)]
    spans = [(t, t + 0.005, "busy") for t in starts]
    return RunResult(
        policy="bsp",
        scenario="fit",
        seed=0,
        lr=0.1,
        tta_s=None,
        final_accuracy=0.0,
        samples_per_s=0.0,
        idle_fraction={},
        staleness_mean=0.0,
        staleness_p95=0.0,
        bytes_up=0,
        bytes_down=0,
        pushes=workers * len(starts),
        releases=workers * len(starts),
        curve=[],
        trace=Trace(timeline={str(i): list(spans) for i in range(workers)}),
    )


def test_the_fits_step_is_the_median_round_so_a_load_spike_does_not_move_it() -> None:
    from hetd.bench.cluster_costs import _step_s, round_periods

    quiet = [0.010] * 60
    spiked = [0.010] * 50 + [0.250] * 10  # a 2.5 s load spike over a sixth of the rounds
    run_q, run_s = _bsp_run(quiet), _bsp_run(spiked)
    assert sorted(round_periods(run_s))[-1] == pytest.approx(0.25)
    # the same step time with and without the spike (the mean over the budget moved 25x more)
    assert _step_s(run_q, 2, sum(quiet)) == pytest.approx(0.010)
    assert _step_s(run_s, 2, sum(spiked)) == pytest.approx(0.010)
    assert sum(spiked) / 61 > 0.045
    # too few rounds on the timeline: the budget over the rounds made
    short = _bsp_run([0.02] * 4)
    assert _step_s(short, 2, 0.1) == pytest.approx(0.1 / 5)
