"""The Task API's parts in one process: loading (and every way it fails), parameter layouts of any
pytree, targets, the checked batch stream, the worker's kernels, the optimizer on the user's own
structure, and the daemon/worker task comparison."""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from hetd import Shard, Task, TaskError
from hetd.core.store import Store
from hetd.zoo.task import Bound, Target, load_task
from hetd.zoo.task_steps import BatchStream, TaskSteps
from hetd.zoo.trees import Layout

X = np.random.default_rng(0).normal(size=(96, 3)).astype(np.float32)
Y = (X @ np.array([1.0, -2.0, 0.5], np.float32)).astype(np.float32)


def _init(key: jax.Array) -> Any:
    return {"dense": {"w": jnp.zeros(3), "b": jnp.zeros(())}, "extra": [jnp.ones((2, 2))]}


def _loss(params: Any, batch: Any, key: jax.Array) -> Any:
    pred = batch["x"] @ params["dense"]["w"] + params["dense"]["b"]
    mse = jnp.mean((pred - batch["y"]) ** 2) + 0.0 * jnp.sum(params["extra"][0])
    return mse, {"mse": mse}


def _train(shard: Shard) -> Any:
    rows = list(shard.slice(len(X)))
    for i in range(0, len(rows) - shard.batch_size + 1, shard.batch_size):
        r = rows[i : i + shard.batch_size]
        yield {"x": X[r], "y": Y[r]}


def _task(**kw: Any) -> Task:
    return Task(_init, _loss, _train, **kw)


def _write(tmp_path: Path, name: str, body: str) -> str:
    path = tmp_path / f"{name}.py"
    path.write_text(textwrap.dedent(body))
    return str(path)


GOOD = """
    import jax.numpy as jnp
    from hetd import Task
    def make():
        return Task(lambda k: {"w": jnp.zeros(2)}, lambda p, b, k: jnp.sum(p["w"]), lambda s: iter(()))
    task = make()
"""


def test_load_task_by_file_and_by_function(tmp_path: Path) -> None:
    path = _write(tmp_path, "mytask", GOOD)
    task = load_task(f"{path}:task")
    assert isinstance(task, Task) and task.name == "mytask:task"
    built = load_task(f"{path}:make")
    assert built.name == "mytask:make"


def test_a_task_file_never_shadows_a_module_of_pythons(tmp_path: Path) -> None:
    import token

    path = _write(tmp_path, "token", GOOD)  # the standard library has a module "token"
    assert load_task(f"{path}:task").name == "token:task"
    import sys

    assert sys.modules["token"] is token and sys.path.index(str(tmp_path)) > 0


def test_load_task_by_module_from_the_working_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _write(tmp_path, "wd_task_mod", GOOD)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert load_task("wd_task_mod:task").name == "wd_task_mod:task"


@pytest.mark.parametrize(
    ("body", "attr", "says"),
    [
        (None, "task", "cannot import 'no_such_module_xyz'"),
        ("x = 1\n", "task", "has no attribute 'task'"),
        ("task = 3\n", "task", "is a int, not a hetd.Task"),
        ("def task():\n    raise RuntimeError('boom')\n", "task", "building the task failed"),
        ("def task():\n    return 3\n", "task", "returned a int, not a hetd.Task"),
        ("def broken(:\n", "task", "importing"),
    ],
)
def test_load_task_errors_name_the_spec(
    tmp_path: Path, body: str | None, attr: str, says: str
) -> None:
    spec = "no_such_module_xyz:task" if body is None else f"{_write(tmp_path, 'bad', body)}:{attr}"
    with pytest.raises(TaskError, match="task '") as err:
        load_task(spec)
    assert says in str(err.value) and "\n" not in str(err.value)


def test_a_spec_without_attribute_is_refused() -> None:
    with pytest.raises(TaskError, match="must look like"):
        load_task("just_a_module")


def test_layout_round_trips_any_pytree_and_names_paths() -> None:
    tree = _init(jax.random.PRNGKey(0))
    layout = Layout(tree)
    assert layout.names == ("dense/b", "dense/w", "extra/0")
    assert layout.shapes["dense/b"] == ()
    back = layout.unflatten(layout.flatten(tree))
    assert jax.tree.structure(back) == jax.tree.structure(tree)


def test_layout_refuses_integer_leaves_and_empty_trees() -> None:
    with pytest.raises(ValueError, match="not a floating-point array"):
        Layout({"step": jnp.zeros((), jnp.int32)})
    with pytest.raises(ValueError, match="no arrays"):
        Layout({})


