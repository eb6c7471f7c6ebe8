"""Inner and outer optimizers: a local-step policy trains under Adam because its workers take
Adam steps (not SGD at Adam's learning rate), in the simulator and with real worker processes."""

from __future__ import annotations

from typing import Any

import pytest

from hetd.bench.real import run_real
from hetd.sim.loop import run_sim
from hetd.sim.results import PolicySpec
from hetd.sim.scenario import Scenario, from_mapping

ADAM_DIGITS: dict[str, Any] = {
    "name": "adam-digits",
    "dataset": "digits",
    "model": "mlp",
    "model_kwargs": {"hidden": [32]},
    "global_batch": 64,
    "base_batch": 32,
    "base_step_s": 0.01,
    "target_accuracy": 0.9,
    "budget_s": 6.0,
    "eval_interval_s": 0.25,
    "lr": 0.003,
    "optimizer": "adam",
    "workers": [{"slowdown": 1.0}, {"slowdown": 2.0}],
}


def _scenario(**changes: Any) -> Scenario:
    return from_mapping({**ADAM_DIGITS, **changes})


def test_adsp_under_adam_reaches_the_target_with_adam_local_steps_and_not_with_sgd() -> None:
    adam = run_sim(_scenario(), PolicySpec("adsp"), 0).result
    sgd = run_sim(_scenario(inner_optimizer="sgd"), PolicySpec("adsp"), 0).result
    assert adam.tta_s is not None  # the default inner optimizer follows [train] optimizer
    assert sgd.tta_s is None and sgd.final_accuracy < 0.9  # SGD at Adam's lr barely moves


def test_a_nesterov_outer_optimizer_trains_and_keeps_its_state() -> None:
    # Asynchronous single-worker deltas through momentum 0.9 overshoot (DiLoCo's Nesterov is
    # meant for averaged rounds), so this asks for learning, not for the target.
    outer = "nesterov:lr=0.7,momentum=0.9"
    run = run_sim(_scenario(outer_optimizer=outer), PolicySpec("adsp"), 0)
    assert run.result.final_accuracy > 0.5  # chance is 0.1
    _, opt_state, _ = run.engine.store.state()
    assert set(opt_state) == {"grad", "outer"}  # both optimizers' states are checkpointed


@pytest.mark.slow
def test_real_workers_take_adam_local_steps_and_reach_the_target() -> None:
    sc = _scenario(budget_s=8.0)
    result = run_real(sc, PolicySpec("adsp"), 0, sc.lr, lambda t: None)
    assert result.tta_s is not None, f"final accuracy {result.final_accuracy:.3f}"
