"""Optimizer specs (inner, outer, daemon) and the store's outer optimizer for deltas."""

from __future__ import annotations

import numpy as np
import optax
import pytest

from hetd.core.store import Store
from hetd.zoo.optim import OptimizerSpec, make_optimizer, parse_optimizer


@pytest.mark.parametrize(
    ("spec", "want"),
    [
        ("sgd", OptimizerSpec("sgd")),
        ("adam", OptimizerSpec("adam")),
        ("nesterov:lr=0.7,momentum=0.9", OptimizerSpec("nesterov", 0.7, (("momentum", 0.9),))),
        (" adam : lr=0.001, b2=0.95 ", OptimizerSpec("adam", 0.001, (("b2", 0.95),))),
    ],
)
def test_specs_parse(spec: str, want: OptimizerSpec) -> None:
    assert parse_optimizer(spec) == want


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("rmsprop", "known: sgd, momentum, nesterov, adam"),
        ("adam:momentum=0.9", "adam takes"),
        ("sgd:lr=fast", "must be a number"),
        ("sgd:lr=0", "finite and positive"),
        ("sgd:lr", "bad option"),
    ],
)
def test_bad_specs_say_what_is_valid(spec: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_optimizer(spec)


def test_a_spec_without_lr_takes_the_callers() -> None:
    assert parse_optimizer("adam").with_default_lr(0.01).lr == 0.01
    assert parse_optimizer("adam:lr=0.1").with_default_lr(0.01).lr == 0.1
    with pytest.raises(ValueError, match="learning rate"):
        parse_optimizer("sgd").build()


def _params() -> dict[str, np.ndarray]:
    return {"w": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.zeros(3, np.float32)}


def test_outer_sgd_at_lr_1_adds_deltas_like_no_outer_optimizer() -> None:
    delta = {"w": np.full((2, 3), 0.5, np.float32), "b": np.ones(3, np.float32)}
    plain = Store(_params(), optax.sgd(0.1))
    outer = Store(_params(), optax.sgd(0.1), outer=make_optimizer("sgd", 1.0))
    for store in (plain, outer):
        store.apply("delta", delta, 0.5)
        store.apply("delta", delta, 0.5)
    for k in delta:
        np.testing.assert_array_equal(plain.snapshot().tensors[k], outer.snapshot().tensors[k])


def test_outer_nesterov_keeps_momentum_across_deltas_and_checkpoints() -> None:
    delta = {"w": np.full((2, 3), 0.5, np.float32), "b": np.ones(3, np.float32)}
    store = Store(_params(), optax.sgd(0.1), outer=make_optimizer("nesterov:lr=0.7"))
    store.apply("delta", delta, 1.0)
    params, opt, version = store.state()
    assert set(opt) == {"grad", "outer"}
    # Nesterov with momentum 0.9: the first step moves 0.7 * (1 + 0.9) * delta.
    np.testing.assert_allclose(params["b"], 0.7 * 1.9 * np.ones(3), rtol=1e-6)
    again = Store(_params(), optax.sgd(0.1), outer=make_optimizer("nesterov:lr=0.7"))
    again.restore(params, opt, version)
    store.apply("delta", delta, 1.0)
    again.apply("delta", delta, 1.0)
    np.testing.assert_array_equal(store.snapshot().tensors["b"], again.snapshot().tensors["b"])
    assert not np.allclose(store.snapshot().tensors["b"], 2 * 0.7 * 1.9)  # momentum carried
