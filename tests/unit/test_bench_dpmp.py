"""``hetd bench --suite dpmp``: the scenarios and the budget run over seeds, judged against the
targets, through the real command line (short runs: few rounds)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hetd.bench.dpmp import DpmpOptions, run_dpmp
from hetd.cli.bench import main
from hetd.sim.dpmp import SCENARIOS, compare


@pytest.mark.slow  # the whole dpmp suite, every scenario and seed: `make test` runs it, `make test-fast` does not
def test_the_suite_writes_every_scenario_and_target(tmp_path: Path) -> None:
    opts = DpmpOptions(
        out=tmp_path,
        seeds=2,
        rounds=26,
        from_round=20,
        budget_rounds=400,
        sweep=(1.0, 10.0),
        engine=False,  # the pipeline simulator's column (the engine's: test_dpmp_engine.py)
    )
    doc = run_dpmp(opts)
    assert json.loads((tmp_path / "dpmp.json").read_text()) == doc
    assert (tmp_path / "dpmp_budget.png").stat().st_size > 0
    assert set(doc["scenarios"]) == {"B", "C", "D", "E"}
    for s in doc["scenarios"].values():
        assert [r["seed"] for r in s["seeds"]] == [0, 1]
        assert s["dpmp_s"] <= 1.05 * s["lbbsp_s"]
    b = doc["scenarios"]["B"]
    assert b["reduction"] == pytest.approx(1 - b["dpmp_s"] / b["lbbsp_s"], abs=0.02)
    assert [r["v"] for r in doc["budget"]["sweep"]] == [1.0, 10.0]
    assert [t["pass"] for t in doc["targets"]] == [True] * 6
    assert doc["verdict"] == "pass"
    md = (tmp_path / "dpmp.md").read_text()
    assert "| B main |" in md and "Verdict: pass." in md
    assert "not run: --mode real" in md  # the three columns, the engine's and real's empty


def test_a_missed_target_is_reported(tmp_path: Path) -> None:
    # 5 budget rounds are too few for the time-average cost to reach the budget
    doc = run_dpmp(
        DpmpOptions(
            out=tmp_path,
            seeds=1,
            rounds=21,
            from_round=20,
            budget_rounds=5,
            sweep=(),
            engine=False,
        )
    )
    budget = doc["targets"][-1]
    assert budget["target"].startswith("budget") and not budget["pass"]
    assert doc["verdict"] == "miss"
    assert "| miss |" in (tmp_path / "dpmp.md").read_text()


def test_the_median_starts_at_from_round() -> None:
    with pytest.raises(ValueError, match="from_round"):
        compare(SCENARIOS["E"], rounds=20, from_round=20)
    early = compare(SCENARIOS["B"], rounds=21, seed=0, from_round=0)
    late = compare(SCENARIOS["B"], rounds=21, seed=0, from_round=20)
    assert late.dpmp != early.dpmp  # one round's jitter, not the median of 21


def test_the_command_line_refuses_no_seeds(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--suite", "dpmp", "--seeds", "0", "--out", "/nonexistent/x"]) == 2
    assert "--seeds must be >= 1" in capsys.readouterr().err


def test_real_mode_starts_the_memory_poor_workers_at_t0() -> None:
    """A worker whose ``memory`` cannot hold a whole-model step would fail one in the bsp
    warm-up (``--emulate-memory`` is enforced): real mode starts it as a joiner at t = 0, the
    others as usual; a worker that fits, or reports no memory, is not one."""
    import jax

    from hetd.bench.real import _worker_args, memory_poor
    from hetd.sim.scenario import load_scenario
    from hetd.zoo.blocks import mlp_model

    def shapes(hidden: list[int]) -> dict[str, tuple[int, ...]]:
        tree = jax.eval_shape(
            lambda: mlp_model(10, hidden=tuple(hidden)).init(jax.random.PRNGKey(0), (784,))
        )
        return {k: tuple(v.shape) for k, v in tree.items()}

    b, d = load_scenario("B"), load_scenario("D")
    big = shapes(b.model_kwargs["hidden"])
    assert memory_poor(b, big) == {3, 4}
    assert memory_poor(d, big) == {i for i, w in enumerate(d.workers) if w.memory is not None}
    assert memory_poor(b, shapes([64])) == set()  # a model small enough: everyone fits
    args = _worker_args(b, 3, 0, late=True)
    assert args[args.index("--emulate-join-at") + 1] == "0.0"
    assert "--emulate-memory" in args
    assert "--emulate-join-at" not in _worker_args(b, 0, 0)
