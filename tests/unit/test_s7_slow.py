"""S7_slow is S7 with every emulated time six times longer (docs/benchmark.md): the same model,
data, batches, learning rates and target, each step and each link six times slower, so every
ratio of communication to compute is S7's and real mode can follow it on a small host."""

from __future__ import annotations

import pytest

from hetd.sim.scenario import load_scenario

K = 6.0


def test_s7_slow_is_s7_six_times_slower() -> None:
    fast, slow = load_scenario("S7"), load_scenario("S7_slow")
    same = ("dataset", "dataset_kwargs", "model", "model_kwargs", "global_batch", "base_batch")
    same += ("target_loss", "lr", "lr_grid", "optimizer")
    assert {k: getattr(slow, k) for k in same} == {k: getattr(fast, k) for k in same}
    assert slow.base_step_s == pytest.approx(K * fast.base_step_s)
    assert slow.eval_interval_s == pytest.approx(K * fast.eval_interval_s)
    assert slow.budget_s == pytest.approx(K * fast.budget_s)
    assert [w.slowdown for w in slow.workers] == [w.slowdown for w in fast.workers]
    for f, s in zip(fast.workers, slow.workers, strict=True):
        assert s.bandwidth == pytest.approx(f.bandwidth / K)
        assert s.latency_s == pytest.approx(K * f.latency_s)
