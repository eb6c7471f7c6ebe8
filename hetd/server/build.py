"""Building a daemon's engine from a config: the data set, the model, the store with its
optimizers, the policy and the evaluator.

JAX, flax, optax and the data set are imported inside the functions, so the daemon imports this
module before its sockets listen and builds the engine behind them (:mod:`hetd.server.daemon`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from hetd import config as config_mod

if TYPE_CHECKING:  # the heavy modules (JAX, flax, optax) load when the engine is built
    from hetd.core.engine import Clock, Engine
    from hetd.core.store import Snapshot
    from hetd.zoo.data import Dataset
    from hetd.zoo.models import Model


def make_evaluator(model: Model, data: Dataset) -> Callable[[Snapshot], tuple[float, float]]:
    """(loss, accuracy) of a parameter snapshot on the test set, jitted once."""
    import jax
    import jax.numpy as jnp

    x = jnp.asarray(data.x_test)
    y = jnp.asarray(data.y_test)

    @jax.jit
    def metrics(params: dict[str, jax.Array]) -> tuple[jax.Array, jax.Array]:
        return model.loss(params, x, y), model.accuracy(params, x, y)

    def evaluate(snap: Snapshot) -> tuple[float, float]:
        loss, acc = metrics({k: jnp.asarray(v) for k, v in snap.tensors.items()})
        return float(loss), float(acc)

    return evaluate


def build_engine(cfg: config_mod.Config, clock: Clock | None = None) -> Engine:
    """Model, data, store, policy and engine from a config."""
    import jax

    from hetd.core.engine import Engine, EngineConfig
    from hetd.core.store import Store, make_optimizer, make_outer
    from hetd.zoo.data import load_dataset
    from hetd.zoo.models import get_model
    from policies import make_policy

    t = cfg.train
    data = load_dataset(t.dataset, seed=t.seed, **dict(t.dataset_kwargs))
    model = get_model(t.model, data.num_classes, **dict(t.model_kwargs))
    # One jitted init compiles once; flax's eager init compiles op by op (~2x slower start-up).
    params = jax.jit(model.init, static_argnums=1)(jax.random.PRNGKey(t.seed), data.input_shape)
    workers = max(1, t.global_batch // max(1, t.batch_size))

    def outer_for(name: str, policy_params: Mapping[str, Any]) -> str:
        """The outer optimizer policy ``name`` runs with (outer_optimizer "auto": the policy's;
        delayed Nesterov's period is the workers the configuration's batches describe, as
        ``global_batch / batch_size``): at start, and for a policy swapped in later."""
        return config_mod.optimizers(
            t.optimizer,
            t.lr,
            t.inner_optimizer,
            t.worker_lr,
            t.outer_optimizer,
            name,
            policy_params,
            workers,
        )[2]

    daemon_opt = config_mod.optimizers(
        t.optimizer, t.lr, t.inner_optimizer, t.worker_lr, t.outer_optimizer
    )[0]
    outer_opt = outer_for(cfg.policy.name, cfg.policy.params)
    store = Store(
        params, make_optimizer(daemon_opt), outer=make_outer(outer_opt), outer_spec=outer_opt
    )
    policy = make_policy(cfg.policy.name, cfg.policy.params)
    econf = EngineConfig(
        global_batch=t.global_batch,
        batch_size=t.batch_size,
        codec=t.codec,
        downlink=t.downlink,
        heartbeat_s=cfg.server.heartbeat_s,
        heartbeat_timeout_s=cfg.server.heartbeat_timeout_s,
        eval_interval_s=t.eval_interval_s,
        max_staleness=t.max_staleness_drop,
        guard_factor=t.guard_factor,
        guard_warmup=t.guard_warmup,
        profile_steps=t.profile_steps,
        shards=t.shards,
        welcome=config_mod.worker_setup(cfg),
        outer_for=outer_for,
    )
    return Engine(store, policy, econf, clock=clock, evaluator=make_evaluator(model, data))
