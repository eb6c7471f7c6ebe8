"""Fixed-shape worker compute (a bundled model as a Task, :mod:`hetd.zoo.task_steps`): micro-batched
gradients equal the whole batch's, local steps run the inner optimizer, and no batch size ever
compiles a new shape."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
import optax
import pytest

from hetd.zoo.bundled import ZooTask
from hetd.zoo.data import BatchSampler, load_dataset, shard_indices
from hetd.zoo.models import get_model
from hetd.zoo.optim import parse_optimizer
from hetd.zoo.task import Bound, Shard
from hetd.zoo.task_steps import BatchStream, TaskSteps, micro_batches

KEY = jax.random.PRNGKey(0)


def _bound(hidden: int = 16) -> tuple[Bound, Any, dict[str, np.ndarray]]:
    data = load_dataset("digits", seed=0)
    model = get_model("mlp", data.num_classes, hidden=[hidden])
    bound = Bound(ZooTask(model, data, 0))
    return bound, model, bound.init_flat()


@pytest.fixture(scope="module")
def setup() -> tuple[Bound, Any, dict[str, np.ndarray]]:
    return _bound()


def _stream(bound: Bound) -> BatchStream:
    return BatchStream(bound, Shard(0, 1, 0, 8))


def _sampler(bound: Bound) -> BatchSampler:
    """What the stream draws from: shard 0 of 1 (a seeded permutation), the sampler's seed 0."""
    data = bound.task.data  # type: ignore[attr-defined]
    idx = shard_indices(len(data.y_train), 0, 1, 0)
    return BatchSampler(data.x_train[idx], data.y_train[idx], seed=0)


def _steps(bound: Bound, spec: str) -> TaskSteps:
    return TaskSteps(bound, 8, parse_optimizer(spec).build(), jax.devices()[0])


@pytest.fixture(scope="module")
def sgd_steps(setup: Any) -> TaskSteps:
    """One SGD trainer for the gradient tests (a gradient keeps no state between calls): its
    kernels compiled once, as a worker's are, whatever the batch."""
    return _steps(setup[0], "sgd:lr=0.1")


# One size per path of a micro-batch of 8: a part of one (1), whole ones only (40: five), whole
# ones and a part (13, in the fast target); 7 and 8 ran the first two paths again. 1 and 40 in
# `make test`.
@pytest.mark.parametrize("b", [*(pytest.param(b, marks=pytest.mark.slow) for b in (1, 40)), 13])
def test_micro_batched_gradient_equals_the_whole_batch(
    setup: Any, sgd_steps: TaskSteps, b: int
) -> None:
    bound, model, params = setup
    got = sgd_steps.gradient(params, _stream(bound), b, KEY)
    x, y = _sampler(bound).next(b)
    loss, want = jax.jit(jax.value_and_grad(model.loss))(params, x, y)  # the whole batch at once
    assert got.kind == "grad" and got.samples == b and got.steps == 1
    assert got.loss == pytest.approx(float(loss), rel=1e-5)
    for k in want:
        np.testing.assert_allclose(got.tensors[k], np.asarray(want[k]), rtol=2e-4, atol=1e-6)


def test_changing_the_batch_never_compiles_a_new_shape(setup: Any) -> None:
    bound, _, params = setup
    steps = _steps(bound, "adam:lr=0.01")
    stream = _stream(bound)
    steps.warm(params, stream, KEY)
    compiled = dict(steps.traces)
    assert compiled == {"accumulate": 1, "apply": 1}  # warm compiled each kernel once
    for b in (3, 8, 9, 31, 64, 5):
        steps.gradient(params, stream, b, KEY)
        steps.local_steps(params, stream, b, 3, 0.5, KEY)
    assert steps.traces == compiled  # no batch size traced (compiled) anything again


