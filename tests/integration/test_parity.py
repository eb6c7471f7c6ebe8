"""``hetd bench --suite parity`` end to end: a tiny scenario in sim mode and with real worker
processes, through the CLI entry; the files a user opens exist and agree with each other."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hetd.cli.bench import main

pytestmark = pytest.mark.slow  # a real daemon on loopback (and real worker processes)

TINY = """
name = "tiny-parity"
dataset = "digits"
model = "mlp"
model_kwargs = { hidden = [32] }
global_batch = 64
base_batch = 32
base_step_s = 0.01
target_accuracy = 0.8
budget_s = 3.0
eval_interval_s = 0.25
lr = 0.2

[[workers]]
slowdown = 1.0

[[workers]]
slowdown = 2.0
"""

PNG = b"\x89PNG\r\n\x1a\n"


def test_parity_suite_runs_both_modes_and_compares(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    scenario = tmp_path / "tiny.toml"
    scenario.write_text(TINY)
    out = tmp_path / "parity"
    args = ["bench", "--suite", "parity", "--scenario", str(scenario), "--out", str(out)]
    assert main([*args, "--policies", "bsp,asp", "--seeds", "1", "--quiet"]) == 0

    for mode in ("sim", "real"):
        results = json.loads((out / mode / "results.json").read_text())
        assert [(r["policy"], r["seed"]) for r in results["runs"]] == [("bsp", 0), ("asp", 0)]
        assert (out / mode / "summary.md").exists()
    doc = json.loads((out / "parity.json").read_text())
    policies = doc["policies"]
    assert list(policies) == ["bsp", "asp"]
    for mode in ("sim", "real"):
        assert sorted(p["rank"][mode] for p in policies.values()) == [1, 2]
        for p in policies.values():
            assert len(p[mode]["tta_s"]) == 1
            assert p[mode]["tta_median_s"] is not None  # the target is easy
    for p in policies.values():
        assert p["ratio"] == pytest.approx(p["real"]["tta_median_s"] / p["sim"]["tta_median_s"])
    assert policies["bsp"]["sim"]["speedup_vs_bsp"] == 1.0
    v = doc["verdict"]
    assert (v["scenario"], v["budget_s"], v["seeds"]) == ("tiny-parity", 3.0, 1)
    assert isinstance(v["ranking_agrees"], bool) and v["rank_distance"] in (0, 1)
    assert v["largest_ratio"]["ratio"] == max(p["ratio"] for p in policies.values())

    md = (out / "parity.md").read_text()
    assert "| bsp |" in md and "| asp |" in md and v["sentence"] in md
    assert (out / "parity.png").read_bytes()[:8] == PNG
    stdout = capsys.readouterr().out
    assert "parity: 2 policies x 1 seed(s)" in stdout and v["sentence"] in stdout
