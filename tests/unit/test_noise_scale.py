"""The gradient noise scale the engine measures from pairs of gradient pushes at the same base
version (:class:`hetd.core.noise.GradientNoise`), in the part and through a real engine (a real
store, plain SGD, ASP, a fake clock): the estimator's exact numbers, and what changes nothing."""

from __future__ import annotations

import numpy as np
import optax
import pytest

from hetd.core import Engine
from hetd.core.noise import GradientNoise
from hetd.core.store import Int8, Store
from hetd.protocol.messages import PushIn
from policies import make_policy
from policies.efficiency import NoiseScale
from tests.conftest import FakeClock
from tests.unit.test_engine import CONFIG, SHAPES, RecordingPeer, hello


def grads(seed: int) -> dict[str, np.ndarray]:
    """A batch's gradient: a common mean (1) plus its own noise."""
    rng = np.random.default_rng(seed)
    return {k: (1.0 + 0.5 * rng.normal(size=s)).astype(np.float32) for k, s in SHAPES.items()}


def reduced(g1: dict[str, np.ndarray], g2: dict[str, np.ndarray]) -> tuple[float, float, float]:
    """|g1|², |g2|², g1·g2 over all tensors, in float64."""
    f1 = np.concatenate([g1[k].ravel() for k in SHAPES]).astype(np.float64)
    f2 = np.concatenate([g2[k].ravel() for k in SHAPES]).astype(np.float64)
    return float(f1 @ f1), float(f2 @ f2), float(f1 @ f2)


def assert_same(got: NoiseScale, want: NoiseScale) -> None:
    assert got.pairs == want.pairs
    assert got.signal == pytest.approx(want.signal, rel=1e-5)
    assert got.noise == pytest.approx(want.noise, rel=1e-5)
    assert got.weight == pytest.approx(want.weight)


def test_a_pair_at_one_base_gives_the_estimators_numbers() -> None:
    noise = GradientNoise(estimator=NoiseScale(min_pairs=1))
    g1, g2, g3 = grads(1), grads(2), grads(3)
    noise.push(0, 5, 8, g1, None)
    assert noise.pairs == 0 and noise.value is None
    noise.push(1, 5, 16, g2, None)
    want = NoiseScale(min_pairs=1).add(*reduced(g1, g2), 8, 16)
    assert_same(noise.estimator, want)
    # the last push is the one kept: a third worker's pairs with the second
    noise.push(2, 5, 8, g3, None)
    want = want.add(*reduced(g2, g3), 16, 8)
    assert_same(noise.estimator, want)
    assert want.value is not None and noise.value == pytest.approx(want.value, rel=1e-5)


def test_different_bases_the_same_worker_and_older_pushes_give_no_pair() -> None:
    noise = GradientNoise()
    noise.push(0, 5, 8, grads(1), None)
    noise.push(1, 6, 8, grads(2), None)  # a newer base replaces the held push
    noise.push(0, 5, 8, grads(3), None)  # an older base than the held one: passed over
    noise.push(1, 6, 8, grads(4), None)  # the same worker at the same base: no pair
    assert noise.pairs == 0 and noise.estimator == NoiseScale()


def test_pushes_not_finite_or_not_measured_change_nothing() -> None:
    noise = GradientNoise(max_params=8)
    bad = grads(1)
    bad["dense/b"][0] = np.nan
    inf = grads(2)
    inf["dense/w"][1, 1] = np.inf
    noise.push(0, 3, 8, bad, None)
    noise.push(1, 3, 8, inf, None)
    q = {k: Int8(np.ones(s, np.int8), np.float32(0.1)) for k, s in SHAPES.items()}
    noise.push(2, 3, 8, q, None)  # int8 views: not measured
    noise.push(3, 3, 8, {}, None)  # no tensors (the parts went to pservers)
    noise.push(4, 3, 8, grads(3), None)  # within max_params (8): held
    noise.push(5, 3, 8, grads(4), float("nan"))  # a norm ingest measured as NaN
    assert noise.pairs == 0
    big = GradientNoise(max_params=7)  # the model has 8 parameters
    big.push(0, 3, 8, grads(1), None)
    big.push(1, 3, 8, grads(2), None)
    assert big.pairs == 0
    # the NaN and inf pushes were not held: the next two good ones make the first pair
    noise.push(6, 3, 8, grads(5), None)
    assert noise.pairs == 1


def test_the_engine_measures_pairs_of_pushes_and_shows_the_estimate() -> None:
    params = {k: np.zeros(s, np.float32) for k, s in SHAPES.items()}
    clock = FakeClock()
    engine = Engine(Store(params, optax.sgd(0.0)), make_policy("asp"), CONFIG, clock)
    a = engine.join(hello("a"), RecordingPeer())
    b = engine.join(hello("b"), RecordingPeer())
    assert engine.view().noise_scale is None
    status = engine.status()
    assert status["noise_scale"] is None and status["noise_pairs"] == 0
    want = NoiseScale()
    pid = 0

    def push(wid: int, base: int, g: dict[str, np.ndarray], kind: str = "grad") -> None:
        nonlocal pid
        pid += 1
        engine.push(PushIn(wid, pid, base, kind, g, 8, 1, 0.1, None, None, 100))

    for r in range(want.min_pairs):
        base = engine.store.version
        g1, g2 = grads(10 + 2 * r), grads(11 + 2 * r)
        push(a, base, g1)
        push(b, base, g2)  # ASP applied a's: b's is one version stale, at the same base
        want = want.add(*reduced(g1, g2), 8, 8)
    # a delta at the same base as a gradient is no pair
    base = engine.store.version
    push(a, base, grads(50))
    push(b, base, grads(51), kind="delta")
    assert_same(engine.noise.estimator, want)
    assert want.value is not None
    assert engine.view().noise_scale == pytest.approx(want.value, rel=1e-5)
    status = engine.status()
    assert status["noise_pairs"] == want.min_pairs
    assert status["noise_scale"] == pytest.approx(want.value, rel=1e-5)
