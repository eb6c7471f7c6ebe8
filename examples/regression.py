"""Regression in plain JAX: a small MLP predicting disease progression (scikit-learn's diabetes
data), no flax.

What it shows:

* a Task written directly as ``init(key) -> params`` (a dict of arrays) and
  ``loss(params, batch, key) -> (loss, metrics)``: any pytree of float arrays is a model.
* a regression target: the loss is the mean squared error on standardised targets; the metrics
  are ``mse`` in the data's own units and ``r2``, the coefficient of determination on the batch.
  ``eval_data`` is the whole test set as one batch, so ``r2`` is the test set's R² exactly (the
  daemon averages eval batches' metrics by size; R² of several batches would not be their mean).
* standardisation with the training rows' statistics only, computed the same in every process.

The split is fixed: the last 88 rows are the test set, the first 354 the training set. Least
squares reaches a test R² of 0.55 on it; the target is 0.5. Train it::

    hetd serve --task examples/regression.py:task
    hetd-worker ws://127.0.0.1:7070 --task examples/regression.py:task   # twice
"""

from __future__ import annotations

import functools
from collections.abc import Iterator

import jax
import jax.numpy as jnp
import numpy as np
import optax

from hetd import Shard, Task

TEST_SIZE = 88
HIDDEN = 32

Split = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, float]


@functools.cache
def split() -> Split:
    """``(x_train, y_train, x_test, y_test, y_scale)``: features standardised and targets
    standardised with the training rows' means and deviations; ``y_scale`` turns a standardised
    error back into the data's units."""
    from sklearn.datasets import load_diabetes

    x, y = load_diabetes(return_X_y=True)
    train, test = np.arange(len(x) - TEST_SIZE), np.arange(len(x) - TEST_SIZE, len(x))
    mu, sd = x[train].mean(0), x[train].std(0)
    y_mu, y_sd = y[train].mean(), y[train].std()

    def features(rows: np.ndarray) -> np.ndarray:
        return ((x[rows] - mu) / sd).astype(np.float32)

    def targets(rows: np.ndarray) -> np.ndarray:
        return ((y[rows] - y_mu) / y_sd).astype(np.float32)

    return features(train), targets(train), features(test), targets(test), float(y_sd)


def train_data(shard: Shard) -> Iterator[dict[str, np.ndarray]]:
    """This worker's rows in a new order each epoch, ``shard.batch_size`` at a time."""
    x, y, *_ = split()
    rows = np.random.default_rng([shard.seed, shard.index, shard.epoch]).permutation(
        np.asarray(shard.slice(len(x)))
    )
    if len(rows) < shard.batch_size:  # a small data share (policy ashl): fill one batch
        rows = np.resize(rows, shard.batch_size)
    for i in range(0, len(rows) - shard.batch_size + 1, shard.batch_size):
        take = rows[i : i + shard.batch_size]
        yield {"x": x[take], "y": y[take]}


def eval_data() -> list[dict[str, np.ndarray]]:
    """The test set, one batch."""
    _, _, x, y, _ = split()
    return [{"x": x, "y": y}]


def init(key: jax.Array) -> dict[str, jax.Array]:
    """A 10 -> 32 -> 1 MLP, He-initialised hidden layer, zero output layer."""
    features = split()[0].shape[1]
    return {
        "hidden": {
            "w": jax.random.normal(key, (features, HIDDEN)) * jnp.sqrt(2.0 / features),
            "b": jnp.zeros((HIDDEN,)),
        },
        "out": {"w": jnp.zeros((HIDDEN, 1)), "b": jnp.zeros((1,))},
    }


def predict(params: dict[str, dict[str, jax.Array]], x: jax.Array) -> jax.Array:
    h = jax.nn.relu(x @ params["hidden"]["w"] + params["hidden"]["b"])
    return (h @ params["out"]["w"] + params["out"]["b"])[:, 0]


def loss(
    params: dict[str, dict[str, jax.Array]], batch: dict[str, jax.Array], key: jax.Array
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Mean squared error on standardised targets; ``mse`` in the data's units and ``r2``."""
    del key  # nothing random here
    y = batch["y"]
    err = jnp.mean((predict(params, batch["x"]) - y) ** 2)
    r2 = 1.0 - err / jnp.maximum(jnp.var(y), 1e-12)
    return err, {"mse": err * split()[4] ** 2, "r2": r2}


task = Task(
    init,
    loss,
    train_data,
    eval_data=eval_data,
    optimizer=optax.adamw(3e-3, weight_decay=1e-3),
    target={"metric": "r2", "mode": "max", "value": 0.5},
)
