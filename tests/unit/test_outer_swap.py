"""Store.set_outer, behind a policy swap's new outer optimizer: queued deltas run under the old
one, the new one starts from a fresh state, the same spec keeps the running state, and a bad spec
changes nothing."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from hetd.core.store import Store, make_optimizer, make_outer

NESTEROV = "nesterov:lr=0.7,momentum=0.9"


def _store(outer: str = "sgd:lr=1") -> Store:
    params = {"w": np.zeros(3, np.float32)}
    return Store(params, make_optimizer("sgd:lr=0.1"), outer=make_outer(outer), outer_spec=outer)


def _delta(x: float) -> dict[str, np.ndarray]:
    return {"w": np.full(3, x, np.float32)}


def _params(s: Store) -> np.ndarray:
    return np.asarray(s.state()[0]["w"])


def test_queued_deltas_run_under_the_old_outer_and_the_new_one_starts_fresh() -> None:
    s = _store()
    s.apply("delta", _delta(1.0), 1.0)  # queued: added as it is (plain averaging)
    assert s.set_outer(NESTEROV) and s.outer_spec == NESTEROV
    np.testing.assert_allclose(_params(s), 1.0)
    _, opt, _ = s.state()
    assert set(opt) == {"grad", "outer"}
    assert all(not np.any(np.asarray(x)) for x in jax.tree.leaves(opt["outer"]))  # fresh
    s.apply("delta", _delta(1.0), 1.0)  # Nesterov: lr * (g + mu * (mu * 0 + g)) = 0.7 * 1.9
    np.testing.assert_allclose(_params(s), 1.0 + 0.7 * 1.9, rtol=1e-6)
    assert s.set_outer("sgd:lr=1") and s.outer_spec == "sgd:lr=1"
    s.apply("delta", _delta(1.0), 1.0)
    np.testing.assert_allclose(_params(s), 2.0 + 0.7 * 1.9, rtol=1e-6)


def test_the_same_spec_keeps_the_state_and_a_bad_one_changes_nothing() -> None:
    s = _store(NESTEROV)
    s.apply("delta", _delta(1.0), 1.0)
    before = [np.asarray(x).copy() for x in jax.tree.leaves(s.state()[1]["outer"])]
    assert not s.set_outer("nesterov:momentum=0.9,lr=0.7")  # the same, spelled otherwise
    with pytest.raises(ValueError):
        s.set_outer("no_such_optimizer:lr=1")
    assert s.outer_spec == NESTEROV
    after = [np.asarray(x) for x in jax.tree.leaves(s.state()[1]["outer"])]
    assert any(np.any(b) for b in before)
    for b, a in zip(before, after, strict=True):
        np.testing.assert_array_equal(a, b)


def test_a_state_taken_under_another_outer_restores_with_a_fresh_outer_state() -> None:
    """The real bench's t = 0 restart puts back the state taken under its warm-up policy (plain
    averaging: no outer state) after swapping in diloco over sgd (Nesterov); a checkpoint taken
    under Nesterov can meet a store without an outer optimizer. Both restore: the gradient
    optimizer's state carries over, the outer one starts fresh."""
    plain = _store()
    plain.apply("grad", _delta(1.0), 1.0)
    params, opt, version = plain.state()
    s = _store()
    assert s.set_outer(NESTEROV)
    s.restore(params, opt, version + 1)
    _, now, _ = s.state()
    assert set(now) == {"grad", "outer"}
    assert all(not np.any(np.asarray(x)) for x in jax.tree.leaves(now["outer"]))
    s.apply("delta", _delta(1.0), 1.0)
    nested = s.state()
    back = _store()
    back.restore(nested[0], nested[1], nested[2])
    np.testing.assert_allclose(_params(back), _params(s))
    assert not isinstance(back.state()[1], dict)
