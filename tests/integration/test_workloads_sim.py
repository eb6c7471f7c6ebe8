"""The transformer workload in the simulator with a loss target: a tiny byte-level LM trains on
the ``pydoc`` text through the real engine, and its TTA falls between evaluations (interpolated),
not on the evaluation grid."""

from __future__ import annotations

import math

from hetd.sim.loop import run_sim
from hetd.sim.results import PolicySpec
from hetd.sim.scenario import from_mapping

TINY_LM = {
    "name": "tiny_lm",
    "dataset": "pydoc",
    "dataset_kwargs": {"context": 32, "max_bytes": 60_000},
    "model": "transformer",
    "model_kwargs": {"d_model": 32, "layers": 1, "heads": 2},
    "global_batch": 16,
    "base_batch": 8,
    "base_step_s": 0.01,
    "target_loss": 4.0,
    "budget_s": 1.5,
    "eval_interval_s": 0.25,
    "lr": 0.01,
    "optimizer": "adam",
    "workers": [{"slowdown": 1.0}, {"slowdown": 2.0, "bandwidth": 1e7, "latency_s": 0.02}],
}


def test_a_transformer_reaches_a_loss_target_between_evaluations() -> None:
    sc = from_mapping(TINY_LM)
    run = run_sim(sc, PolicySpec("asp", ()), seed=0)
    r, evals = run.result, run.engine.evaluations.evals
    assert evals[0][1] > math.log(256) - 0.5  # starts near 8 bits per byte
    assert evals[-1][1] < sc.target_loss  # it learned the text
    assert r.tta_s is not None
    before = [e for e in evals if e[1] > sc.target_loss and e[0] < r.tta_s]
    after = next(e for e in evals if e[1] <= sc.target_loss)
    assert before[-1][0] < r.tta_s <= after[0]  # between the two evaluations around the crossing
    assert r.bytes_to_target is not None and 0 < r.bytes_to_target <= r.bytes_up + r.bytes_down
