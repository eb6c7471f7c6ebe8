"""A Task's own optimizer on slices: run on the user's tree with stand-ins, masks and labels
written for that tree still apply, and S = 3 slices (one of them holding two blocks of a tensor)
end with the daemon's store's parameters running it on the whole tree: bit for bit for an
optimizer of products and sums, within float32 rounding for AdamW, whose division by its bias
correction XLA may compile as a product with the reciprocal in one compiled step and not in
another (docs/design.md, "Parameter servers")."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from hetd.core.applier import Applier
from hetd.core.store import Store
from hetd.pserver.log import DecisionLog
from hetd.pserver.partition import join, partition, split
from hetd.pserver.separable import NotSliceable, Sliceable, probe, require
from hetd.pserver.slice import SliceState
from hetd.pserver.task_tx import on_tree
from hetd.zoo.task import Bound, Task
from policies.types import Flush


def _init(key):
    k1, k2 = jax.random.split(key)
    return {
        "dense": {"kernel": jax.random.normal(k1, (400, 64)), "bias": jnp.zeros(64)},
        "head": [jax.random.normal(k2, (64, 4)), jnp.zeros(4)],
        "temp": jnp.ones(()),
    }


TASK = Task(_init, lambda p, b, k: jnp.sum(p["temp"]), lambda shard: iter(()))
BOUND = Bound(TASK)


def _labels(p):
    # by place in the user's tree: a mask a flat map of paths would not fit
    return {
        "dense": {"kernel": "decay", "bias": "plain"},
        "head": ["decay", "plain"],
        "temp": "plain",
    }


def _task_tx(decay: str = "adamw") -> optax.GradientTransformation:
    """Clipping, then weight decay on matrices (chosen by ``ndim``) and momentum SGD on the rest
    (chosen by place in the tree); ``decay`` picks the matrices' optimizer."""
    on_matrices = lambda p: jax.tree.map(lambda x: x.ndim > 1, p)  # noqa: E731
    if decay == "adamw":
        matrices = optax.adamw(1e-2, weight_decay=0.1, mask=on_matrices)
    else:  # products and sums only
        matrices = optax.chain(
            optax.add_decayed_weights(0.1, mask=on_matrices), optax.sgd(1e-2, momentum=0.9)
        )
    return optax.chain(
        optax.clip(1.0),
        optax.multi_transform(
            {"decay": matrices, "plain": optax.sgd(1e-2, momentum=0.9, nesterov=True)}, _labels
        ),
    )


def _updates(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {k: rng.standard_normal(s).astype(np.float32) for k, s in BOUND.layout.shapes.items()}


def _both(decay: str) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray], dict]:
    """The store's parameters and the three slices' joined, after the same pushes."""
    params = BOUND.init_flat()
    pmap = partition(BOUND.layout.shapes, 3, block_bytes=16 << 10)
    held = [sum(p.path == "dense/kernel" for p in pmap.of(s)) for s in range(3)]
    assert max(held) >= 2  # a slice holds two blocks of one tensor: two rounds
    make = on_tree(BOUND.layout, _task_tx(decay))
    require(probe(make, pmap.shapes), pmap)

    store = Store(params, BOUND.flat_optimizer(_task_tx(decay)))
    applier = Applier(store)
    slices = [SliceState(pmap, s, p, make(pmap, s)) for s, p in enumerate(split(pmap, params))]
    log = DecisionLog()
    records = []
    for pid in range(1, 6):
        u = _updates(pid)
        if pid in (2, 3):
            applier.buffer(0, "grad", u, 0.5)
            records.append(log.buffer(0, pid, "grad", 0, 0.5))
        else:
            applier.apply("grad", u, 1.0)
            records.append(log.apply(0, pid, "grad", 1.0))
        if pid == 3:
            applier.flush(Flush())
            records.append(log.flush(Flush()))
        for sl, part in zip(slices, split(pmap, u), strict=True):
            sl.receive(0, pid, part)
    records.append(log.step())
    for sl in slices:
        sl.offer(records)
        assert sl.advance() == log.position
    assert store.version == log.version == 4
    return dict(store.snapshot().tensors), join(pmap, [sl.params() for sl in slices]), params


def test_a_task_optimizer_with_masks_and_labels_is_bitwise_the_stores_on_three_pservers():
    want, got, start = _both("sgd")
    for k, v in want.items():
        assert got[k].tobytes() == v.tobytes(), k
        assert not np.array_equal(v, start[k])


@pytest.mark.slow
def test_a_task_adamw_on_three_pservers_is_the_stores_within_float32_rounding():
    want, got, start = _both("adamw")
    for k, v in want.items():
        # a float32 rounding's worth of the tensor's scale (near zero that is many ulps)
        np.testing.assert_allclose(got[k], v, rtol=1e-6, atol=1e-6 * float(np.max(np.abs(v))))
        assert not np.array_equal(v, start[k])


@pytest.mark.slow
def test_the_probe_reads_a_task_optimizer_as_it_runs_on_a_slice():
    shapes = BOUND.layout.shapes
    assert probe(on_tree(BOUND.layout, _task_tx()), shapes).kind is Sliceable.ELEMENTWISE
    # the daemon's whole-tree wrapper cannot run on a slice at all
    assert probe(BOUND.flat_optimizer(_task_tx()), shapes).kind is Sliceable.WHOLE_TREE
    clipped = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-3))
    found = probe(on_tree(BOUND.layout, clipped), shapes)
    assert found.kind is Sliceable.WHOLE_TREE
    with pytest.raises(NotSliceable):
        require(found, partition(shapes, 2))


def test_a_map_of_another_model_is_refused():
    with pytest.raises(ValueError, match="not the task's parameters"):
        on_tree(BOUND.layout, optax.sgd(0.1))(partition({"w": (2, 2)}, 1), 0)