def test_fingerprint_follows_names_and_shapes() -> None:
    a = Bound(_task(name="t"))
    b = Bound(Task(lambda k: {**_init(k), "more": jnp.zeros(1)}, _loss, _train, name="t"))
    assert a.fingerprint == Bound(_task(name="t")).fingerprint
    assert a.fingerprint != b.fingerprint
    assert a.fingerprint != Bound(_task(name="u")).fingerprint


def test_init_that_fails_is_one_task_error() -> None:
    def bad(key: jax.Array) -> Any:
        raise RuntimeError("no weights here")

    with pytest.raises(TaskError, match="init failed: RuntimeError: no weights here"):
        Bound(Task(bad, _loss, _train, name="t"))


def test_a_loss_that_is_not_a_scalar_is_refused() -> None:
    bound = Bound(Task(_init, lambda p, b, k: b["x"] @ p["dense"]["w"], _train, name="t"))
    batch = next(_train(Shard(0, 1, 0, 8)))
    with pytest.raises(TaskError, match=r"loss must return a scalar.*got shape \(8,\)"):
        jax.jit(bound.loss_flat)(bound.init_flat(), batch, jax.random.PRNGKey(0))


def test_target_parse_and_reached() -> None:
    t = Target.parse({"metric": "r2", "mode": "max", "value": 0.9})
    assert t is not None and t.reached({"r2": 0.95}) and not t.reached({"r2": float("nan")})
    low = Target.parse({"metric": "mse", "mode": "min", "value": 0.1})
    assert low is not None and low.reached({"mse": 0.05}) and not low.reached({"loss": 0.0})
    loss = Target.parse({"metric": "loss", "value": 0.1})  # loss and accuracy need no mode
    assert loss is not None and loss.mode == "min"
    for bad in ({"metric": "x", "mode": "up", "value": 1}, {"metric": "x", "value": "1"}, {"m": 1}):
        with pytest.raises(TaskError):
            Target.parse(bad)
    with pytest.raises(TaskError, match="'r2' needs a mode"):  # not guessed: r2 is a max
        Target.parse({"metric": "r2", "value": 0.5})


def test_shard_slices_cover_the_data_whatever_the_count() -> None:
    for n, count in ((10, 3), (7, 7), (100, 4)):
        rows = [r for i in range(count) for r in Shard(i, count, 0, 1).slice(n)]
        assert rows == list(range(n))


def test_a_data_share_reaches_train_data_every_epoch() -> None:
    seen: list[Shard] = []

    def data(shard: Shard) -> Any:
        seen.append(shard)
        yield {"x": np.zeros((4, 1), np.float32)}

    bound = Bound(Task(_init, _loss, data, name="t"))
    stream = BatchStream(bound, Shard(0, 2, 0, 4, share=(0.25, 0.5)))
    stream.next()
    stream.next()
    assert [s.share for s in seen] == [(0.25, 0.5), (0.25, 0.5)]
    assert Shard(0, 2, 0, 4, share=(0.25, 0.5)).slice(100) == range(25, 75)


def test_nnx_evaluations_run_the_module_in_eval_mode() -> None:
    from flax import nnx

    class Net(nnx.Module):
        def __init__(self, rngs: nnx.Rngs) -> None:
            self.dense = nnx.Linear(3, 1, rngs=rngs)
            self.drop = nnx.Dropout(0.5)

        def __call__(self, x: jax.Array, key: jax.Array) -> jax.Array:
            return self.drop(self.dense(x), rngs=nnx.Rngs(dropout=key))

    def loss_fn(model: Any, batch: Any, key: jax.Array) -> jax.Array:
        return jnp.mean(model(batch["x"], key) ** 2)

    bound = Bound(Task.from_nnx(Net, loss_fn, _train, name="drop"))
    flat = bound.init_flat()
    batch = {"x": X[:16], "y": Y[:16]}
    keys = [jax.random.PRNGKey(i) for i in range(2)]
    train = [float(jax.jit(bound.loss_flat)(flat, batch, k)[0]) for k in keys]
    evals = [float(jax.jit(bound.eval_flat)(flat, batch, k)[0]) for k in keys]
    assert train[0] != train[1]  # dropout on while training, a mask per key
    assert evals[0] == evals[1]  # and off for evaluations


def test_stream_starts_a_new_epoch_on_the_next_shard() -> None:
    seen: list[Shard] = []

    def data(shard: Shard) -> Any:
        seen.append(shard)
        yield {"x": np.full((4, 1), shard.index, np.float32)}

    stream = BatchStream(Bound(Task(_init, _loss, data, name="t")), Shard(1, 3, 0, 4))
    firsts = [float(stream.next()["x"][0, 0]) for _ in range(4)]
    assert firsts == [1.0, 2.0, 0.0, 1.0]  # every shard read by this one worker
    assert [s.epoch for s in seen] == [0, 1, 2, 3]


