"""The examples in ``examples/`` load with :func:`hetd.zoo.task.load_task`, and their data is
what a worker and the daemon need: disjoint shards that cover the data, batches of the
micro-batch's size shaped alike, a new order each epoch, every test row evaluated once, a small
data share that still fills a batch; the BatchNorm one is refused. That each trains to its target
with a real daemon and two workers is tests/integration/test_examples.py.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest

from hetd.zoo.task import Shard, Task, TaskError, load_task

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


def rows_of(x_all: np.ndarray, batches: list[dict[str, np.ndarray]], key: str) -> list[int]:
    """The training rows a shard's batches hold (every row of these data sets is unique)."""
    where = {row.tobytes(): i for i, row in enumerate(x_all)}
    return [where[row.tobytes()] for batch in batches for row in batch[key]]


@pytest.mark.parametrize(
    ("name", "key"),
    [
        # digits_cnn reads full MNIST (seconds): `make test` runs it, `make test-fast` does not
        pytest.param("digits_cnn", "image", marks=pytest.mark.slow),
        ("linen_mlp", "image"),
        ("regression", "x"),
    ],
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


@pytest.mark.slow  # writes and reads the example's byte corpus: `make test` runs it, `make test-fast` does not
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


# digits_cnn (full MNIST) and tiny_gpt (its byte corpus) take seconds: `make test` runs them,
# `make test-fast` does not
@pytest.mark.parametrize(
    "name",
    [
        pytest.param("digits_cnn", marks=pytest.mark.slow),
        pytest.param("tiny_gpt", marks=pytest.mark.slow),
        "regression",
        "linen_mlp",
    ],
)
def test_a_small_data_share_still_fills_a_batch(examples_env: None, name: str) -> None:
    """ashl gives a slow worker a small fraction of the data (``Shard.share``): fewer examples
    than a batch are repeated to fill one."""
    task, _ = load(name)
    batches = list(task.train_data(Shard(0, 2, SEED, MICRO, share=(0.5, 0.002))))
    assert batches and all(leading_sizes(b) == {MICRO} for b in batches)


def test_linen_batchnorm_is_refused(examples_env: None) -> None:
    with pytest.raises(TaskError, match="batch statistics"):
        load_task(f"{EXAMPLES / 'linen_batchnorm'}.py:task")
