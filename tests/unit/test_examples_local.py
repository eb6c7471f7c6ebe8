"""The examples in ``examples/`` load with :func:`hetd.zoo.task.load_task` and train in-process
the way a daemon and its workers run them, to their own targets.

Training here is hetd's loop without the network: two workers' shards (``Shard(0, 2, seed, 32)``
and ``Shard(1, 2, seed, 32)``) take turns giving a micro-batch of 32, each gradient goes through
:meth:`Bound.flat_optimizer` on the flat parameters, an iterator that ends is built again for the
next epoch on the next shard along (as :class:`hetd.zoo.task_steps.BatchStream` does), and an
evaluation averages the loss's metrics over ``eval_data`` weighted by batch size, as the daemon
does. Step bounds are about twice the steps measured to reach each target.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from hetd.zoo.task import Bound, Shard, Task, TaskError, load_task

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
MICRO = 32
SEED = 0


@pytest.fixture(scope="module")
def examples_env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """tiny_gpt's token cache in a temporary directory; load_task's additions to sys.path and
    sys.modules (the examples' folder and modules) undone at the end."""
    saved_path = list(sys.path)
    saved_modules = set(sys.modules)
    mp = pytest.MonkeyPatch()
    mp.setenv("XDG_CACHE_HOME", str(tmp_path_factory.mktemp("cache")))
    yield
    mp.undo()
    sys.path[:] = saved_path
    for name in set(sys.modules) - saved_modules:
        if str(getattr(sys.modules[name], "__file__", None)).startswith(str(EXAMPLES)):
            del sys.modules[name]


def load(name: str) -> tuple[Task, Any]:
    """The example's task and its module."""
    path = EXAMPLES / f"{name}.py"
    task = load_task(f"{path}:task")
    module = next(
        m for m in list(sys.modules.values()) if getattr(m, "__file__", None) == str(path)
    )
    return task, module


def leading_sizes(batch: Any) -> set[int]:
    return {int(np.shape(leaf)[0]) for leaf in jax.tree.leaves(batch)}


def spec(batch: Any) -> Any:
    leaves, treedef = jax.tree.flatten(batch)
    return treedef, [(np.shape(x), np.asarray(x).dtype) for x in leaves]


class Stream:
    """One worker's batches: its shard's iterator, built again when it ends for the next epoch
    on the next shard along; every batch checked as a worker checks it (``MICRO`` examples, the
    same shapes and dtypes)."""

    def __init__(self, task: Task, shard: Shard) -> None:
        self.task, self.first, self.epoch = task, shard, 0
        self.it = iter(task.train_data(shard))
        self.spec: Any = None

    def next(self) -> Any:
        try:
            batch = next(self.it)
        except StopIteration:
            self.epoch += 1
            s = self.first
            shard = Shard(
                (s.index + self.epoch) % s.count, s.count, s.seed, s.batch_size, self.epoch
            )
            self.it = iter(self.task.train_data(shard))
            batch = next(self.it)
        assert leading_sizes(batch) == {MICRO}
        if self.spec is None:
            self.spec = spec(batch)
        assert spec(batch) == self.spec
        return batch


def evaluate(bound: Bound, loss: Callable[..., Any], params: Any) -> dict[str, float]:
    """The daemon's evaluation: "loss" and the metrics, averaged over the eval batches by size."""
    sums: dict[str, float] = {}
    count = 0
    for batch in bound.eval_batches():
        value, metrics = loss(params, batch, jax.random.PRNGKey(0))
        (size,) = leading_sizes(batch)
        for name, v in {"loss": value, **metrics}.items():
            sums[name] = sums.get(name, 0.0) + float(v) * size
        count += size
    return {name: total / count for name, total in sums.items()}


def train(task: Task, max_steps: int, every: int) -> tuple[int | None, dict[str, float]]:
    """Train until the target is met (checked every ``every`` steps): the steps it took (None if
    not within ``max_steps``) and the last evaluation."""
    assert task.target is not None and task.optimizer is not None
    bound = Bound(task, SEED)
    params = {name: jnp.asarray(v) for name, v in bound.init_flat().items()}
    tx = bound.flat_optimizer(task.optimizer)
    state = tx.init(params)

    @jax.jit
    def step(params: Any, state: Any, batch: Any, key: jax.Array) -> tuple[Any, Any]:
        grads = jax.grad(lambda p: bound.loss_flat(p, batch, key)[0])(params)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    loss = jax.jit(bound.loss_flat)
    workers = [Stream(task, Shard(i, 2, SEED, MICRO)) for i in range(2)]
    key = jax.random.PRNGKey(SEED)
    metrics: dict[str, float] = {}
    for n in range(1, max_steps + 1):
        batch = workers[n % 2].next()
        params, state = step(params, state, batch, jax.random.fold_in(key, n))
        if n % every == 0:
            metrics = evaluate(bound, loss, params)
            if task.target.reached(metrics):
                return n, metrics
    return None, metrics


@pytest.mark.parametrize(
    ("name", "max_steps", "every"),
    [
        # (example, step bound ~2x the steps measured to reach the target, steps between evals)
        ("digits_cnn", 200, 20),  # accuracy >= 0.95 at 100
        ("tiny_gpt", 180, 20),  # perplexity <= 8 at 85
        ("regression", 100, 10),  # r2 >= 0.5 at 40
        ("linen_mlp", 100, 10),  # accuracy >= 0.95 at 45
    ],
)
def test_example_reaches_its_target(
    examples_env: None, name: str, max_steps: int, every: int
) -> None:
    task, _ = load(name)
    steps, metrics = train(task, max_steps, every)
    assert steps is not None, f"{name}: {task.target} not reached in {max_steps} steps: {metrics}"


def rows_of(x_all: np.ndarray, batches: list[dict[str, np.ndarray]], key: str) -> list[int]:
    """The training rows a shard's batches hold (every row of these data sets is unique)."""
    where = {row.tobytes(): i for i, row in enumerate(x_all)}
    return [where[row.tobytes()] for batch in batches for row in batch[key]]


@pytest.mark.parametrize(
    ("name", "key"), [("digits_cnn", "image"), ("linen_mlp", "image"), ("regression", "x")]
)
def test_tabular_shards_are_disjoint_and_reshuffled(
    examples_env: None, name: str, key: str
) -> None:
    task, module = load(name)
    x_train, x_test = module.split()[0], module.split()[2]
    seen: dict[int, set[int]] = {}
    for index in range(2):
        shard = Shard(index, 2, SEED, MICRO)
        part = set(shard.slice(len(x_train)))
        orders = []
        for epoch in range(2):
            batches = list(task.train_data(dataclasses.replace(shard, epoch=epoch)))
            assert all(spec(b) == spec(batches[0]) for b in batches)
            assert all(leading_sizes(b) == {MICRO} for b in batches)
            rows = rows_of(x_train, batches, key)
            assert len(rows) == len(set(rows)) == len(part) // MICRO * MICRO
            assert set(rows) <= part
            orders.append(rows)
        assert orders[0] != orders[1]  # a new order each epoch
        seen[index] = set(orders[0]) | set(orders[1])
    assert not seen[0] & seen[1]
    assert set(Shard(0, 2, SEED, MICRO).slice(len(x_train))) | set(
        Shard(1, 2, SEED, MICRO).slice(len(x_train))
    ) == set(range(len(x_train)))
    # every test row is evaluated once
    assert sum(leading_sizes(b).pop() for b in task.eval_data()) == len(x_test)


def test_tiny_gpt_reads_disjoint_bytes_from_its_memmap(examples_env: None) -> None:
    task, gpt = load("tiny_gpt")
    data = gpt.tokens()
    assert isinstance(data, np.memmap) and data.mode == "r"
    text = bytes(data)
    bounds = gpt.token_files()[1]
    split = gpt.train_bytes()
    doc_starts = set(bounds.tolist())

    def targets(lo: int, hi: int, offset: int) -> list[int]:
        starts, ends = gpt.windows(lo, hi, offset)
        assert np.all(ends - starts >= 2) and np.all(ends - starts <= gpt.CONTEXT + 1)
        return [t for s, e in zip(starts, ends, strict=True) for t in range(s + 1, e)]

    # every byte of a part (but a document's first) is a target once, whatever the epoch's grid
    covered = []
    for index in range(2):
        part = Shard(index, 2, SEED, MICRO).slice(split)
        for offset in (0, 17):
            got = targets(part.start, part.stop, offset)
            want = [t for t in range(part.start + 1, part.stop) if t not in doc_starts]
            assert sorted(got) == want
        covered.append(set(got))
    assert not covered[0] & covered[1]
    held_out = targets(split, len(data), 0)
    assert min(held_out) > split and not set(held_out) & (covered[0] | covered[1])

    # batches are real text, padded after a window's end, masked there
    for index in range(2):
        batches = list(task.train_data(Shard(index, 2, SEED, MICRO, epoch=1)))
        assert batches and all(spec(b) == spec(batches[0]) for b in batches)
        for row, mask in zip(batches[0]["tokens"][:4], batches[0]["mask"][:4], strict=True):
            n = int(mask.sum()) + 1
            assert bytes(row[:n].astype(np.uint8)) in text and not row[n:].any()
    (batch,) = task.eval_data()
    assert batch["mask"].sum() == len(held_out)


@pytest.mark.parametrize("name", ["digits_cnn", "tiny_gpt", "regression", "linen_mlp"])
def test_a_small_data_share_still_fills_a_batch(examples_env: None, name: str) -> None:
    """ashl gives a slow worker a small fraction of the data (``Shard.share``): fewer examples
    than a batch are repeated to fill one."""
    task, _ = load(name)
    batches = list(task.train_data(Shard(0, 2, SEED, MICRO, share=(0.5, 0.002))))
    assert batches and all(leading_sizes(b) == {MICRO} for b in batches)


def test_linen_batchnorm_is_refused(examples_env: None) -> None:
    with pytest.raises(TaskError, match="batch statistics"):
        load_task(f"{EXAMPLES / 'linen_batchnorm'}.py:task")
