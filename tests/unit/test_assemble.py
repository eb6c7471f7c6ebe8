"""One engine from one spec (hetd.core.assemble): the outer optimizer a policy runs with, a task's
own optimizers, the welcome the simulator tells its workers, the settings kept as given."""

from __future__ import annotations

import numpy as np
import optax

from hetd import config as config_mod
from hetd.core.assemble import EngineSpec, Optimizers, assemble, worker_setup
from hetd.core.entries import EngineConfig
from hetd.core.store import Store
from policies.diloco import PLAIN_OUTER, SYNC_OUTER

PARAMS = {"w": np.zeros(3, np.float32)}


def test_the_outer_optimizer_follows_the_policy_at_the_start_and_after_a_swap() -> None:
    parts = assemble(EngineSpec(PARAMS, "diloco", optimizers=Optimizers("sgd", 0.1)))
    assert parts.store.outer_spec == SYNC_OUTER  # DiLoCo's Nesterov over an SGD inner optimizer
    assert parts.policy.name == "diloco"
    outer_for = parts.config.outer_for
    assert outer_for is not None
    assert outer_for("asp", {}) == PLAIN_OUTER  # a swap to asp averages deltas again
    adam = assemble(EngineSpec(PARAMS, "diloco", optimizers=Optimizers("adam", 0.001)))
    assert adam.store.outer_spec == PLAIN_OUTER  # adaptive inner optimizer: plain averaging


def test_a_tasks_own_optimizers_step_once_per_update_and_survive_swaps() -> None:
    own = EngineSpec(
        PARAMS,
        "diloco",
        task_optimizer=optax.adam(1e-3),
        task_outer=optax.sgd(0.5),
    )
    parts = assemble(own)
    assert parts.store.step_each  # its schedule counts applied updates
    assert parts.store.outer_spec == "custom"
    outer_for = parts.config.outer_for
    assert outer_for is not None and outer_for("asp", {}) == "custom"
    plain = assemble(EngineSpec(PARAMS, "asp"))
    assert not plain.store.step_each


def test_settings_are_kept_and_the_welcome_and_store_type_are_the_specs() -> None:
    class Noting(Store):
        pass

    welcome = {"model": {"spec": "mlp", "kwargs": {}}}
    settings = EngineConfig(codec="int8", profile_steps=0, welcome={"stale": True})
    parts = assemble(
        EngineSpec(PARAMS, "asp", welcome=welcome, settings=settings, store_type=Noting)
    )
    assert isinstance(parts.store, Noting)
    assert parts.config.welcome == welcome
    assert (parts.config.codec, parts.config.profile_steps) == ("int8", 0)
    engine = parts.engine()
    assert engine.store is parts.store and engine.config is parts.config


def test_the_simulators_welcome_is_the_one_a_daemon_gives_for_the_same_training() -> None:
    cfg = config_mod.replace(
        config_mod.Config(),
        "train",
        model="mlp",
        model_kwargs={"hidden": [32]},
        dataset="digits",
        seed=7,
        lr=0.05,
        worker_lr=0.2,
        inner_optimizer="momentum",
        micro_batch=16,
    )
    t = cfg.train
    ours = worker_setup(
        t.model,
        t.dataset,
        t.seed,
        Optimizers.of(t),
        micro_batch=t.micro_batch,
        model_kwargs=t.model_kwargs,
        dataset_kwargs=t.dataset_kwargs,
    )
    assert ours == config_mod.worker_setup(cfg)
