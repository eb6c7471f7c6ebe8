"""``delayed_nesterov`` as an ``[train] outer_optimizer`` spec, and in the store (docs/policies.md §13)."""

from __future__ import annotations

import math

import numpy as np
import optax
import pytest

from hetd.core.store import Store
from hetd.zoo.optim import parse_optimizer


def test_delayed_nesterov_by_spec_and_in_the_store() -> None:
    spec = parse_optimizer("delayed_nesterov:lr=0.7,momentum=0.9,period=2")
    assert str(spec) == "delayed_nesterov:lr=0.7,momentum=0.9,period=2"
    with pytest.raises(ValueError, match="period must be an integer"):
        parse_optimizer("delayed_nesterov:lr=0.7,period=1.5")
    with pytest.raises(ValueError, match="outer optimizer"):
        spec.injectable()
    params = {"w": np.zeros(3, np.float32)}
    store = Store(params, optax.sgd(0.1), outer=spec.build())
    delta = {"w": np.ones(3, np.float32)}
    store.apply("delta", delta, 1.0)
    store.apply("delta", delta, 1.0)
    # plain 0.7 each; the second also adds 0.7 * 0.9 * (0.9 * 0 + 2)
    assert math.isclose(float(store.snapshot().tensors["w"][0]), 1.4 + 0.7 * 0.9 * 2, rel_tol=1e-6)
