"""The bundled workloads beyond the MLP: the ``pydoc`` byte corpus and the ``transformer`` LM (its
shapes, sizes and causality, training through the workers' fixed-shape steps), and ``cnn`` on
full MNIST."""

from __future__ import annotations

import math
import subprocess
import sys
from typing import Any

import jax
import numpy as np
import optax
import pytest

from hetd.sim.results import first_above, first_below, grid_time_to_target, time_to_target
from hetd.sim.scenario import ScenarioError, from_mapping, load_scenario
from hetd.zoo.bundled import ZooTask
from hetd.zoo.data import load_dataset
from hetd.zoo.lm import SIZES
from hetd.zoo.models import get_model
from hetd.zoo.optim import parse_optimizer
from hetd.zoo.task import Bound, Shard
from hetd.zoo.task_steps import BatchStream, TaskSteps
from hetd.zoo.text import pydoc_bytes

TINY = {"d_model": 32, "layers": 1, "heads": 2}


def test_pydoc_windows_are_next_byte_pairs_of_the_corpus() -> None:
    data = load_dataset("pydoc", context=32)
    assert data.num_classes == 256 and data.input_shape == (32,)
    assert data.y_train.shape == data.x_train.shape and data.y_test.shape == data.x_test.shape
    # labels are the inputs shifted by one byte, and inputs are exact byte values
    np.testing.assert_array_equal(data.y_train[:, :-1], data.x_train[:, 1:].astype(np.int32))
    np.testing.assert_array_equal(data.x_train, np.rint(data.x_train))
    assert data.x_train.min() >= 0 and data.x_train.max() < 256
    # the whole corpus is used (train windows half-overlap, validation ones do not)
    total = len(pydoc_bytes())
    seen = len(data.x_train) * 16 + len(data.x_test) * 32
    assert 0.9 * total < seen <= total


def test_pydoc_split_is_fixed_and_validation_text_is_held_out() -> None:
    a = load_dataset("pydoc", seed=0, context=16, max_bytes=60_000)
    b = load_dataset("pydoc", seed=7, context=16, max_bytes=60_000)
    np.testing.assert_array_equal(a.x_test, b.x_test)  # the seed never moves the split
    train = {row.tobytes() for row in a.x_train}
    held = [row.tobytes() for row in a.x_test]
    # blocks of 4 KB: only a window straddling two held-out blocks could repeat train text
    assert sum(h in train for h in held) <= 2
    with pytest.raises(ValueError, match="context"):
        load_dataset("pydoc", context=1)


