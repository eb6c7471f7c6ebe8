"""``hetd bench --suite auto``: the table and the verdict from hand-made results documents (no run),
auto's spec for a list of fixed policies, and what the command line refuses. The suite's own
runs: tests/integration/test_bench_auto.py."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from hetd.bench.auto_suite import auto_spec, judge, markdown, scenario_row, switches_text
from hetd.cli.bench import main
from hetd.sim.results import PolicySpec, RunResult, check_results, parse_policies
from policies import make_policy

AUTO = "auto:dwell_s=2.0"


def _run(policy: str, scenario: str, seed: int, tta: float | None) -> dict[str, Any]:
    r = RunResult(
        policy=policy,
        scenario=scenario,
        seed=seed,
        lr=0.2,
        tta_s=tta,
        final_accuracy=0.9 if tta is not None else 0.8,
        samples_per_s=1000.0,
        idle_fraction={"0": 0.1},
        staleness_mean=0.0,
        staleness_p95=0.0,
        bytes_up=1,
        bytes_down=1,
        pushes=1,
        releases=1,
        curve=[[0.0, 0.1]],
    )
    return r.to_json()


def _results(scenario: str, ttas: dict[str, list[float | None]]) -> dict[str, Any]:
    runs = [
        _run(policy, scenario, seed, t) for policy, ts in ttas.items() for seed, t in enumerate(ts)
    ]
    doc = {"runs": runs, "summary": []}
    check_results(doc)  # the shape results.json has
    return doc


def _row(scenario: str, budget: float, ttas: dict[str, list[float | None]]) -> dict[str, Any]:
    switches = {0: [{"at_s": 4.0, "from": "lbbsp", "to": "ashl", "why": "w"}], 1: [], 2: []}
    return scenario_row(
        _results(scenario, ttas),
        scenario=scenario,
        budget_s=budget,
        plan_every_s=budget / 10,
        auto=AUTO,
        switches=switches,
    )


def test_never_counts_as_the_budget_and_the_best_fixed_policy_is_compared() -> None:
    row = _row(
        "S1", 20.0, {"bsp": [10.0, 12.0, None], "lbbsp": [5.0, 6.0, 7.0], AUTO: [5.2, 5.4, 6.0]}
    )
    assert row["policies"]["bsp"]["median_s"] == 12.0  # 10, 12 and the budget
    assert row["policies"]["bsp"]["reached"] == 2
    assert row["best"] == "lbbsp" and row["best_median_s"] == 6.0
    assert row["auto_median_s"] == 5.4
    assert row["ratio"] == pytest.approx(0.9)
    assert row["switches"] == {
        "0": [{"at_s": 4.0, "from": "lbbsp", "to": "ashl", "why": "w"}],
        "1": [],
        "2": [],
    }


def test_a_scenario_above_the_ratio_misses_though_the_geometric_mean_passes() -> None:
    s1 = _row(
        "S1", 20.0, {"bsp": [10.0, 12.0, None], "lbbsp": [5.0, 6.0, 7.0], AUTO: [5.2, 5.4, 6.0]}
    )
    s4 = _row("S4", 60.0, {"bsp": [30.0] * 3, "lbbsp": [None] * 3, AUTO: [40.0] * 3})
    doc = judge([s1, s4], seeds=3, mode="sim")
    geo = doc["geomean_s"]
    assert geo["auto"] == pytest.approx((5.4 * 40.0) ** 0.5)
    assert geo["bsp"] == pytest.approx((12.0 * 30.0) ** 0.5)
    assert geo["lbbsp"] == pytest.approx((6.0 * 60.0) ** 0.5)  # never on S4: its budget
    v = doc["verdict"]
    assert v["geomean"] and not v["every_scenario"] and not v["pass"]
    assert v["misses"] == ["S4: auto 1.33x bsp, above 1.10x"]
    md = markdown(doc)
    assert "| S4 | 6 s | bsp | 30.00 s | 40.00 s | 1.33 ✗ | 1/0/0: ashl |" in md
    assert "| S1 | 2 s | lbbsp | 6.00 s | 5.40 s | 0.90 | 1/0/0: ashl |" in md
    assert "Verdict: miss." in md and "* S4: auto 1.33x bsp" in md
    json.dumps(doc)  # auto.json is written as it is


def test_auto_within_the_ratio_everywhere_but_slower_on_the_mean_misses() -> None:
    # auto 1.05x the best on both, but the best differs: one fixed policy is good on both
    a = _row("A", 20.0, {"bsp": [10.0] * 3, "asp": [10.4] * 3, AUTO: [10.5] * 3})
    b = _row("B", 20.0, {"bsp": [10.4] * 3, "asp": [10.0] * 3, AUTO: [10.5] * 3})
    doc = judge([a, b], seeds=3, mode="sim")
    assert doc["verdict"]["every_scenario"] and not doc["verdict"]["geomean"]
    assert [m.split(",")[1].strip() for m in doc["verdict"]["misses"]] == [
        "not below bsp's 10.2 s",
        "not below asp's 10.2 s",
    ]
    faster = _row("B", 20.0, {"bsp": [10.4] * 3, "asp": [10.0] * 3, AUTO: [9.0] * 3})
    doc = judge([a, faster], seeds=3, mode="sim")
    assert doc["verdict"]["pass"] and doc["verdict"]["misses"] == []
    md = markdown(doc)
    assert "Verdict: pass." in md and "| auto | 9.72 s | 1.00 |" in md


def test_never_reached_and_partly_reached_are_marked_in_the_table() -> None:
    row = _row("S1", 20.0, {"bsp": [None] * 3, "asp": [3.0, None, 4.0], AUTO: [None] * 3})
    assert row["best"] == "asp" and row["ratio"] == pytest.approx(20.0 / 4.0)
    md = markdown(judge([row], seeds=3, mode="sim"))
    assert "| asp | 4.00 s (2/3 reached) | never (20 s) | 5.00 ✗ |" in md


def test_a_results_document_without_auto_is_refused() -> None:
    with pytest.raises(ValueError, match=r"no run of 'auto:dwell_s=2\.0'"):
        scenario_row(
            _results("S1", {"bsp": [1.0]}),
            scenario="S1",
            budget_s=20.0,
            plan_every_s=2.0,
            auto=AUTO,
            switches=None,
        )


def test_switches_text() -> None:
    assert switches_text(None) == "–"
    assert switches_text({"0": [], "1": []}) == "0/0"
    to = [{"to": "ashl"}, {"to": "adsp"}]
    assert switches_text({"0": to, "1": [{"to": "ashl"}]}) == "2/1: ashl×2, adsp"


def test_auto_chooses_among_the_fixed_policies_it_is_compared_with() -> None:
    default = parse_policies("bsp,ssp,asp,lbbsp,hps,adsp,ashl,dssp")
    assert auto_spec(default, 2.0) == PolicySpec("auto", (("dwell_s", 2.0),))
    two = auto_spec(parse_policies("bsp,ssp:staleness=2,diloco"), 6.0)
    assert dict(two.params) == {"candidates": "bsp,ssp:staleness=2", "dwell_s": 6.0, "start": "bsp"}
    with_lbbsp = auto_spec(parse_policies("bsp,lbbsp"), 6.0, {"margin": 0.1, "dwell_s": 1.0})
    assert dict(with_lbbsp.params) == {"candidates": "bsp,lbbsp", "dwell_s": 1.0, "margin": 0.1}
    for spec in (two, with_lbbsp):
        make_policy(spec.name, spec.build_params())  # auto accepts what the suite gives it
    with pytest.raises(ValueError, match="auto needs a candidate"):
        auto_spec(parse_policies("diloco"), 2.0)


def test_the_command_line_refuses_auto_among_the_fixed_policies(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["bench", "--suite", "auto", "--scenarios", "S1", "--out", str(tmp_path)]
    assert main([*argv, "--policies", "bsp,auto"]) == 2
    assert "give auto's own parameters with --auto" in capsys.readouterr().err
    assert main([*argv, "--scenarios", "S1,nope"]) == 2
    assert "nope" in capsys.readouterr().err
    assert not (tmp_path / "auto.json").exists()


def test_real_runs_plan_as_often_as_the_scenario_says() -> None:
    from hetd.bench.real import _config
    from hetd.sim.scenario import load_scenario, replace

    sc = replace(load_scenario("S1"), plan_every_s=2.0)
    cfg = _config(sc, PolicySpec("auto"), seed=0, lr=0.2)
    assert cfg.policy.plan_every_s == 2.0 and cfg.policy.name == "auto"
