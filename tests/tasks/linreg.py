"""A small regression Task for the tests: a linear model with a 0-d bias and a list of weights,
AdamW with a mask over the user's own structure, warm-up and cosine, metrics mse and r2.

``HETD_TEST_TASK_VARIANT`` changes it the ways a test needs: ``wide`` (another version: a
parameter more, same name), ``bad_data`` (train_data raises after a few batches), ``nan_eval``
(the eval metric is NaN)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from hetd import Shard, Task

VARIANT = os.environ.get("HETD_TEST_TASK_VARIANT", "")
_rng = np.random.default_rng(0)
X = _rng.normal(size=(1024, 6)).astype(np.float32)
Y = (X @ np.linspace(-1.0, 1.0, 6).astype(np.float32) + 0.5).astype(np.float32)


def init(key: jax.Array) -> Any:
    params: dict[str, Any] = {"w": [jnp.zeros(3), jnp.zeros(3)], "b": jnp.zeros(())}
    if VARIANT == "wide":
        params["extra"] = jnp.zeros(2)
    return params


def loss(params: Any, batch: dict[str, jax.Array], key: jax.Array) -> Any:
    w = jnp.concatenate(params["w"])
    pred = batch["x"] @ w + params["b"]
    mse = jnp.mean((pred - batch["y"]) ** 2)
    r2 = 1.0 - mse / jnp.var(batch["y"])
    if VARIANT == "nan_eval":
        r2 = r2 * jnp.nan
    return mse, {"mse": mse, "r2": r2}


def train_data(shard: Shard) -> Iterator[dict[str, np.ndarray]]:
    rows = np.array(shard.slice(len(X)))
    np.random.default_rng([shard.seed, shard.index, shard.epoch]).shuffle(rows)
    for n, i in enumerate(range(0, len(rows) - shard.batch_size + 1, shard.batch_size)):
        if VARIANT == "bad_data" and n == 5:
            raise OSError("the data disk went away")
        r = rows[i : i + shard.batch_size]
        yield {"x": X[r], "y": Y[r]}


def eval_data() -> Iterator[dict[str, np.ndarray]]:
    for i in range(0, 512, 128):
        yield {"x": X[i : i + 128], "y": Y[i : i + 128]}


schedule = optax.warmup_cosine_decay_schedule(0.0, 0.05, 20, 3000)
optimizer = optax.chain(
    optax.clip_by_global_norm(1.0),
    # decay the weights, not the bias: a mask written for this task's own tree
    optax.adamw(schedule, weight_decay=1e-4, mask={"w": [True, True], "b": False}),
)
task = Task(
    init,
    loss,
    train_data,
    eval_data,
    optimizer=None if VARIANT == "wide" else optimizer,
    target={"metric": "r2", "mode": "max", "value": 0.98},
    name="linreg",
)
