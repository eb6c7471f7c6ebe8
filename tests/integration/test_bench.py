"""``hetd bench`` and ``hetd sim`` from the command line: the files a user opens, in the schema of
issue 3, in both modes (``--mode real`` with real worker processes)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

import pytest

from hetd.bench import real as real_mod
from hetd.bench.kept import KeptSnapshots
from hetd.cli.bench import main
from hetd.core.store import Snapshot
from hetd.server.build import make_task_evaluator
from hetd.sim.results import RUN_KEYS, SUMMARY_KEYS, check_results
from hetd.zoo.bundled import ZooTask
from hetd.zoo.data import load_dataset
from hetd.zoo.models import get_model
from hetd.zoo.task import Bound

TINY = """
name = "tiny"
dataset = "digits"
model = "mlp"
model_kwargs = { hidden = [32] }
global_batch = 64
base_batch = 32
base_step_s = 0.01
target_accuracy = 0.8
budget_s = BUDGET
eval_interval_s = 0.25
lr = 0.2
lr_grid = [0.02, 0.3]

[[workers]]
slowdown = 1.0

[[workers]]
slowdown = 3.0
"""

PNG = b"\x89PNG\r\n\x1a\n"


def scenario(tmp_path: Path, budget: float) -> str:
    path = tmp_path / f"tiny-{budget:g}.toml"
    path.write_text(TINY.replace("BUDGET", repr(budget)))
    return str(path)


def outputs(out: Path) -> dict[str, Any]:
    """The four files a user opens exist and are what they claim; returns results.json."""
    for name in ("accuracy.png", "timeline.png", "batch_shares.png"):
        assert (out / name).read_bytes()[:8] == PNG, name
    doc = json.loads((out / "results.json").read_text())
    check_results(doc)
    real = {"links", "evals"}  # real mode only
    assert all(set(r) - real == set(RUN_KEYS) for r in doc["runs"])
    assert all(set(r) == set(SUMMARY_KEYS) for r in doc["summary"])
    md = (out / "summary.md").read_text()
    for row in doc["summary"]:
        assert f"| {row['policy']} |" in md
    result: dict[str, Any] = doc
    return result


def test_bench_sim_writes_results_summary_and_plots(tmp_path: Path) -> None:
    out = tmp_path / "out"
    args = ["bench", "--scenario", scenario(tmp_path, 1.5), "--out", str(out), "--quiet"]
    assert main([*args, "--policies", "bsp,ssp:staleness=1", "--seeds", "2"]) == 0
    doc = outputs(out)
    runs = doc["runs"]
    assert [(r["policy"], r["seed"]) for r in runs] == [
        ("bsp", 0),
        ("bsp", 1),
        ("ssp:staleness=1", 0),
        ("ssp:staleness=1", 1),
    ]
    for r in runs:
        assert r["scenario"] == "tiny" and r["lr"] == 0.2
        assert set(r["idle_fraction"]) == {"0", "1"}
        assert r["curve"][0][0] == 0.0 and r["curve"][-1][0] == 1.5
        assert r["bytes_up"] > 0 and r["bytes_down"] > 0 and r["samples_per_s"] > 0
        assert r["pushes"] > 0 and r["releases"] > 0
    bsp = doc["summary"][0]
    assert bsp["policy"] == "bsp" and bsp["speedup_vs_bsp"] == 1.0
    assert bsp["tta_ideal_s"] is not None and bsp["tta_ideal_s"] < bsp["tta_median_s"]


def test_tune_lr_picks_per_policy_on_seed_0_and_freezes_it(tmp_path: Path) -> None:
    out = tmp_path / "out"
    args = ["bench", "--scenario", scenario(tmp_path, 1.0), "--out", str(out), "--quiet"]
    assert main([*args, "--policies", "asp", "--seeds", "2", "--tune-lr"]) == 0
    runs = outputs(out)["runs"]
    assert len(runs) == 2
    assert runs[0]["lr"] == runs[1]["lr"] == 0.3  # 0.02 is far too small to reach 0.8 in 1 s


def test_sim_command_writes_one_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "one"
    code = main(
        [
            "sim",
            "--scenario",
            scenario(tmp_path, 1.0),
            "--policy",
            "asp",
            "--seed",
            "1",
            "--out",
            str(out),
            "--quiet",
        ]
    )
    assert code == 0
    assert "tiny asp seed 1: target 0.8 reached at" in capsys.readouterr().out
    doc = outputs(out)
    assert [r["seed"] for r in doc["runs"]] == [1]


def test_bad_policy_is_refused_before_running(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "never"
    args = ["bench", "--scenario", scenario(tmp_path, 1.0), "--out", str(out)]
    assert main([*args, "--policies", "bsp,nosuch"]) == 2
    assert "unknown policy 'nosuch'" in capsys.readouterr().err
    assert not out.exists()
    assert main([*args, "--policies", "bsp", "--evals", "live"]) == 2  # sim evaluates in no thread
    assert "--evals is for real runs" in capsys.readouterr().err
    assert not out.exists()


class CheckedKeeper(KeptSnapshots):
    """The real bench's keeper of deferred evaluations that also evaluates each snapshot when it
    is kept (on the engine's task), with an evaluator of the scenario's own model and test set,
    and remembers what the deferred evaluation gave for it."""

    made: ClassVar[list[CheckedKeeper]] = []

    def __init__(self, cap_bytes: int, threaded: bool = False) -> None:
        super().__init__(0, threaded=threaded)  # every copy through the disk, the cap's path
        self.live: list[tuple[float, float, float]] = []
        self.deferred: list[tuple[float, float, float]] = []
        data = load_dataset("digits", seed=0)
        task = ZooTask(get_model("mlp", data.num_classes, hidden=[32]), data, 0)
        self.evaluator = make_task_evaluator(Bound(task), check=False)
        CheckedKeeper.made.append(self)

    def __call__(self, snap: Snapshot, taken: float) -> None:
        assert self._pool is not None  # the bench copies in the keeper's thread
        self.live.append((taken, *self.evaluator(snap)))
        super().__call__(snap, taken)

    def evaluate(
        self, evaluator: Callable[[Snapshot], tuple[float, float]]
    ) -> list[tuple[float, float, float]]:
        self.deferred = super().evaluate(evaluator)
        return self.deferred


@pytest.mark.slow
def test_bench_real_mode_with_two_worker_processes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(real_mod, "KeptSnapshots", CheckedKeeper)
    out = tmp_path / "real"
    args = ["bench", "--mode", "real", "--scenario", scenario(tmp_path, 8.0), "--out", str(out)]
    assert main([*args, "--policies", "asp", "--seeds", "1", "--quiet"]) == 0
    doc = outputs(out)
    (run,) = doc["runs"]
    assert run["policy"] == "asp" and run["curve"][-1][0] == 8.0
    assert run["links"] == {"kind": "emulated"}
    # deferred by default: the snapshots kept on the grid (t = 0, every 0.25 s, the budget's end)
    # evaluate after the run to what they evaluated to when kept, and make the curve
    assert run["evals"] == "deferred" and "evaluations deferred" in (out / "summary.md").read_text()
    (keeper,) = CheckedKeeper.made
    # Most of the grid's 33 points: the check's own live evaluation runs on the engine's task, and
    # its first call compiles (a second or more, with the grid's points meanwhile skipped).
    assert keeper.deferred == keeper.live and len(keeper.live) >= 8.0 / 0.25 / 2
    start = keeper.deferred[0][0]  # t = 0's parameters are kept first; later ones are not used
    used = [[t - start, acc] for t, _, acc in keeper.deferred if t - start <= 8.0]
    assert run["curve"] == used
    assert set(run["idle_fraction"]) == {"0", "1"}
    # the budget less the compute each worker reported: asp keeps both computing most of it
    assert all(0.0 <= v < 0.9 for v in run["idle_fraction"].values()), run["idle_fraction"]
    assert run["samples_per_s"] > 0 and run["bytes_up"] > 0
    assert run["final_accuracy"] > run["curve"][0][1]  # real workers trained the model
    if run["tta_s"] is not None:  # bytes to target: what moved until then, never more than all
        assert 0 < run["bytes_to_target"] <= run["bytes_up"] + run["bytes_down"]
    else:
        assert run["bytes_to_target"] is None
