"""``hetd bench --suite auto`` through the command line: a short simulated sweep of two fixed
policies and auto on S1, judged and written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hetd.cli.bench import main
from hetd.sim.results import check_results


@pytest.mark.slow  # three short simulated sweeps: `make test` runs it, `make test-fast` does not
def test_the_suite_runs_fixed_policies_and_auto_and_writes_the_verdict(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["bench", "--suite", "auto", "--scenarios", "S1", "--seeds", "1", "--quiet"]
    argv += ["--policies", "bsp,ashl", "--budget", "8", "--out", str(tmp_path)]
    code = main(argv)
    doc = json.loads((tmp_path / "auto.json").read_text())
    assert code == (0 if doc["verdict"]["pass"] else 1)
    (row,) = doc["scenarios"]
    assert row["scenario"] == "S1" and row["budget_s"] == 8.0 and row["plan_every_s"] == 0.8
    assert row["auto"] == 'auto:candidates="bsp,ashl";dwell_s=0.8;start="bsp"'
    assert set(row["policies"]) == {"bsp", "ashl", row["auto"]}
    # auto starts on bsp; each switch it made is recorded with its reason, between the two
    for s in row["switches"]["0"]:
        assert {s["from"], s["to"]} == {"bsp", "ashl"} and s["why"]
    results = json.loads((tmp_path / "S1" / "results.json").read_text())
    check_results(results)
    assert {r["policy"] for r in results["runs"]} == set(row["policies"])
    out = capsys.readouterr().out
    assert "| S1 | 0.8 s |" in out and ("Verdict: pass." in out or "Verdict: miss." in out)
    assert (tmp_path / "auto.md").read_text().strip() in out
