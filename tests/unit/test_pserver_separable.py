"""Which optimizers S pservers can apply slice by slice: the probe sorts real optax transforms
into elementwise, per-tensor and whole-tree ones, and the map is refused where it would change
what the optimizer computes."""

from __future__ import annotations

from collections.abc import Callable

import jax.numpy as jnp
import optax
import pytest

from hetd.pserver.partition import BLOCK_BYTES, partition
from hetd.pserver.separable import (
    NotSliceable,
    Probe,
    Sliceable,
    block_bytes_for,
    plan,
    probe,
    require,
)
from hetd.zoo.task import Bound, Task

SHAPES = {"emb": (8, 3), "w": (6, 4), "b": (4,), "s": ()}


def _own_task_optimizer() -> optax.GradientTransformation:
    """A Task's own optimizer as the daemon runs it: on the user's whole tree, rebuilt per call."""

    def init(key):
        return {"layer": {"w": jnp.zeros((6, 4)), "b": jnp.zeros(4)}, "emb": jnp.zeros((8, 3))}

    task = Task(init, lambda p, b, k: jnp.sum(p["emb"]), lambda shard: iter(()))
    return Bound(task).flat_optimizer(optax.adamw(1e-3))


CASES: list[tuple[str, Callable[[], optax.GradientTransformation], Sliceable]] = [
    ("sgd", lambda: optax.sgd(0.1, momentum=0.9), Sliceable.ELEMENTWISE),
    ("adam", lambda: optax.adam(1e-3), Sliceable.ELEMENTWISE),
    ("adamw", lambda: optax.adamw(1e-3, weight_decay=0.1), Sliceable.ELEMENTWISE),
    ("clip_adam", lambda: optax.chain(optax.clip(0.5), optax.adam(1e-3)), Sliceable.ELEMENTWISE),
    (
        "masked_decay",
        lambda: optax.masked(
            optax.add_decayed_weights(0.1), lambda p: {k: v.ndim > 1 for k, v in p.items()}
        ),
        Sliceable.ELEMENTWISE,
    ),
    ("lamb", lambda: optax.lamb(1e-3), Sliceable.PER_TENSOR),
    ("adafactor", lambda: optax.adafactor(1e-3), Sliceable.PER_TENSOR),
    (
        "global_clip",
        lambda: optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(0.1)),
        Sliceable.WHOLE_TREE,
    ),
    ("task_own", _own_task_optimizer, Sliceable.WHOLE_TREE),
]


FAST = {"sgd", "global_clip", "task_own"}  # cheap ones; the others compile for seconds: slow


@pytest.mark.parametrize(
    ("name", "make", "kind"),
    [pytest.param(*c, marks=() if c[0] in FAST else pytest.mark.slow) for c in CASES],
    ids=[c[0] for c in CASES],
)
def test_the_probe_sorts_real_optimizers(name, make, kind):
    shapes = SHAPES if name != "task_own" else {"emb": (8, 3), "layer/w": (6, 4), "layer/b": (4,)}
    assert probe(make(), shapes).kind is kind


ELEMENTWISE = Probe(Sliceable.ELEMENTWISE, "each value alone")
PER_TENSOR = Probe(Sliceable.PER_TENSOR, "row blocks change the update of 'w'")
WHOLE_TREE = Probe(Sliceable.WHOLE_TREE, "whole tensors change the update of 'w'")
BIG = {"emb": (4_000_000, 1), "b": (3,)}  # 16 MB: cut into blocks by default


def test_an_elementwise_optimizer_takes_any_map():
    assert block_bytes_for(ELEMENTWISE, BLOCK_BYTES) == BLOCK_BYTES
    require(ELEMENTWISE, partition(BIG, 4))


def test_a_per_tensor_optimizer_takes_whole_tensors_only():
    assert block_bytes_for(PER_TENSOR, BLOCK_BYTES) == 0
    with pytest.raises(NotSliceable, match="whole tensors only"):
        require(PER_TENSOR, partition(BIG, 2))
    require(PER_TENSOR, partition(BIG, 2, block_bytes=block_bytes_for(PER_TENSOR, BLOCK_BYTES)))


def test_a_whole_tree_optimizer_is_refused_past_one_pserver_saying_what_to_do():
    with pytest.raises(NotSliceable, match="cannot be split over 2 pservers") as err:
        require(WHOLE_TREE, partition(SHAPES, 2, block_bytes=0))
    assert "clip_by_global_norm" in str(err.value) and "one pserver" in str(err.value)
    require(WHOLE_TREE, partition(SHAPES, 1, block_bytes=0))  # one pserver holds the whole tree


def test_plan_cuts_as_far_as_the_optimizer_allows_and_keeps_one_pserver_whole():
    sgd = optax.sgd(0.1)
    assert any(not p.whole for p in plan(sgd, BIG, 2).parts)
    one = plan(optax.chain(optax.clip_by_global_norm(1.0), sgd), BIG, 1)  # not even probed
    assert all(p.whole and p.server == 0 for p in one.parts)
    with pytest.raises(NotSliceable):
        plan(optax.chain(optax.clip_by_global_norm(1.0), sgd), SHAPES, 2)