def test_loading_text_imports_neither_jax_nor_scikit_learn() -> None:
    code = (
        "import sys; from hetd.zoo.data import load_dataset; load_dataset('pydoc');"
        "bad = [m for m in ('jax', 'sklearn') if m in sys.modules]; assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize(("size", "millions"), [("0.5m", 0.5), ("2m", 2.0), ("10m", 10.0)])
def test_transformer_sizes_have_their_parameter_counts(size: str, millions: float) -> None:
    model = get_model("transformer", 256, size=size)
    shapes = jax.eval_shape(lambda k: model.init(k, (128,)), jax.random.PRNGKey(0))  # no compute
    count = sum(math.prod(s.shape) for s in shapes.values())
    assert abs(count / 1e6 - millions) / millions < 0.1
    assert set(SIZES) == {"0.5m", "2m", "10m"}


def test_transformer_options_are_checked() -> None:
    with pytest.raises(ValueError, match="unknown transformer size"):
        get_model("transformer", 256, size="3m")
    with pytest.raises(ValueError, match="multiple of heads"):
        get_model("transformer", 256, d_model=30, layers=1, heads=4)


@pytest.mark.slow  # trains a model for seconds: `make test` runs it, `make test-fast` does not
def test_transformer_is_causal() -> None:
    model = get_model("transformer", 256, **TINY)
    params = jax.jit(model.init, static_argnums=1)(jax.random.PRNGKey(1), (16,))
    x = np.arange(32, dtype=np.float32).reshape(2, 16) + 65
    changed = x.copy()
    changed[:, 10] = 0  # a later byte must not change any earlier prediction
    logits = jax.jit(model.logits)
    a, b = np.asarray(logits(params, x)), np.asarray(logits(params, changed))
    np.testing.assert_allclose(a[:, :10], b[:, :10], rtol=1e-5, atol=1e-5)
    assert not np.allclose(a[:, 10:], b[:, 10:])
    assert a.shape == (2, 16, 256)


@pytest.mark.slow  # trains a model for seconds: `make test` runs it, `make test-fast` does not
def test_a_tiny_transformer_learns_text_through_the_workers_steps() -> None:
    data = load_dataset("pydoc", context=32, max_bytes=100_000)
    model = get_model("transformer", data.num_classes, **TINY)
    init = jax.jit(model.init, static_argnums=1)
    params = {k: np.asarray(v) for k, v in init(jax.random.PRNGKey(0), (32,)).items()}
    bound = Bound(ZooTask(model, data, 0))  # the bundled model as the workers run it
    steps = TaskSteps(bound, 8, parse_optimizer("adam:lr=0.01").build(), jax.devices()[0])
    loss = jax.jit(model.loss)
    before = float(loss(params, data.x_test, data.y_test))
    stream = BatchStream(bound, Shard(0, 1, 0, 8))
    for _ in range(2):  # 2 pushes of 25 local steps of 8 windows (one fixed-shape call each)
        delta = steps.local_steps(params, stream, 8, 25, 1.0, jax.random.PRNGKey(0))
        params = {k: params[k] + delta.tensors[k] for k in params}
    after = float(loss(params, data.x_test, data.y_test))
    assert before > math.log(256) - 0.5  # starts near uniform over bytes (8 bits per byte)
    assert after / math.log(2) < 5.0  # bits per byte on held-out text: it learned the bytes
    assert steps.traces == {"accumulate": 1, "apply": 1}  # fixed shapes: compiled once each


@pytest.mark.slow  # trains a model for seconds: `make test` runs it, `make test-fast` does not
def test_cnn_takes_full_mnist_and_learns() -> None:
    data = load_dataset("mnist")
    assert data.x_train.shape == (60000, 784) and data.x_test.shape == (10000, 784)
    model = get_model("cnn", data.num_classes, features=[4], dense=16)
    params = jax.jit(model.init, static_argnums=1)(jax.random.PRNGKey(0), (784,))
    x, y = data.x_train[:256], data.y_train[:256]
    tx = optax.adam(0.01)
    state = tx.init(params)

    @jax.jit
    def step(params: Any, state: Any) -> Any:
        loss, g = jax.value_and_grad(model.loss)(params, x, y)
        updates, state = tx.update(g, state)
        return optax.apply_updates(params, updates), state, loss

    params, state, first = step(params, state)
    for _ in range(30):  # full-batch Adam on 256 images
        params, state, loss = step(params, state)
    assert float(loss) < 0.5 * float(first)


def test_a_loss_target_is_reached_between_evaluations() -> None:
    curve = [[0.0, 5.0], [0.5, 3.0], [1.0, 1.0], [1.5, 0.5]]
    assert first_below(curve, 2.0) == pytest.approx(0.75)  # halfway from 3.0 down to 1.0
    assert first_below(curve, 1.0) == pytest.approx(1.0)  # exactly on an evaluation
    assert first_below(curve, 6.0) == 0.0  # already there at the first evaluation
    assert first_below(curve, 0.1) is None
    # a loss that goes up again: the first crossing counts
    assert first_below([[0, 3.0], [1, 1.0], [2, 4.0], [3, 0.5]], 2.0) == pytest.approx(0.5)


def test_an_accuracy_target_is_reached_between_evaluations() -> None:
    curve = [[0.0, 0.1], [0.5, 0.8], [1.0, 0.9], [1.5, 0.95]]
    assert first_above(curve, 0.85) == pytest.approx(0.75)  # halfway from 0.8 up to 0.9
    assert first_above(curve, 0.9) == pytest.approx(1.0)  # exactly on an evaluation
    assert first_above(curve, 0.05) == 0.0  # already there at the first evaluation
    assert first_above(curve, 0.99) is None
    # an accuracy that falls back: the first crossing counts
    assert first_above([[0, 0.5], [1, 0.9], [2, 0.4], [3, 0.95]], 0.7) == pytest.approx(0.5)
    # the evaluation grid, as older tables read it
    assert grid_time_to_target(curve, 0.85) == 1.0


def test_time_to_target_picks_the_scenarios_kind() -> None:
    evals = [(0.0, 2.3, 0.1), (0.5, 1.5, 0.8), (1.0, 0.9, 0.93)]  # (t, loss, accuracy)
    # accuracy: between the last evaluation below and the first at or above, as a loss is read
    assert time_to_target(evals, 0.9) == pytest.approx(0.5 + 0.5 * 0.1 / 0.13)
    assert time_to_target(evals, 0.9, target_loss=1.0) == pytest.approx(0.5 + 0.5 * 5 / 6)


def test_scenarios_take_a_loss_target() -> None:
    sc = load_scenario("S7")
    assert sc.target_loss > 0 and sc.model == "transformer" and sc.dataset == "pydoc"
    assert [w.bandwidth for w in sc.workers] == [1e8, 5e7, 2e7, 1e7]
    assert load_scenario("S1").target_loss == 0.0  # accuracy scenarios are unchanged
    assert load_scenario("S1").target_text == "accuracy 0.9"
    assert sc.target_text == "loss 2.4 (3.46 bits per byte)"
    raw = {"name": "x", "dataset": "pydoc", "model": "transformer", "workers": [{}]}
    assert from_mapping({**raw, "target_loss": 1.5}).target_loss == 1.5
    with pytest.raises(ScenarioError, match="target_loss"):
        from_mapping({**raw, "target_loss": -1.0})


def test_a_loss_scenario_has_no_accuracy_ideal() -> None:
    from hetd.bench.sweep import ideal_tta

    # the single-process count is measured against accuracy: a loss scenario reports none (and
    # does not train one process for 200 epochs towards an accuracy it never asked for)
    assert ideal_tta(load_scenario("S7"), [0.002], [0]) is None
