"""The store's optimizer step matches optax by hand; snapshots are immutable; the aggregator
computes the weighted mean per kind."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from hetd.core.store import Aggregator, Store, make_optimizer


def init_params(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "dense/w": rng.standard_normal((4, 3)).astype(np.float32),
        "dense/b": rng.standard_normal(3).astype(np.float32),
    }


def grads(seed: int) -> dict[str, np.ndarray]:
    return {k: v for k, v in init_params(100 + seed).items()}


def assert_tree_close(got: Any, want: Any, atol: float = 1e-6) -> None:
    assert set(got) == set(want)
    for k in want:
        np.testing.assert_allclose(np.asarray(got[k]), np.asarray(want[k]), rtol=0, atol=atol)


OPTIMIZERS = {
    "sgd": lambda: optax.sgd(0.1),
    "adam": lambda: optax.adam(0.01),
    "momentum": lambda: make_optimizer("momentum", 0.1),
}


@pytest.mark.parametrize("opt", sorted(OPTIMIZERS))
def test_grad_steps_match_optax_by_hand(opt: str) -> None:
    tx = OPTIMIZERS[opt]()
    store = Store(init_params(), tx)
    ref = {k: jnp.asarray(v) for k, v in init_params().items()}
    ref_state = tx.init(ref)
    for step, scale in enumerate([1.0, 0.5, 0.25]):
        g = grads(step)
        updates, ref_state = tx.update({k: jnp.asarray(v) for k, v in g.items()}, ref_state, ref)
        ref = {k: ref[k] + scale * updates[k] for k in ref}
        assert store.apply("grad", g, scale) == step + 1
        assert_tree_close(store.snapshot().tensors, ref)


def test_weight_scales_the_adam_step_after_the_transform() -> None:
    """With Adam, scaling the gradient barely moves the step; scaling after the transform halves it."""
    p0 = init_params()
    full, half = Store(p0, optax.adam(0.01)), Store(p0, optax.adam(0.01))
    full.apply("grad", grads(0), 1.0)
    half.apply("grad", grads(0), 0.5)
    for k in p0:
        moved_full = full.snapshot().tensors[k] - p0[k]
        moved_half = half.snapshot().tensors[k] - p0[k]
        np.testing.assert_allclose(moved_half, 0.5 * moved_full, atol=1e-6)


def test_delta_apply_adds_scaled_delta_and_leaves_optimizer_state() -> None:
    store = Store(init_params(), optax.adam(0.01))
    store.apply("grad", grads(0), 1.0)
    before, opt_before, _ = store.state()
    delta = grads(1)
    assert store.apply("delta", delta, 0.3) == 2
    assert_tree_close(store.snapshot().tensors, {k: before[k] + 0.3 * delta[k] for k in before})
    _, opt_after, _ = store.state()
    for a, b in zip(jax.tree.leaves(opt_before), jax.tree.leaves(opt_after), strict=True):
        np.testing.assert_array_equal(a, b)


def test_unknown_kind_raises_and_keeps_version() -> None:
    store = Store(init_params(), optax.sgd(0.1), version=5)
    with pytest.raises(ValueError, match="weights"):
        store.apply("weights", grads(0), 1.0)
    assert store.version == 5
    assert_tree_close(store.snapshot().tensors, init_params())


def test_make_optimizer_unknown_name_lists_known() -> None:
    with pytest.raises(ValueError, match="adam"):
        make_optimizer("rmsprop", 0.1)


def test_shapes_and_n_params() -> None:
    store = Store(init_params(), optax.sgd(0.1))
    assert store.shapes == {"dense/w": (4, 3), "dense/b": (3,)}
    assert store.n_params == 15


def test_snapshot_is_read_only_cached_and_survives_later_steps() -> None:
    p0 = init_params()
    store = Store(p0, optax.adam(0.01))
    snap = store.snapshot()
    assert store.snapshot() is snap  # one host copy per version
    with pytest.raises(ValueError):
        snap.tensors["dense/w"][0, 0] = 1.0
    for step in range(3):
        store.apply("grad", grads(step), 1.0)
    store.apply("delta", grads(9), 1.0)
    assert snap.version == 0
    assert_tree_close(snap.tensors, p0, atol=0)  # donated buffers never reach a published copy
    assert_tree_close(p0, init_params(), atol=0)  # nor the caller's initial arrays
    fresh = store.snapshot()
    assert fresh is not snap and fresh.version == 4


def test_restore_round_trips_state_and_optimizer_carries_on() -> None:
    a = Store(init_params(), optax.adam(0.01))
    a.apply("grad", grads(0), 1.0)
    a.apply("grad", grads(1), 0.5)
    saved = a.state()
    saved_params = {k: v.copy() for k, v in saved[0].items()}
    b = Store(init_params(seed=7), optax.adam(0.01))
    b.restore(*saved)
    assert b.version == 2
    assert_tree_close(b.snapshot().tensors, a.snapshot().tensors, atol=0)
    # the Adam moments came across: the next step is the same on both stores
    a.apply("grad", grads(2), 1.0)
    b.apply("grad", grads(2), 1.0)
    assert_tree_close(b.snapshot().tensors, a.snapshot().tensors)
    b.apply("grad", grads(3), 1.0)
    assert_tree_close(saved[0], saved_params, atol=0)  # the checkpoint copy is untouched


def test_restore_rejects_other_shapes() -> None:
    store = Store(init_params(), optax.sgd(0.1))
    params, opt_state, version = store.state()
    with pytest.raises(ValueError, match="shapes"):
        store.restore({**params, "dense/b": np.zeros(4, np.float32)}, opt_state, version)
    with pytest.raises(ValueError):
        store.restore({"dense/w": params["dense/w"]}, opt_state, version)


# --- Aggregator ----------------------------------------------------------------------------------


def test_aggregator_normalised_mean_is_the_weighted_mean() -> None:
    agg = Aggregator()
    updates = [(grads(0), 32.0), (grads(1), 16.0), (grads(2), 8.0)]
    originals = [{k: v.copy() for k, v in g.items()} for g, _ in updates]
    for g, w in updates:
        agg.add("grad", g, w)
    assert agg.count == 3
    [(kind, mean)] = agg.take(normalize=True)
    assert kind == "grad"
    want = {k: sum(w * g[k] for g, w in updates) / 56.0 for k in updates[0][0]}
    assert_tree_close(mean, want)
    for (g, _), orig in zip(updates, originals, strict=True):
        assert_tree_close(g, orig, atol=0)  # pushed arrays are not modified
    assert agg.count == 0 and agg.take(normalize=True) == []


def test_aggregator_without_normalize_returns_the_weighted_sum() -> None:
    agg = Aggregator()
    agg.add("grad", grads(0), 0.5)
    agg.add("grad", grads(1), 0.25)
    [(_, total)] = agg.take(normalize=False)
    assert_tree_close(total, {k: 0.5 * grads(0)[k] + 0.25 * grads(1)[k] for k in grads(0)})


def test_aggregator_keeps_grad_and_delta_apart() -> None:
    agg = Aggregator()
    agg.add("grad", grads(0), 1.0)
    agg.add("delta", grads(1), 3.0)
    agg.add("grad", grads(2), 3.0)
    agg.add("delta", grads(3), 1.0)
    out = dict(agg.take(normalize=True))
    assert set(out) == {"grad", "delta"}
    assert_tree_close(out["grad"], {k: (grads(0)[k] + 3 * grads(2)[k]) / 4 for k in grads(0)})
    assert_tree_close(out["delta"], {k: (3 * grads(1)[k] + grads(3)[k]) / 4 for k in grads(0)})


def test_combined_flush_applies_each_update_once_with_its_weight() -> None:
    """ASP's meaning under the daemon's batching: the pushes queued between two publishes go
    through one step of their weighted sum, which for SGD (and plain deltas) is exactly the
    parameters of one step per push; int8 and float32 updates mix; the version counts each."""
    from hetd.core.store import Int8

    rng = np.random.default_rng(3)
    q = {k: rng.integers(-127, 128, np.shape(v), dtype=np.int8) for k, v in grads(9).items()}
    pushes: list[tuple[str, Any, float]] = [
        ("grad", grads(0), 0.25),
        ("grad", {k: Int8(v, np.float32(0.01)) for k, v in q.items()}, 0.5),
        ("delta", grads(1), 0.3),
        ("grad", grads(2), 1.0),
        ("delta", grads(3), 0.7),
    ]
    one_by_one, combined = (
        Store(init_params(), optax.sgd(0.1)),
        Store(init_params(), optax.sgd(0.1)),
    )
    combined.combine = True
    for kind, tensors, scale in pushes:
        one_by_one.apply(kind, tensors, scale)
        combined.apply(kind, tensors, scale)
    assert combined.pending == len(pushes)
    assert combined.snapshot().version == one_by_one.snapshot().version == len(pushes)
    assert_tree_close(combined.snapshot().tensors, one_by_one.snapshot().tensors, atol=1e-5)
    # ... and by hand: w - lr * Σ w_i g_i + Σ w_j d_j, each update counted once
    want = {k: v.copy() for k, v in init_params().items()}
    for kind, tensors, scale in pushes:
        for k in want:
            t = tensors[k]
            u = t.q.astype(np.float32) * t.scale if isinstance(t, Int8) else t
            want[k] += np.float32(scale) * (-0.1 * u if kind == "grad" else u)
    assert_tree_close(combined.snapshot().tensors, want, atol=1e-5)


def test_combined_flush_is_one_adam_step_of_the_weighted_sum() -> None:
    """With a stateful optimizer the batch is one step (as a synchronous round's flush is)."""
    tx = optax.adam(0.01)
    store = Store(init_params(), tx)
    store.combine = True
    store.apply("grad", grads(0), 0.5)
    store.apply("grad", grads(1), 0.25)
    ref = {k: jnp.asarray(v) for k, v in init_params().items()}
    g = {k: 0.5 * grads(0)[k] + 0.25 * grads(1)[k] for k in ref}
    updates, _ = tx.update({k: jnp.asarray(v) for k, v in g.items()}, tx.init(ref), ref)
    assert_tree_close(store.snapshot().tensors, {k: ref[k] + updates[k] for k in ref})
    assert store.version == 2


def test_a_published_version_is_freed_without_the_cycle_collector() -> None:
    """A snapshot's packing leaves no reference cycle behind: once the store moved on and the
    snapshot is dropped, the parameters it was packed from are freed by reference counting
    alone. (A cycle there held every version's parameters until Python's cyclic collector ran:
    at 100M parameters the daemon's RSS climbed by gigabytes between two collections.)"""
    import gc
    import weakref

    shapes = {"w": (256, 256), "b": (8,)}  # w: 256 KiB, a zero-copy segment of the frame
    params = {k: np.full(s, 0.5, np.float32) for k, s in shapes.items()}
    update = {k: np.full(s, 1e-3, np.float32) for k, s in shapes.items()}
    store = Store(params, make_optimizer("sgd", 0.1))
    store.snapshot()  # compile and warm outside the window
    gc.collect()
    gc.disable()
    try:
        gone: list[weakref.ref[Any]] = []
        for _ in range(3):
            store.apply("grad", update, 1.0)
            snap = store.snapshot()  # packed from the host views of these device buffers
            gone.append(weakref.ref(store._params["w"]))
            store.apply("grad", update, 1.0)
            store.flush()  # new buffers: the old ones live on only through the snapshot
            del snap
        assert store._snapshot is None
        alive = [r for r in gone if r() is not None]
    finally:
        gc.enable()
    assert not alive, f"{len(alive)} of 3 versions' parameters held by a reference cycle"
