"""A task hetd refuses: a ``flax.linen`` model with BatchNorm. Loading it is expected to fail.

This file is here to show the refusal, not to train anything::

    $ hetd serve --task examples/linen_batchnorm.py:task
    ... TaskError: task 'examples/linen_batchnorm.py:task': importing ... failed: TaskError:
    from_linen: Net keeps batch statistics (collection 'batch_stats'), which workers cannot
    share; use a normalisation without running statistics (LayerNorm, GroupNorm, RMSNorm)

``BatchNorm`` keeps running means and variances in the ``batch_stats`` collection, and every
forward pass in training updates them. hetd trains ``params`` by gradients the daemon applies;
each worker would update its own ``batch_stats`` from its own batches, and there is no rule for
the daemon to merge them that keeps an update's meaning (nor to send them with the parameters).
So :meth:`hetd.Task.from_linen` refuses the module when it is built, rather than training a
model whose statistics silently disagree between workers. ``examples/linen_mlp.py`` is the same
kind of model with ``LayerNorm``, which has parameters only, and trains.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import flax.linen as nn
import jax
import numpy as np
import optax

from hetd import Shard, Task


class Net(nn.Module):
    """dense (128) -> BatchNorm -> relu -> dense (10)."""

    @nn.compact
    def __call__(self, x: jax.Array, train: bool = True) -> jax.Array:
        x = nn.Dense(128)(x)
        x = nn.BatchNorm(use_running_average=not train)(x)
        return nn.Dense(10)(nn.relu(x))


def loss_fn(apply: Callable[..., jax.Array], batch: dict[str, jax.Array]) -> jax.Array:
    logits = apply(batch["image"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()


def train_data(shard: Shard) -> Iterator[dict[str, np.ndarray]]:
    rng = np.random.default_rng([shard.seed, shard.index, shard.epoch])
    for _ in range(10):
        yield {
            "image": rng.random((shard.batch_size, 64), np.float32),
            "label": rng.integers(0, 10, shard.batch_size).astype(np.int32),
        }


# Raises hetd's TaskError: Net keeps batch statistics.
task = Task.from_linen(Net(), loss_fn, train_data, sample=np.zeros((1, 64), np.float32))
