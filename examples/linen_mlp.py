"""A ``flax.linen`` MLP with LayerNorm on scikit-learn's digits, through ``Task.from_linen``.

What it shows:

* :meth:`hetd.Task.from_linen`: a linen module, an example input (``sample``) for its ``init``,
  and ``loss_fn(apply, batch)``, where ``apply(x)`` is ``module.apply({"params": params}, x)``.
  hetd trains the ``params`` collection, which travels as linen's own nested dict
  (``Dense_0/kernel``, ``LayerNorm_0/scale``, ...).
* ``train_data`` as a plain generator: this worker's rows (``shard.slice``), a new order each
  epoch, batches of exactly ``shard.batch_size``.
* SGD with Nesterov momentum as the daemon's optimizer.

Why LayerNorm and not BatchNorm: a linen ``BatchNorm`` keeps running means and variances in a
``batch_stats`` collection that every forward pass in training updates. Each worker would update
its own copy from its own batches, and the daemon, which applies gradients of ``params``, has no
rule to merge them that keeps an update's meaning; so ``from_linen`` refuses such a module::

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x, train: bool = True):
            x = nn.Dense(128)(x)
            x = nn.BatchNorm(use_running_average=not train)(x)
            return nn.Dense(10)(nn.relu(x))

    Task.from_linen(Net(), loss_fn, train_data, sample=x[:1])
    # TaskError: from_linen: Net keeps batch statistics (collection 'batch_stats'), which
    # workers cannot share; use a normalisation without running statistics (LayerNorm,
    # GroupNorm, RMSNorm)

(``examples/linen_batchnorm.py`` is that module as a task: loading it fails with this error.)
LayerNorm normalises each example by its own features, so it has parameters only.

The split is the one ``digits_cnn.py`` uses (a permutation seeded with 0; 360 test images).
Train it::

    hetd serve --task examples/linen_mlp.py:task
    hetd-worker ws://127.0.0.1:7070 --task examples/linen_mlp.py:task   # twice
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from hetd import Shard, Task

TEST_SIZE = 360
EVAL_BATCH = 120


@functools.cache
def split() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``(x_train, y_train, x_test, y_test)``: 64 pixels in [0, 1] as float32, int32 labels."""
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    x, y = (x / 16.0).astype(np.float32), y.astype(np.int32)
    order = np.random.RandomState(0).permutation(len(x))
    test, train = order[:TEST_SIZE], order[TEST_SIZE:]
    return x[train], y[train], x[test], y[test]


def train_data(shard: Shard) -> Iterator[dict[str, np.ndarray]]:
    """This worker's rows in a new order each epoch, ``shard.batch_size`` at a time."""
    x, y, _, _ = split()
    rows = np.random.default_rng([shard.seed, shard.index, shard.epoch]).permutation(
        np.asarray(shard.slice(len(x)))
    )
    if len(rows) < shard.batch_size:  # a small data share (policy ashl): fill one batch
        rows = np.resize(rows, shard.batch_size)
    for i in range(0, len(rows) - shard.batch_size + 1, shard.batch_size):
        take = rows[i : i + shard.batch_size]
        yield {"image": x[take], "label": y[take]}


def eval_data() -> Iterator[dict[str, np.ndarray]]:
    """The 360 test images in three batches of 120."""
    _, _, x, y = split()
    for i in range(0, len(x), EVAL_BATCH):
        yield {"image": x[i : i + EVAL_BATCH], "label": y[i : i + EVAL_BATCH]}


class MLP(nn.Module):
    """dense (128) -> LayerNorm -> relu -> dense (10)."""

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        x = nn.relu(nn.LayerNorm()(nn.Dense(128)(x)))
        return nn.Dense(10)(x)


def loss_fn(
    apply: Callable[[jax.Array], jax.Array], batch: dict[str, jax.Array]
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Mean cross-entropy, and the batch's accuracy."""
    logits = apply(batch["image"])
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()
    return loss, {"accuracy": jnp.mean(jnp.argmax(logits, -1) == batch["label"])}


task = Task.from_linen(
    MLP(),
    loss_fn,
    train_data,
    sample=np.zeros((1, 64), np.float32),
    eval_data=eval_data,
    optimizer=optax.sgd(0.05, momentum=0.9, nesterov=True),
    target={"metric": "accuracy", "mode": "max", "value": 0.95},
)
