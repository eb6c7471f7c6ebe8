"""A small ``flax.nnx`` CNN on scikit-learn's digits, fed by a ``grain`` pipeline.

What it shows:

* :meth:`hetd.Task.from_nnx` with a module factory (``rngs -> module``): hetd trains its
  ``nnx.Param`` variables, which travel as the module's own nested dict (``conv1/kernel``, ...).
* ``train_data(shard)`` as a grain ``MapDataset``: the training rows, this worker's part of them
  (``shard.slice``), a shuffle seeded by the shard's seed, index and epoch (a new order each pass),
  and batches of exactly ``shard.batch_size`` (``drop_remainder=True``: the worker compiles one
  shape). When the iterator ends the worker calls ``train_data`` again for its next epoch.
* an optax chain as the daemon's optimizer: clipping, then AdamW with a warmup-cosine schedule
  and weight decay on the kernels only (the mask sees the same nested dict as the model).
* a metric (``accuracy``) and a target on it (0.95 on the test images, about 100 steps of 32):
  ``hetd status`` reports when it is reached.

The split is fixed (a permutation seeded with 0, the same in every process): 360 test images,
1437 training images. Train it::

    hetd serve --task examples/digits_cnn.py:task
    hetd-worker ws://127.0.0.1:7070 --task examples/digits_cnn.py:task   # twice
"""

from __future__ import annotations

import functools
import math
from typing import Any

import grain
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from hetd import Shard, Task

TEST_SIZE = 360
EVAL_BATCH = 120  # 360 = 3 x 120: every test image is scored, every eval batch has one shape
# grain reads with 16 threads by default; the arrays are already in memory, so read inline.
READ = grain.ReadOptions(num_threads=0, prefetch_buffer_size=0)


@functools.cache
def split() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``(x_train, y_train, x_test, y_test)``: images ``(n, 8, 8, 1)`` float32 in [0, 1], labels
    int32. The same split in every process (a permutation seeded with 0)."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = (digits.images / 16.0).astype(np.float32)[..., None]
    y = digits.target.astype(np.int32)
    order = np.random.RandomState(0).permutation(len(x))
    test, train = order[:TEST_SIZE], order[TEST_SIZE:]
    return x[train], y[train], x[test], y[test]


class Rows:
    """A grain random-access source: one ``{"image", "label"}`` example per row."""

    def __init__(self, x: np.ndarray, y: np.ndarray) -> None:
        self.x, self.y = x, y

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        return {"image": self.x[i], "label": self.y[i]}


def shuffle_seed(shard: Shard) -> int:
    """One seed per (run seed, shard, epoch): workers differ, and each pass has a new order."""
    return int(np.random.SeedSequence([shard.seed, shard.index, shard.epoch]).generate_state(1)[0])


def train_data(shard: Shard) -> grain.IterDataset:
    """This worker's rows, shuffled for ``shard.epoch``, in batches of ``shard.batch_size``."""
    x, y, _, _ = split()
    rows = shard.slice(len(x))
    ds = (
        grain.MapDataset.source(Rows(x, y))
        .slice(slice(rows.start, rows.stop))
        .shuffle(seed=shuffle_seed(shard))
    )
    if len(rows) < shard.batch_size:  # a small data share (policy ashl): fill one batch
        ds = ds.repeat(math.ceil(shard.batch_size / len(rows)))
    return ds.batch(shard.batch_size, drop_remainder=True).to_iter_dataset(READ)


def eval_data() -> grain.IterDataset:
    """The 360 test images in three batches of 120."""
    _, _, x, y = split()
    return grain.MapDataset.source(Rows(x, y)).batch(EVAL_BATCH).to_iter_dataset(READ)


class CNN(nnx.Module):
    """conv 3x3 (16) -> relu -> conv 3x3 (32) -> relu -> 2x2 average pool -> linear (10)."""

    def __init__(self, rngs: nnx.Rngs) -> None:
        self.conv1 = nnx.Conv(1, 16, kernel_size=(3, 3), rngs=rngs)
        self.conv2 = nnx.Conv(16, 32, kernel_size=(3, 3), rngs=rngs)
        self.head = nnx.Linear(4 * 4 * 32, 10, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = nnx.relu(self.conv1(x))
        x = nnx.relu(self.conv2(x))
        x = nnx.avg_pool(x, window_shape=(2, 2), strides=(2, 2))
        return self.head(x.reshape(x.shape[0], -1))


def loss_fn(model: CNN, batch: dict[str, jax.Array]) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Mean cross-entropy, and the batch's accuracy."""
    logits = model(batch["image"])
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()
    return loss, {"accuracy": jnp.mean(jnp.argmax(logits, -1) == batch["label"])}


def decay_kernels(params: Any) -> Any:
    """AdamW's mask: weight decay on kernels, never on biases."""
    return jax.tree_util.tree_map_with_path(
        lambda path, _: getattr(path[-1], "key", None) == "kernel", params
    )


schedule = optax.warmup_cosine_decay_schedule(
    init_value=0.0, peak_value=3e-3, warmup_steps=20, decay_steps=1000, end_value=1e-4
)
optimizer = optax.chain(
    optax.clip_by_global_norm(1.0),
    optax.adamw(schedule, weight_decay=1e-4, mask=decay_kernels),
)

task = Task.from_nnx(
    CNN,
    loss_fn,
    train_data,
    eval_data=eval_data,
    optimizer=optimizer,
    target={"metric": "accuracy", "mode": "max", "value": 0.95},
)
