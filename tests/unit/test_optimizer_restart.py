"""``Store.restart_optimizer``, what a policy's ``RestartOptimizer`` asks of the daemon: the
queued steps run under the old state, the gradients' optimizer then starts afresh (Adam's next
step is a fresh Adam's first), the parameters and the version stay, and a restart carried out by
the engine's executor reaches the store."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
import optax

from hetd.core import Engine
from hetd.core.store import Store, make_optimizer
from policies import ClusterView, Policy, RestartOptimizer, make_policy
from policies.types import Event, Push
from tests.conftest import FakeClock
from tests.unit.test_engine import CONFIG, SHAPES, Harness


def _store(optimizer: str) -> Store:
    return Store({"w": np.zeros(4, np.float32)}, make_optimizer(optimizer))


def _grad(x: float) -> dict[str, np.ndarray]:
    return {"w": np.full(4, x, np.float32)}


def _w(s: Store) -> np.ndarray:
    return np.asarray(s.state()[0]["w"]).copy()


def test_after_a_restart_adam_steps_as_a_fresh_adam_does() -> None:
    """Large gradients fill Adam's second moment; a small one after them moves the parameters
    by far less than the learning rate, unless the optimizer was restarted: then by the
    learning rate, as a fresh Adam's first step does (|m̂ / √v̂| = 1)."""
    kept, restarted = _store("adam:lr=0.1"), _store("adam:lr=0.1")
    for s in (kept, restarted):
        for _ in range(10):
            s.apply("grad", _grad(100.0), 1.0)
    restarted.apply("grad", _grad(100.0), 1.0)  # queued: runs under the old state first
    restarted.restart_optimizer()
    kept.apply("grad", _grad(100.0), 1.0)
    kept.flush()
    np.testing.assert_array_equal(_w(restarted), _w(kept))  # the queued step ran, nothing else
    assert restarted.version == kept.version == 11  # a restart is no update
    before_kept, before_restarted = _w(kept), _w(restarted)
    kept.apply("grad", _grad(-0.01), 1.0)
    restarted.apply("grad", _grad(-0.01), 1.0)
    kept.flush()
    restarted.flush()
    fresh = _store("adam:lr=0.1")
    fresh.apply("grad", _grad(-0.01), 1.0)
    fresh.flush()
    np.testing.assert_allclose(_w(restarted) - before_restarted, _w(fresh), rtol=1e-5)
    np.testing.assert_allclose(_w(fresh), 0.1, rtol=1e-5)
    # kept: the old moments still point the other way and dwarf the small gradient
    assert np.all(_w(kept) - before_kept < 0)


def test_under_plain_sgd_a_restart_changes_no_step() -> None:
    a, b = _store("sgd:lr=0.1"), _store("sgd:lr=0.1")
    for s in (a, b):
        s.apply("grad", _grad(1.0), 1.0)
    b.restart_optimizer()
    for s in (a, b):
        s.apply("grad", _grad(2.0), 0.5)
        s.flush()
    np.testing.assert_array_equal(_w(a), _w(b))


def _adam_count(store: Store) -> int:
    """The step count Adam keeps (optax's ScaleByAdamState.count)."""
    _, opt, _ = store.state()
    adam = optax.ScaleByAdamState
    counts = [
        int(np.asarray(s.count))
        for s in jax.tree.leaves(opt, is_leaf=lambda x: isinstance(x, adam))
        if isinstance(s, adam)
    ]
    assert counts, "no Adam state found"
    return counts[0]


def test_the_engine_carries_a_policys_restart_to_its_store() -> None:
    """asp that asks for a restart on the third push: Adam's count goes 1, 2, then 1 again (the
    queued steps ran under the old state, the push after the restart is a fresh Adam's first)."""
    asp = make_policy("asp")

    def update(event: Event, state: Any, view: ClusterView) -> tuple[Sequence[Any], Any]:
        out, state = asp.update(event, state, view)
        if isinstance(event, Push) and view.version == 2:
            out = [RestartOptimizer(), *out]
        return out, state

    params = {k: np.zeros(s, np.float32) for k, s in SHAPES.items()}
    store = Store(params, make_optimizer("adam:lr=0.01"))
    clock = FakeClock()
    policy = Policy("restart-on-third", asp.init, update, {})
    h = Harness(Engine(store, policy, CONFIG, clock), clock, {}, {})
    h.run("join a")
    counts = []
    for _ in range(4):
        h.run("push a")
        store.flush()
        counts.append(_adam_count(store))
    assert counts == [1, 2, 1, 2] and store.version == 4