@pytest.mark.slow  # trains a model for seconds: `make test` runs it, `make test-fast` does not
def test_after_warm_no_step_compiles_anything() -> None:
    """Counted with JAX's own compilation events, eager operations included. After a worker's
    warm-up its first push of two or more local steps compiled four subtractions (the delta, one
    per parameter shape, on the device) and the inner step again (its second call takes a state
    that came out of the kernel): 1.7-3 s on a loaded host, reported as compute."""
    bound, _, params = _bound(hidden=19)  # shapes no other test uses: nothing traced them yet
    steps = _steps(bound, "sgd:lr=0.1")
    stream = _stream(bound)
    steps.warm(params, stream, KEY)
    compiled: list[str] = []

    def count(name: str, _secs: float, **_kw: object) -> None:
        # traced, or lowered for XLA (a signature traced before but with other shardings: an
        # inner state that came out of a kernel is committed, a fresh one is not)
        if name.startswith("/jax/core/compile/"):
            compiled.append(name)

    jax.monitoring.register_event_duration_secs_listener(count)
    try:
        steps.local_steps(params, stream, 8, 2, 1.0, KEY)
        steps.gradient(params, stream, 8, KEY)
        steps.local_steps(params, stream, 13, 3, 0.5, KEY)
    finally:
        jax.monitoring.unregister_event_duration_listener(count)
    assert compiled == []


@pytest.mark.slow  # compiles and runs local steps against plain SGD: `make test` runs it, `make test-fast` does not
def test_local_sgd_steps_match_plain_sgd(setup: Any) -> None:
    bound, model, params = setup
    got = _steps(bound, "sgd:lr=0.1").local_steps(params, _stream(bound), 12, 3, 0.5, KEY)
    sampler, p = _sampler(bound), {k: np.asarray(v) for k, v in params.items()}
    for _ in range(3):
        x, y = sampler.next(12)
        g = jax.grad(model.loss)(p, x, y)
        p = {k: p[k] - 0.05 * np.asarray(g[k]) for k in p}
    assert got.kind == "delta" and got.samples == 36 and got.steps == 3
    for k in p:
        np.testing.assert_allclose(got.tensors[k], p[k] - params[k], rtol=1e-3, atol=1e-6)


def test_the_inner_adam_state_is_kept_across_rounds(setup: Any) -> None:
    bound, _, params = setup
    fresh = _steps(bound, "adam:lr=0.01")
    kept = _steps(bound, "adam:lr=0.01")
    kept.local_steps(params, _stream(bound), 8, 2, 1.0, KEY)  # a first round warms the moments
    a = fresh.local_steps(params, _stream(bound), 8, 1, 1.0, KEY)
    b = kept.local_steps(params, _stream(bound), 8, 1, 1.0, KEY)
    assert not np.allclose(a.tensors["Dense_0/kernel"], b.tensors["Dense_0/kernel"])
    # Adam's first step moves each weight by about lr (the moments' ratio is ±1).
    assert np.max(np.abs(a.tensors["Dense_0/kernel"])) == pytest.approx(0.01, rel=0.05)


def test_a_task_of_whole_batches_rounds_a_plan_up_to_micro_batches(setup: Any) -> None:
    """Without ``per_example`` (a loss over the whole batch) a plan takes whole micro-batches."""
    bound, _, params = setup
    task = bound.task
    whole = Bound(type(task)(task.model, task.data, 0))  # type: ignore[attr-defined]
    whole.task.per_example = False
    got = TaskSteps(whole, 8, optax.sgd(0.1), jax.devices()[0]).gradient(
        params, _stream(whole), 13, KEY
    )
    assert got.samples == 16


def test_micro_batch_count() -> None:
    assert [micro_batches(b, 8) for b in (1, 8, 9, 16, 17)] == [1, 1, 2, 2, 3]
    bound, _, _ = _bound()
    with pytest.raises(ValueError, match="micro_batch"):
        TaskSteps(bound, 0, optax.sgd(1.0), jax.devices()[0])
