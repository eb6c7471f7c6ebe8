"""Bytes to target (issue 16): read off the bytes marks at the TTA, in results.json, summarized
over seeds, and drawn against TTA in ``pareto.png``."""

from __future__ import annotations

import json
from pathlib import Path

from hetd.bench.plots import plot_pareto, summary_markdown
from hetd.sim.results import RunResult, bytes_at, check_results, summarize
from hetd.sim.scenario import load_scenario


def run(policy: str, seed: int, tta: float | None, marks: list[list[float]]) -> RunResult:
    return RunResult(
        policy, "S1", seed, 0.1, tta, 0.9, 100.0, {"0": 0.5}, 1.0, 2.0, 10, 20, 3, 4,
        [[0.0, 0.1], [1.0, 0.95]], bytes_curve=marks,
    )  # fmt: skip


def test_bytes_at_interpolates_between_marks() -> None:
    marks = [[0.5, 100.0], [1.0, 300.0], [1.5, 400.0]]
    assert bytes_at(marks, None) is None
    assert bytes_at([], 1.0) is None
    assert bytes_at(marks, 0.2) == 100.0  # before the first mark: the first
    assert bytes_at(marks, 1.0) == 300.0
    assert bytes_at(marks, 0.75) == 200.0
    assert bytes_at(marks, 9.0) == 400.0


def test_bytes_to_target_in_results_and_summary(tmp_path: Path) -> None:
    marks = [[0.5, 1e6], [1.0, 3e6], [2.0, 5e6]]
    runs = [run("bsp", 0, 1.0, marks), run("bsp", 1, 2.0, marks), run("bsp", 2, None, marks)]
    runs += [run("diloco", 0, 0.5, marks), run("diloco", 1, 0.5, [])]  # not recorded: None
    assert [r.bytes_to_target for r in runs] == [3_000_000, 5_000_000, None, 1_000_000, None]
    rows = summarize(runs, {"S1": 0.4})
    assert rows[0]["bytes_to_target_median"] == 5e6  # the never-reached seed counts as infinite
    assert rows[1]["bytes_to_target_median"] is None  # median of 1 MB and "infinite"
    doc = json.loads(json.dumps({"runs": [r.to_json() for r in runs], "summary": rows}))
    check_results(doc)
    assert doc["runs"][0]["bytes_to_target"] == 3_000_000
    sc = load_scenario("S1")
    text = summary_markdown(doc, sc, "sim")
    assert "MB to target" in text and "| 5.0 |" in text
    plot_pareto(tmp_path / "pareto.png", runs, sc)
    assert (tmp_path / "pareto.png").stat().st_size > 1000