@pytest.mark.parametrize(
    ("data", "says"),
    [
        (lambda s: iter(()), "yielded no batch"),
        (lambda s: (_ for _ in ()).throw(OSError("disk gone")), "train_data failed: OSError"),
        (lambda s: iter([{"x": np.zeros((3, 1))}]), "must have shard.batch_size = 4"),
        (
            lambda s: iter([{"x": np.zeros((4, 1))}, {"x": np.zeros((4, 2))}]),
            "shapes changed between calls",
        ),
    ],
)
def test_stream_errors(data: Any, says: str) -> None:
    stream = BatchStream(Bound(Task(_init, _loss, data, name="t")), Shard(0, 1, 0, 4))
    with pytest.raises(TaskError, match=says):
        for _ in range(3):
            stream.next()


def test_gradient_is_the_mean_over_micro_batches() -> None:
    bound = Bound(_task(name="t"))
    params = bound.init_flat()
    steps = TaskSteps(bound, 8, optax.sgd(0.1), jax.devices()[0])
    stream = BatchStream(bound, Shard(0, 1, 0, 8))
    out = steps.gradient(params, stream, 20, jax.random.PRNGKey(0))  # 3 calls of 8
    assert out.samples == 24 and out.kind == "grad"
    batch = {"x": X[:24], "y": Y[:24]}
    want = jax.grad(lambda f: bound.loss_flat(f, batch, jax.random.PRNGKey(0))[0])(params)
    for k in params:
        np.testing.assert_allclose(out.tensors[k], want[k], rtol=1e-5, atol=1e-6)
        assert out.tensors[k].shape == params[k].shape  # a 0-d bias stays 0-d


def test_local_steps_use_the_inner_optimizer_and_lr_scale() -> None:
    bound = Bound(_task(name="t"))
    params = bound.init_flat()
    stream = BatchStream(bound, Shard(0, 1, 0, 8))
    steps = TaskSteps(bound, 8, optax.sgd(0.1), jax.devices()[0])
    out = steps.local_steps(params, stream, 8, 1, 0.5, jax.random.PRNGKey(0))
    batch = {"x": X[:8], "y": Y[:8]}
    g = jax.grad(lambda f: bound.loss_flat(f, batch, jax.random.PRNGKey(0))[0])(params)
    np.testing.assert_allclose(out.tensors["dense/w"], -0.05 * g["dense/w"], rtol=1e-5)


def test_optimizer_sees_the_users_structure_and_counts_updates() -> None:
    # a mask written for the user's tree (not the flat paths): only "dense/w" decays
    mask = {"dense": {"w": True, "b": False}, "extra": [False]}
    sched = optax.linear_schedule(0.5, 0.0, 10)
    tx = optax.chain(optax.add_decayed_weights(1.0, mask=mask), optax.scale_by_schedule(sched))
    bound = Bound(_task(name="t", optimizer=tx))
    params = {k: np.ones_like(v) for k, v in bound.init_flat().items()}
    store = Store(params, bound.flat_optimizer(tx))
    store.combine = store.step_each = True  # the daemon's setting for a task's own optimizer
    zero = {k: np.zeros(s, np.float32) for k, s in store.shapes.items()}
    for _ in range(3):
        store.apply("grad", zero, -1.0)
    store.flush()
    snap = store.snapshot()
    # one step per update, the schedule at 0.5, 0.45, 0.4: w <- w - lr * w (scale -1); the
    # three summed into one step would give 1 - 0.5 * 3 instead
    assert snap.tensors["dense/b"] == pytest.approx(1.0)
    w = 1.0
    for lr in (0.5, 0.45, 0.4):
        w -= lr * w
    np.testing.assert_allclose(snap.tensors["dense/w"], w, rtol=1e-5)


def test_check_setup_names_both_sides() -> None:
    from workers.loop import TaskMismatch, check_setup

    bound = Bound(_task(name="ours:task"))
    theirs = {"model": {"spec": "a/b.py:task", "task": {"spec": "a/b.py:task", "name": "b:task"}}}
    with pytest.raises(TaskMismatch, match=r"trains the task 'b:task' \(a/b.py:task\).*--task"):
        check_setup(theirs, None)
    with pytest.raises(TaskMismatch, match="bundled model 'mlp' on 'digits'"):
        check_setup({"model": {"spec": "mlp"}, "dataset": {"spec": "digits"}}, bound)
    other = Bound(Task(lambda k: {**_init(k), "more": jnp.zeros(1)}, _loss, _train, name="b:task"))
    theirs["model"]["task"].update(other.describe())
    with pytest.raises(TaskMismatch, match=r"'b:task' is not this worker's 'ours:task'.*more"):
        check_setup(theirs, bound)
    check_setup(theirs, other)  # the same task: no error


