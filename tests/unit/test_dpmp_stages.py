"""Pipeline stages in JAX: stage-wise gradients over micro-batches equal the whole model's."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hetd.sim.dpmp import mlp_blocks as sim_mlp_blocks
from hetd.zoo.blocks import mlp_blocks, transformer_blocks
from hetd.zoo.stages import (
    StageRunner,
    as_model,
    block_costs,
    init_blocks,
    make_stages,
    run_1f1b,
    slice_params,
)

MLP = mlp_blocks(10, hidden=(32, 24, 16))  # 4 blocks


def _batch(m: int, big_m: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    xs = rng.normal(size=(big_m, m, 20)).astype(np.float32)
    ys = rng.integers(0, 10, size=(big_m, m)).astype(np.int32)
    return xs, ys


def _whole_grad(model_params: Any, xs: np.ndarray, ys: np.ndarray) -> Any:
    model = as_model(MLP)
    x = xs.reshape((-1, *xs.shape[2:]))
    y = ys.reshape(-1)
    return jax.jit(jax.grad(model.loss))(model_params, x, y)


PARAMS = init_blocks(MLP, jax.random.key(0), (20,))
STAGES = {cuts: make_stages(MLP, cuts) for cuts in [(0, 2, 4), (0, 1, 3, 4)]}  # compiled once


@pytest.mark.parametrize("cuts", sorted(STAGES))
def test_stage_gradients_equal_the_whole_model_gradient(cuts: tuple[int, ...]) -> None:
    stages = STAGES[cuts]
    slices = [set(st.slice(PARAMS)) for st in stages]
    assert set().union(*slices) == set(PARAMS)  # the slices cover the model ...
    assert sum(len(s) for s in slices) == len(PARAMS)  # ... and are disjoint
    xs, ys = _batch(8, 5)
    out = run_1f1b(stages, PARAMS, xs, ys)
    want = _whole_grad(PARAMS, xs, ys)
    assert set(out.grads) == set(want)
    for k in want:
        np.testing.assert_allclose(out.grads[k], want[k], atol=1e-5, rtol=1e-5)
    loss = float(
        as_model(MLP).loss(PARAMS, jnp.asarray(xs.reshape(-1, 20)), jnp.asarray(ys.reshape(-1)))
    )
    assert out.loss == pytest.approx(loss, rel=1e-5)
    n = len(stages)
    # 1F1B: stage s never holds more than S - s micro-batches' residuals; every micro-batch
    # goes forward then backward once on every stage
    assert all(p <= n - s for s, p in enumerate(out.peak_inflight))
    assert out.peak_inflight[0] == n  # warm-up S - 1 forwards, then one more before a backward
    for s in range(n):
        assert sorted(mb for st, kind, mb in out.trace if st == s and kind == "F") == list(range(5))
        assert sorted(mb for st, kind, mb in out.trace if st == s and kind == "B") == list(range(5))


def test_a_different_number_of_micro_batches_does_not_recompile() -> None:
    stages = STAGES[(0, 1, 3, 4)]
    run_1f1b(stages, PARAMS, *_batch(8, 2))
    first = [dict(st.traces) for st in stages]
    assert first[0] == {"fwd": 1, "bwd": 1, "last": 0}
    assert first[-1] == {"fwd": 0, "bwd": 0, "last": 1}
    xs, ys = _batch(8, 7, seed=2)
    out = run_1f1b(stages, PARAMS, xs, ys, inflight=(5, 2, 1))  # caps raised to hide latency
    assert [dict(st.traces) for st in stages] == first
    assert out.peak_inflight == (5, 2, 0)  # the last stage fuses forward and backward
    want = _whole_grad(PARAMS, xs, ys)
    for k in want:
        np.testing.assert_allclose(out.grads[k], want[k], atol=1e-5, rtol=1e-5)


@pytest.mark.slow  # trains a model for seconds: `make test` runs it, `make test-fast` does not
def test_the_transformer_as_blocks_pipelines_exactly() -> None:
    bm = transformer_blocks(16, d_model=16, layers=2, heads=2)
    assert [name for name, _ in bm.blocks] == ["embed", "layer0", "layer1", "head"]
    params = init_blocks(bm, jax.random.key(3), (6,))
    rng = np.random.default_rng(4)
    xs = rng.integers(0, 16, size=(3, 2, 6)).astype(np.float32)
    ys = rng.integers(0, 16, size=(3, 2, 6)).astype(np.int32)
    out = run_1f1b(make_stages(bm, (0, 2, 4)), params, xs, ys)
    model = as_model(bm)
    want = jax.jit(jax.grad(model.loss))(params, xs.reshape(-1, 6), ys.reshape(-1, 6))
    for k in want:
        np.testing.assert_allclose(out.grads[k], want[k], atol=1e-5, rtol=1e-4)


def test_block_costs_come_from_shapes() -> None:
    costs = block_costs(MLP, PARAMS, (20,))
    assert [c.param_bytes for c in costs] == [
        4.0 * (20 * 32 + 32),
        4.0 * (32 * 24 + 24),
        4.0 * (24 * 16 + 16),
        4.0 * (16 * 10 + 10),
    ]
    assert [c.act_bytes for c in costs] == [128.0, 96.0, 64.0, 40.0]
    assert all(c.flops > 0 for c in costs)
    assert costs[0].flops > costs[3].flops  # 20x32 matmul against 16x10
    assert set(slice_params(PARAMS, 1, 2)) == {"b01/Dense_0/kernel", "b01/Dense_0/bias"}


def test_bad_cuts_are_refused() -> None:
    with pytest.raises(ValueError, match="must run from 0 to 4"):
        make_stages(MLP, (0, 2))
    with pytest.raises(ValueError, match="out of"):
        make_stages(MLP, (0, 2, 2, 4))


def test_stage_runners_take_messages_in_any_order() -> None:
    stages = STAGES[(0, 1, 3, 4)]
    xs, ys = _batch(8, 4, seed=5)
    runners = [
        StageRunner(stages[0], PARAMS, 4, inputs=lambda mb: xs[mb]),
        StageRunner(stages[1], PARAMS, 4),
        StageRunner(stages[2], PARAMS, 4, labels=lambda mb: ys[mb]),
    ]
    mail = [(0, m) for m in runners[0].start()]
    while mail:  # newest first: the relay keeps no order across links
        src, (kind, mb, array) = mail.pop()
        dst = src + 1 if kind == "act" else src - 1
        mail += [(dst, m) for m in runners[dst].offer(kind, mb, array)]
    got = {k: v for r in runners for k, v in r.grads().items()}
    want = _whole_grad(PARAMS, xs, ys)
    for k in want:
        np.testing.assert_allclose(got[k], want[k], atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="takes no 'act'"):
        runners[0].offer("act", 0, xs[0])
    with pytest.raises(ValueError, match="needs its inputs"):
        StageRunner(stages[0], PARAMS, 4)
    with pytest.raises(ValueError, match="not finished"):
        StageRunner(stages[1], PARAMS, 4).grads()


def test_the_simulators_mlp_spec_matches_the_real_blocks() -> None:
    bm = mlp_blocks(10, hidden=(512, 512, 512))
    shapes = jax.eval_shape(lambda k: init_blocks(bm, k, (784,)), jax.random.key(0))  # no run
    real = block_costs(bm, shapes, (784,))
    hand = sim_mlp_blocks()
    assert [b.param_bytes for b in real] == [b.param_bytes for b in hand]
    assert [b.act_bytes for b in real] == [b.act_bytes for b in hand]
    shares = [b.flops / sum(c.flops for c in real) for b in real]
    assert shares == pytest.approx([b.flops / sum(c.flops for c in hand) for b in hand], rel=1e-3)
