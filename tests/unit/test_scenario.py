"""Scenario files (packaged S1–S5, validation that names the bad key), policy specs, the
results.json schema, and the ideal lower bound's arithmetic."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import pytest

from hetd.sim.results import (
    PolicySpec,
    RunResult,
    check_results,
    first_reach,
    parse_policies,
    summarize,
)
from hetd.sim.scenario import (
    Join,
    Leave,
    Scenario,
    ScenarioError,
    Stragglers,
    WorkerSpec,
    from_mapping,
    load_scenario,
    replace,
    scenario_names,
)
from policies import PolicyError

MINIMAL: dict[str, Any] = {
    "name": "tiny",
    "dataset": "digits",
    "model": "mlp",
    "workers": [{"slowdown": 1.0, "count": 2}, {"slowdown": 4.0}],
}


def with_(**changes: Any) -> dict[str, Any]:
    return {**MINIMAL, **changes}


# --- packaged scenarios ---------------------------------------------------------------------------


def test_the_five_benchmark_scenarios_ship_in_the_package() -> None:
    assert {"S1", "S2", "S3", "S4", "S5"} <= set(scenario_names())
    s1, s2, s3, s4, s5 = (load_scenario(n) for n in ("S1", "s2", "S3", "S4", "S5"))
    for sc in (s1, s2, s3, s4, s5):
        assert (sc.dataset, sc.model, sc.model_kwargs) == ("mnist5k", "mlp", {"hidden": (256,)})
        assert sc.target_accuracy == 0.90 and sc.n == 4 and sc.batch_per_worker == 32
    assert [w.slowdown for w in s1.workers] == [1, 1, 2, 4]
    assert all(w.stragglers == Stragglers(0.02, 5.0, 10.0) for w in s2.workers)
    assert s1.workers[0].stragglers.p == 0
    # S3: worker 0 becomes 3x slower at half the budget, whatever the budget
    assert s3.slowdown_at(0, s3.budget_s / 2 - 1e-6) == 1.0
    assert s3.slowdown_at(0, s3.budget_s / 2) == 3.0
    assert replace(s3, budget_s=8.0).slowdown_at(0, 4.0) == 3.0
    assert [w.bandwidth for w in s4.workers] == [50e6, 50e6, 25e6, 12.5e6]
    assert {w.latency_s for w in s4.workers} == {0.002}
    assert [w.slowdown for w in s5.workers] == [1, 1, 1, 1]


def test_count_expands_workers_in_order() -> None:
    sc = load_scenario("scale100")
    assert sc.n == 100 and sc.dataset == "digits"
    assert sc.workers[49].slowdown == 1.0 and sc.workers[50].slowdown == 2.0
    tiny = from_mapping(MINIMAL)
    assert [w.slowdown for w in tiny.workers] == [1.0, 1.0, 4.0]
    assert tiny.workers[0] == WorkerSpec()  # defaults: 1 GB/s, no latency, no stragglers


def test_a_json_file_and_a_toml_file_load_by_path(tmp_path: Path) -> None:
    js = tmp_path / "mine.json"
    js.write_text(json.dumps(with_(budget_s=5)))
    assert load_scenario(str(js)).budget_s == 5.0
    toml = tmp_path / "mine.toml"
    toml.write_text(
        'name = "t"\ndataset = "digits"\nmodel = "mlp"\n'
        "[[workers]]\nslowdown = 2\nstragglers = { p = 0.1 }\n"
    )
    sc = load_scenario(str(toml))
    assert sc.workers[0].slowdown == 2.0 and sc.workers[0].stragglers.p == 0.1


# --- errors name the bad key -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "needle"),
    [
        (with_(budget=3), "unknown key 'budget'"),
        (with_(workers=[{"slowdwn": 2}]), "workers[0]: unknown key 'slowdwn'"),
        (
            with_(workers=[{"slowdown": 1}, {"stragglers": {"prob": 0.1}}]),
            "workers[1].stragglers: unknown key 'prob'",
        ),
        (with_(shifts=[{"at_s": 1, "worker": 0, "speed": 2}]), "shifts[0]: unknown key 'speed'"),
        (with_(global_batch="128"), "'global_batch' must be a int"),
        (with_(global_batch=True), "'global_batch' must be a int"),
        (with_(target_accuracy=1.5), "'target_accuracy' must be in (0, 1]"),
        (with_(workers=[{"slowdown": -1}]), "workers[0]: 'slowdown' must be > 0"),
        (with_(workers=[{"count": 0}]), "'count' must be >= 1"),
        (with_(workers=[]), "'workers' must be non-empty"),
        (with_(optimizer="lbfgs"), "must be an optimizer spec"),
        (with_(shifts=[{"worker": 0, "slowdown": 2}]), "exactly one of 'at_s' or 'at_fraction'"),
        (with_(shifts=[{"worker": 3, "slowdown": 2, "at_s": 1}]), "only 3 workers"),
        (with_(global_batch=2), "must be >= the number of workers"),
        ({"name": "x", "model": "mlp", "workers": [{}]}, "missing required key(s) 'dataset'"),
        # churn: [[events]]
        (with_(events=[{"at_s": 1, "leave": 0}]), "events[0]: a leave needs 'how'"),
        (with_(events=[{"at_s": 1, "leave": 0, "how": "kill"}]), "'how' must be \"clean\""),
        (with_(events=[{"leave": 0, "how": "clean"}]), "events[0]: missing required key 'at_s'"),
        (with_(events=[{"at_s": 1}]), "events[0]: give exactly one of 'join' or 'leave'"),
        (
            with_(events=[{"at_s": 1, "leave": 0, "join": {}, "how": "clean"}]),
            "exactly one of 'join' or 'leave'",
        ),
        (with_(events=[{"at_s": 1, "join": {}, "how": "crash"}]), "'how' belongs to a leave"),
        (with_(events=[{"at_s": 1, "join": {"count": 2}}]), "events[0].join: unknown key 'count'"),
        (with_(events=[{"at_s": 1, "join": {"slowdown": 0}}]), "join: 'slowdown' must be > 0"),
        (with_(events=[{"at_s": 1, "leave": 3, "how": "clean"}]), "worker 3 is not in the run"),
        (with_(events=[{"at_s": 1, "leave": "nobody", "how": "clean"}]), "no worker is named"),
        (with_(events=[{"at_s": 1, "leave": 1.5, "how": "clean"}]), "'leave' must be a int or"),
        (with_(events=[{"at_s": 1, "lave": 1, "how": "clean"}]), "events[0]: unknown key 'lave'"),
        (with_(events=[{"at_s": 99, "leave": 0, "how": "clean"}]), "must be before 'budget_s'"),
        (
            with_(
                events=[
                    {"at_s": 2, "leave": 0, "how": "clean"},
                    {"at_s": 1, "leave": 1, "how": "clean"},
                ]
            ),
            "events must be in time order",
        ),
        (
            with_(
                events=[
                    {"at_s": 1, "leave": 0, "how": "crash"},
                    {"at_s": 2, "leave": 0, "how": "clean"},
                ]
            ),
            "events[1]: worker 0 is not in the run at 2 s",
        ),
        (
            with_(
                workers=[{"slowdown": 1}],
                events=[{"at_s": 1, "leave": 0, "how": "crash"}],
            ),
            "the last worker cannot leave",
        ),
        (with_(workers=[{"count": 2, "name": "a"}]), "'name' names one worker"),
        (with_(workers=[{"name": "a"}, {"name": "a"}]), "two workers have the same 'name'"),
        (with_(workers=[{"name": "7"}]), "'name' must be non-empty, not a number"),
        (
            with_(workers=[{"name": "a"}], events=[{"at_s": 1, "join": {"name": "a"}}]),
            "two workers are named 'a'",
        ),
        (
            with_(global_batch=3, events=[{"at_s": 1, "join": {}}]),
            "the most workers in the run at once (4)",
        ),
        (with_(heartbeat_timeout_s=0), "'heartbeat_timeout_s' must be > 0"),
    ],
)
def test_a_bad_scenario_is_refused_naming_the_key(raw: dict[str, Any], needle: str) -> None:
    with pytest.raises(ScenarioError) as err:
        from_mapping(raw, "bad.toml")
    assert needle in str(err.value) and str(err.value).startswith("bad.toml")


def test_events_join_and_leave_workers_by_index_or_name() -> None:
    sc = from_mapping(
        with_(
            budget_s=10,
            workers=[{"slowdown": 1.0, "count": 2}, {"slowdown": 4.0, "name": "slow"}],
            events=[
                {"at_s": 1, "leave": "slow", "how": "crash"},
                {"at_s": 2, "join": {"slowdown": 2.0, "latency_s": 0.01, "name": "late"}},
                {"at_s": 2, "join": {"stragglers": {"p": 0.1}}},
                {"at_s": 5, "leave": "late", "how": "clean"},
                {"at_s": 6, "leave": 0, "how": "clean"},
            ],
            shifts=[{"worker": 4, "slowdown": 3.0, "at_s": 3}],  # a joiner may shift too
        )
    )
    assert sc.n == 3  # the workers at the start
    assert sc.events == (
        Leave(1.0, 2, "crash"),
        Join(2.0, 3, WorkerSpec(slowdown=2.0, latency_s=0.01, name="late")),
        Join(2.0, 4, WorkerSpec(stragglers=Stragglers(p=0.1))),
        Leave(5.0, 3, "clean"),
        Leave(6.0, 0, "clean"),
    )
    assert [w.slowdown for w in sc.all_workers] == [1.0, 1.0, 4.0, 2.0, 1.0]
    assert sc.present_at(0.0) == [0, 1, 2]
    assert sc.present_at(1.0) == [0, 1]  # gone at its time
    assert sc.present_at(2.0) == [0, 1, 3, 4]  # both joiners in at theirs
    assert sc.present_at(9.0) == [1, 4]
    assert sc.peak_workers == 4
    assert sc.slowdown_at(4, 2.5) == 1.0 and sc.slowdown_at(4, 3.0) == 3.0
    assert sc.heartbeat_timeout_s == 30.0  # the default: what real mode has always used
    # a scenario without events is as before
    assert from_mapping(MINIMAL).events == () and from_mapping(MINIMAL).all_workers == (
        from_mapping(MINIMAL).workers
    )


def test_the_churn_scenarios_ship_in_the_package() -> None:
    churn, profile = load_scenario("churn"), load_scenario("churn_profile")
    s1 = load_scenario("S1")
    for sc in (churn, profile):
        assert sc.description and sc.events
        assert sc.workers[:4] == tuple(
            dataclasses.replace(w, name=ww.name)
            for w, ww in zip(s1.workers, sc.workers, strict=True)
        )
        assert sc.heartbeat_timeout_s < sc.budget_s
    assert any(isinstance(e, Leave) and e.how == "crash" for e in churn.events)
    assert any(isinstance(e, Join) for e in churn.events)
    joins = [e for e in profile.events if isinstance(e, Join)]
    assert len(joins) == 2 and all(e.at_s < 0.1 for e in joins)  # within the profile stage
    assert any(isinstance(e, Leave) and e.how == "clean" for e in profile.events)


def test_an_unknown_key_error_lists_the_valid_keys() -> None:
    with pytest.raises(ScenarioError, match=r"valid keys: .*bandwidth.*latency_s.*slowdown"):
        from_mapping(with_(workers=[{"bandwith": 1e6}]))


def test_file_errors_say_what_is_wrong(tmp_path: Path) -> None:
    with pytest.raises(ScenarioError, match=r"unknown scenario 'S9'.*S1, S2"):
        load_scenario("S9")
    broken = tmp_path / "broken.toml"
    broken.write_text("name = \n")
    with pytest.raises(ScenarioError, match=r"broken.toml is not valid TOML"):
        load_scenario(str(broken))
    with pytest.raises(ScenarioError, match="cannot read scenario"):
        load_scenario(str(tmp_path / "missing.toml"))


# --- policy specs -------------------------------------------------------------------------------


def test_policy_specs_parse_names_and_parameters() -> None:
    specs = parse_policies("bsp, ssp:staleness=3 ,asp:weight=0.25")
    assert specs == [
        PolicySpec("bsp"),
        PolicySpec("ssp", (("staleness", 3),)),
        PolicySpec("asp", (("weight", 0.25),)),
    ]
    assert [s.label for s in specs] == ["bsp", "ssp:staleness=3", "asp:weight=0.25"]
    both = PolicySpec("ssp", (("staleness", 2), ("weight", 0.5)))
    assert parse_policies("ssp:staleness=2;weight=0.5") == [both]
    assert parse_policies("ssp:staleness=2,weight=0.5") == [both]


@pytest.mark.parametrize(
    ("text", "error", "needle"),
    [
        ("bsp,nope", PolicyError, "unknown policy .nope.; known policies: .*bsp"),
        ("ssp:staleness=-1", PolicyError, "staleness must be an int >= 0"),
        ("ssp:stalenes=3", PolicyError, "unknown parameter"),
        ("staleness=3", ValueError, "before any policy name"),
        ("ssp:staleness", ValueError, "must look like key=value"),
        ("bsp,bsp", ValueError, "listed twice"),
        ("", ValueError, "no policies given"),
    ],
)
def test_bad_policy_specs_fail_before_any_run(text: str, error: type, needle: str) -> None:
    with pytest.raises(error, match=needle):
        parse_policies(text)


# --- results ---------------------------------------------------------------------------------


def run(policy: str, seed: int, tta: float | None, acc: float = 0.9) -> RunResult:
    return RunResult(
        policy, "S1", seed, 0.1, tta, acc, 100.0, {"0": 0.5}, 1.0, 2.0, 10, 20, 3, 4, [[0.0, acc]]
    )


def test_summary_medians_and_speedup_over_bsp() -> None:
    runs = [run("bsp", s, t) for s, t in enumerate([6.0, 8.0, 10.0])]
    runs += [run("asp", s, t) for s, t in enumerate([2.0, 4.0, None])]
    rows = summarize(runs, {"S1": 1.5})
    bsp, asp = rows
    assert (bsp["tta_median_s"], bsp["tta_iqr_s"], bsp["speedup_vs_bsp"]) == (8.0, 2.0, 1.0)
    assert asp["tta_median_s"] == 4.0 and asp["tta_iqr_s"] is None  # the never-reached seed
    assert asp["speedup_vs_bsp"] == 2.0 and asp["tta_ideal_s"] == 1.5
    doc = {"runs": [r.to_json() for r in runs], "summary": rows}
    check_results(json.loads(json.dumps(doc)))


def test_the_schema_check_names_what_is_wrong() -> None:
    good = {"runs": [run("bsp", 0, 1.0).to_json()], "summary": summarize([run("bsp", 0, 1.0)], {})}
    check_results(good)
    bad = json.loads(json.dumps(good))
    del bad["runs"][0]["bytes_up"]
    with pytest.raises(ValueError, match=r"runs\[0\] must have exactly keys"):
        check_results(bad)
    bad = json.loads(json.dumps(good))
    bad["summary"][0]["tta_median_s"] = "fast"
    with pytest.raises(ValueError, match=r"summary\[0\].tta_median_s"):
        check_results(bad)
    assert first_reach([[0.0, 0.5], [0.5, 0.91], [1.0, 0.95]], 0.9) == 0.5


def test_ideal_time_integrates_throughput_across_a_shift() -> None:
    from hetd.bench.sweep import throughput_at, time_for_samples

    sc: Scenario = from_mapping(
        with_(
            base_batch=10,
            base_step_s=1.0,
            budget_s=10.0,
            workers=[{"slowdown": 1.0}],
            shifts=[{"at_fraction": 0.5, "worker": 0, "slowdown": 2.0}],
        )
    )
    assert throughput_at(sc, 0.0) == 10.0 and throughput_at(sc, 5.0) == 5.0
    assert time_for_samples(sc, 30.0) == 3.0
    assert time_for_samples(sc, 75.0) == 10.0  # 50 samples by t=5, then 5/s
    # churn: a joiner adds its speed from its join, a leaver takes its own away
    churn: Scenario = from_mapping(
        with_(
            base_batch=10,
            base_step_s=1.0,
            budget_s=10.0,
            workers=[{"slowdown": 1.0}, {"slowdown": 1.0}],
            events=[
                {"at_s": 2.0, "leave": 1, "how": "crash"},
                {"at_s": 5.0, "join": {"slowdown": 0.5}},
            ],
        )
    )
    assert [throughput_at(churn, t) for t in (0.0, 2.0, 5.0)] == [20.0, 10.0, 30.0]
    assert time_for_samples(churn, 40.0 + 30.0 + 60.0) == 7.0
    strag = Stragglers(p=0.02, factor=5.0, mean_len=10.0)
    assert math.isclose(strag.mean_factor(), 1 + 4 * 0.2 / 1.18)


@pytest.mark.parametrize("command", ["bench", "sim"])
def test_the_help_lists_every_scenario_key(
    command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from hetd.cli.main import main
    from hetd.sim import scenario as scenario_mod

    with pytest.raises(SystemExit):
        main([command, "--help"])
    text = capsys.readouterr().out
    epilog = text.split("scenario files", 1)[1]
    for rules in (
        scenario_mod._TOP,
        scenario_mod._WORKER,
        scenario_mod._SHIFT,
        scenario_mod._EVENT,
    ):
        for key in rules:
            assert any(f in epilog for f in (f"\n    {key} (", f"{key} = {{", f"[[{key}]]")), key
    for key in scenario_mod._STRAGGLERS:
        assert f"\n      {key} (" in epilog, key