def test_a_bundled_task_takes_exactly_b_examples_across_batches() -> None:
    """The zoo as a Task (per example): a leftover of the last batch is used first, and the
    gradient is the mean over exactly those ``b`` examples, in the sampler's order."""
    from hetd.zoo.bundled import zoo_task
    from hetd.zoo.data import BatchSampler, shard_indices

    setup = {
        "model": {"spec": "mlp", "kwargs": {"hidden": [16]}},
        "dataset": {"spec": "digits", "kwargs": {}, "seed": 0},
    }
    task = zoo_task(setup)
    bound = Bound(task)
    params = bound.init_flat()
    steps = TaskSteps(bound, 8, optax.sgd(0.1), jax.devices()[0])
    stream = BatchStream(bound, Shard(1, 4, 0, 8))
    stream.take(5)  # a leftover in hand: the next take spans batches
    got = steps.gradient(params, stream, 13, jax.random.PRNGKey(0))

    idx = shard_indices(len(task.data.y_train), 1, 4, 0)
    sampler = BatchSampler(task.data.x_train[idx], task.data.y_train[idx], seed=1)
    sampler.next(5)
    x, y = sampler.next(13)
    loss, want = jax.value_and_grad(task.model.loss)(params, x, y)
    assert got.samples == 13 and got.loss == pytest.approx(float(loss), rel=1e-5)
    for k in params:
        np.testing.assert_allclose(got.tensors[k], want[k], rtol=2e-4, atol=1e-6)


@pytest.mark.slow  # trains a model for seconds: `make test` runs it, `make test-fast` does not
def test_no_batch_size_compiles_a_new_shape_after_warm() -> None:
    from hetd.zoo.bundled import zoo_task

    setup = {
        "model": {"spec": "mlp", "kwargs": {"hidden": [17]}},
        "dataset": {"spec": "digits", "kwargs": {}, "seed": 0},
    }
    bound = Bound(zoo_task(setup))
    params = bound.init_flat()
    steps = TaskSteps(bound, 8, optax.adam(0.01), jax.devices()[0])
    stream = BatchStream(bound, Shard(0, 1, 0, 8))
    steps.warm(params, stream, jax.random.PRNGKey(0))
    compiled = dict(steps.traces)
    assert compiled == {"accumulate": 1, "apply": 1}
    for b in (3, 8, 9, 31, 64, 5):
        steps.gradient(params, stream, b, jax.random.PRNGKey(0))
        steps.local_steps(params, stream, b, 3, 0.5, jax.random.PRNGKey(0))
    assert steps.traces == compiled


def test_a_bundled_model_whose_outputs_do_not_fit_the_labels_is_refused() -> None:
    from hetd.zoo.bundled import zoo_task

    setup = {
        "model": {"spec": "tests.tasks.three_outputs:model", "kwargs": {}},
        "dataset": {"spec": "digits", "kwargs": {}, "seed": 0},
    }
    with pytest.raises(TaskError, match="has 3 outputs but data set 'digits' has 10 classes"):
        zoo_task(setup)
    setup["model"] = {"spec": "mlp", "kwargs": {"hidden": [8]}}
    assert zoo_task(setup).name == "mlp@digits"


def test_the_dashboard_shows_a_tasks_target_metric_by_name() -> None:
    from hetd.server.dashboard import _eval_chart, _headline

    status = {
        "accuracy": None,
        "metrics": {"loss": 0.2, "r2": 0.7},
        "target": {"metric": "r2", "mode": "max", "value": 0.9, "reached_at_s": None},
    }
    assert _headline(status) == {"label": "r2", "value": 0.7}
    chart = _eval_chart(
        status, [], [(0.5, {"loss": 0.3, "r2": float("nan")}), (1.0, status["metrics"])]
    )
    assert "test r2 and loss" in chart and "<svg" in chart
    plain = {"accuracy": 0.9, "metrics": {"loss": 0.1, "accuracy": 0.9}, "target": None}
    assert _headline(plain) == {"label": "Accuracy", "value": 0.9}
    assert "test accuracy and loss" in _eval_chart(plain, [(0.5, 0.1, 0.9)], [])
