"""Fixed-shape worker compute: micro-batched gradients equal the whole batch's, local steps run
the inner optimizer, and no batch size ever compiles a new shape."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from hetd.zoo.data import BatchSampler, load_dataset
from hetd.zoo.models import get_model
from hetd.zoo.optim import parse_optimizer
from hetd.zoo.steps import Steps, micro_batches


@pytest.fixture(scope="module")
def setup() -> tuple:
    data = load_dataset("digits", seed=0)
    model = get_model("mlp", data.num_classes, hidden=[16])
    params = {
        k: np.asarray(v) for k, v in model.init(jax.random.PRNGKey(0), data.input_shape).items()
    }
    return data, model, params


def _sampler(data) -> BatchSampler:  # type: ignore[no-untyped-def]
    return BatchSampler(data.x_train, data.y_train, seed=3)


@pytest.mark.parametrize("b", [1, 7, 8, 13, 40])
def test_micro_batched_gradient_equals_the_whole_batch(setup, b: int) -> None:  # type: ignore[no-untyped-def]
    data, model, params = setup
    steps = Steps(model, 8, parse_optimizer("sgd:lr=0.1"), jax.devices()[0])
    got = steps.gradient(params, _sampler(data).next, b)
    x, y = _sampler(data).next(b)
    loss, want = jax.value_and_grad(model.loss)(params, x, y)
    assert got.kind == "grad" and got.samples == b and got.steps == 1
    assert got.loss == pytest.approx(float(loss), rel=1e-5)
    for k in want:
        np.testing.assert_allclose(got.tensors[k], np.asarray(want[k]), rtol=2e-4, atol=1e-6)


def test_changing_the_batch_never_compiles_a_new_shape(setup) -> None:  # type: ignore[no-untyped-def]
    data, model, params = setup
    steps = Steps(model, 8, parse_optimizer("adam:lr=0.01"), jax.devices()[0])
    sampler = _sampler(data)
    steps.warm(params, data.x_train[:1], data.y_train[:1])
    compiled = dict(steps.traces)
    assert compiled == {"accumulate": 1, "apply": 1}  # warm compiled each kernel once
    for b in (3, 8, 9, 31, 64, 5):
        steps.gradient(params, sampler.next, b)
        steps.local_steps(params, sampler.next, b, 3, 0.5)
    assert steps.traces == compiled  # no batch size traced (compiled) anything again


def test_after_warm_no_step_compiles_anything(setup) -> None:  # type: ignore[no-untyped-def]
    """Counted with JAX's own compilation events, eager operations included. After a worker's
    warm-up its first push of two or more local steps compiled four subtractions (the delta, one
    per parameter shape, on the device) and the inner step again (its second call takes a state
    that came out of the kernel): 1.7-3 s on a loaded host, reported as compute (issue 14, S3b)."""
    data = setup[0]
    # shapes no other test uses, so nothing this process ran before has traced them
    model = get_model("mlp", data.num_classes, hidden=[19])
    params = {
        k: np.asarray(v) for k, v in model.init(jax.random.PRNGKey(0), data.input_shape).items()
    }
    steps = Steps(model, 8, parse_optimizer("sgd:lr=0.1"), jax.devices()[0])
    steps.warm(params, data.x_train[:1], data.y_train[:1])
    compiled: list[str] = []

    def count(name: str, _secs: float, **_kw: object) -> None:
        # traced, or lowered for XLA (a signature traced before but with other shardings: an
        # inner state that came out of a kernel is committed, a fresh one is not)
        if name.startswith("/jax/core/compile/"):
            compiled.append(name)

    jax.monitoring.register_event_duration_secs_listener(count)
    try:
        sampler = _sampler(data)
        steps.local_steps(params, sampler.next, 8, 2, 1.0)
        steps.gradient(params, sampler.next, 8)
        steps.local_steps(params, sampler.next, 13, 3, 0.5)
    finally:
        jax.monitoring.unregister_event_duration_listener(count)
    assert compiled == []


def test_local_sgd_steps_match_plain_sgd(setup) -> None:  # type: ignore[no-untyped-def]
    data, model, params = setup
    steps = Steps(model, 8, parse_optimizer("sgd:lr=0.1"), jax.devices()[0])
    got = steps.local_steps(params, _sampler(data).next, 12, 3, 0.5)
    sampler, p = _sampler(data), {k: np.asarray(v) for k, v in params.items()}
    for _ in range(3):
        x, y = sampler.next(12)
        g = jax.grad(model.loss)(p, x, y)
        p = {k: p[k] - 0.05 * np.asarray(g[k]) for k in p}
    assert got.kind == "delta" and got.samples == 36 and got.steps == 3
    for k in p:
        np.testing.assert_allclose(got.tensors[k], p[k] - params[k], rtol=1e-3, atol=1e-6)


def test_the_inner_adam_state_is_kept_across_rounds(setup) -> None:  # type: ignore[no-untyped-def]
    data, model, params = setup
    fresh = Steps(model, 8, parse_optimizer("adam:lr=0.01"), jax.devices()[0])
    kept = Steps(model, 8, parse_optimizer("adam:lr=0.01"), jax.devices()[0])
    kept.local_steps(params, _sampler(data).next, 8, 2, 1.0)  # a first round warms the moments
    a = fresh.local_steps(params, _sampler(data).next, 8, 1, 1.0)
    b = kept.local_steps(params, _sampler(data).next, 8, 1, 1.0)
    assert not np.allclose(a.tensors["Dense_0/kernel"], b.tensors["Dense_0/kernel"])
    # Adam's first step moves each weight by about lr (the moments' ratio is ±1).
    assert np.max(np.abs(a.tensors["Dense_0/kernel"])) == pytest.approx(0.01, rel=0.05)


def test_micro_batch_count() -> None:
    assert [micro_batches(b, 8) for b in (1, 8, 9, 16, 17)] == [1, 1, 2, 2, 3]
    with pytest.raises(ValueError, match="micro_batch"):
        Steps(get_model("mlp", 10, hidden=[4]), 0, parse_optimizer("sgd:lr=1"), jax.devices()[0])
