"""The user's own training job: :class:`Task` (model, loss, data, optimizer, target) and
:class:`Shard` (which part of the data one worker reads).

A Task is plain JAX: ``init(key) -> params`` (any pytree of float arrays), ``loss(params, batch,
key) -> loss`` or ``(loss, {name: scalar})`` (jit-able; ``batch`` any pytree of arrays with a leading
batch axis), ``train_data(shard) -> iterator of batches`` and, for the daemon's evaluations,
``eval_data() -> finite iterable of batches``. flax models come in through :meth:`Task.from_nnx`
and :meth:`Task.from_linen` (:mod:`hetd.zoo.flax_tasks`); optimizers are optax transformations.

The daemon and every worker load the same Task from ``pkg.module:attr`` (or ``path/file.py:attr``)
with :func:`load_task`, each from its own operator's command line or config: a worker never imports
what the daemon names. :class:`Bound` is a loaded task with its parameter layout
(:class:`hetd.zoo.trees.Layout`), the flat views the wire and store use, and the checks that turn a
wrong task into one clear :class:`TaskError`.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import math
import os
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hetd.zoo.errors import TaskError as TaskError
from hetd.zoo.errors import reason as reason
from hetd.zoo.flax_tasks import linen_parts, nnx_parts

if TYPE_CHECKING:  # JAX and optax load when a task is bound, not when hetd is imported
    import jax
    import optax

    from hetd.zoo.trees import Layout

Batch = Any
"""A pytree of arrays, each with the same leading (batch) axis."""

LossFn = Callable[[Any, Batch, "jax.Array"], Any]
"""(params, batch, key) -> loss, or (loss, {metric: scalar})."""


@dataclass(frozen=True, slots=True)
class Shard:
    """The part of the training data one worker reads.

    ``index`` of ``count`` disjoint parts (every example belongs to exactly one); ``seed`` for the
    worker's shuffling; ``batch_size`` is the fixed micro-batch every yielded batch must have;
    ``epoch`` counts how often this worker's iterator has ended and been built again (fold it into
    the shuffle for a new order each pass). ``share``: ``(offset, fraction)`` of the data when a
    policy sizes data shares by speed (ashl) instead of equal shards; :meth:`slice` follows it
    (a ``range``: ``slice(r.start, r.stop)`` for libraries that take a slice).
    """

    index: int
    count: int
    seed: int
    batch_size: int
    epoch: int = 0
    share: tuple[float, float] | None = None

    def __post_init__(self) -> None:
        if self.count < 1 or not 0 <= self.index < self.count:
            raise ValueError(f"shard index {self.index} of {self.count} is out of range")
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {self.batch_size}")

    def slice(self, n: int) -> range:
        """The rows ``[index * n // count, (index + 1) * n // count)`` of ``n``: near-equal,
        disjoint parts that cover ``range(n)`` whatever the count; with a ``share``, the rows
        ``[offset * n, (offset + fraction) * n)`` (at least one)."""
        if self.share is not None:
            offset, fraction = self.share
            lo = min(n - 1, int(offset * n))
            return range(lo, max(lo + 1, min(n, int((offset + fraction) * n))))
        return range(self.index * n // self.count, (self.index + 1) * n // self.count)


@dataclass(frozen=True, slots=True)
class Target:
    """When training has done its job: ``metric`` (``"loss"`` or one of the loss's metrics)
    reaching ``value`` from below (``mode="max"``) or above (``"min"``)."""

    metric: str
    mode: str
    value: float

    @classmethod
    def parse(cls, raw: Mapping[str, Any] | Target | None) -> Target | None:
        """A target from ``{"metric": ..., "mode": "min"|"max", "value": ...}``."""
        if raw is None or isinstance(raw, Target):
            return raw
        if not isinstance(raw, Mapping):
            raise TaskError(f"target must be a dict with metric, mode and value, got {raw!r}")
        unknown = set(raw) - {"metric", "mode", "value"}
        if unknown:
            raise TaskError(
                f"target has unknown keys {sorted(unknown)}; it takes metric, mode, value"
            )
        metric, value = raw.get("metric"), raw.get("value")
        mode = raw.get("mode", {"accuracy": "max", "loss": "min"}.get(str(metric)))
        if mode is None:
            raise TaskError(
                f"target for {metric!r} needs a mode: 'max' (higher is better, e.g. r2) or "
                "'min' (lower is better, e.g. mse)"
            )
        if not isinstance(metric, str) or not metric:
            raise TaskError(f"target metric must be a name, got {metric!r}")
        if mode not in ("min", "max"):
            raise TaskError(f"target mode must be 'min' or 'max', got {mode!r}")
        if (
            isinstance(value, bool)
            or not isinstance(value, int | float)
            or not math.isfinite(value)
        ):
            raise TaskError(f"target value must be a finite number, got {value!r}")
        return cls(metric, str(mode), float(value))

    def reached(self, metrics: Mapping[str, float]) -> bool:
        """Whether these evaluation metrics meet the target."""
        got = metrics.get(self.metric)
        if got is None or not math.isfinite(got):
            return False
        return got <= self.value if self.mode == "min" else got >= self.value

    def __str__(self) -> str:
        return f"{self.metric} {'<=' if self.mode == 'min' else '>='} {self.value:g}"


class Task:
    """A training job: how to make parameters, the loss, the data and the optimizer.

    ``optimizer``: the daemon's optax transformation for gradients (any chain; schedules advance
    once per applied update); None takes the config's ``[train] optimizer``. ``inner_optimizer``:
    the workers' transformation for local steps (None: the config's); ``outer_optimizer``: how the
    daemon applies workers' deltas (None: the config's or the policy's). ``target``: e.g.
    ``{"metric": "mse", "mode": "min", "value": 0.05}``. ``name``: shown everywhere and compared
    between the daemon and its workers (default: the file's or module's last name and the
    attribute, ``"digits_cnn:task"``). ``per_example``: the loss is the mean of one term per
    example (cross-entropy, squared error): a plan's ``b`` examples are then computed exactly, the
    last micro-batch masked, where by default a plan takes whole micro-batches (``ceil(b / m)``,
    right for a loss over the whole batch, such as a contrastive one). ``eval_loss``: the loss
    and metrics for the daemon's evaluations when they differ from training's (dropout off; the
    flax adapters set it); None uses ``loss``.
    """

    __slots__ = (
        "eval_data",
        "eval_loss",
        "init",
        "inner_optimizer",
        "loss",
        "name",
        "optimizer",
        "outer_optimizer",
        "per_example",
        "target",
        "train_data",
    )

    def __init__(
        self,
        init: Callable[[jax.Array], Any],
        loss: LossFn,
        train_data: Callable[[Shard], Iterable[Batch]],
        eval_data: Callable[[], Iterable[Batch]] | None = None,
        optimizer: optax.GradientTransformation | None = None,
        target: Mapping[str, Any] | Target | None = None,
        *,
        name: str | None = None,
        inner_optimizer: optax.GradientTransformation | None = None,
        outer_optimizer: optax.GradientTransformation | None = None,
        per_example: bool = False,
        eval_loss: LossFn | None = None,
    ) -> None:
        for field, value in (("init", init), ("loss", loss), ("train_data", train_data)):
            if not callable(value):
                raise TaskError(f"Task {field} must be callable, got {type(value).__name__}")
        if eval_loss is not None and not callable(eval_loss):
            raise TaskError(f"Task eval_loss must be callable, got {type(eval_loss).__name__}")
        if eval_data is not None and not callable(eval_data):
            raise TaskError(
                f"Task eval_data must be a function returning batches, got {type(eval_data).__name__}"
            )
        for field, tx in (
            ("optimizer", optimizer),
            ("inner_optimizer", inner_optimizer),
            ("outer_optimizer", outer_optimizer),
        ):
            if tx is not None and not (hasattr(tx, "init") and hasattr(tx, "update")):
                raise TaskError(
                    f"Task {field} must be an optax.GradientTransformation, got {type(tx).__name__}"
                )
        self.init = init
        self.loss = loss
        self.train_data = train_data
        self.eval_data = eval_data
        self.optimizer = optimizer
        self.target = Target.parse(target)
        self.name = name or ""
        self.inner_optimizer = inner_optimizer
        self.outer_optimizer = outer_optimizer
        self.per_example = bool(per_example)
        self.eval_loss = eval_loss

    def __repr__(self) -> str:
        return f"Task(name={self.name!r}, target={self.target})"

    @staticmethod
    def from_nnx(model: Any, loss_fn: Callable[..., Any], train_data: Any, **kwargs: Any) -> Task:
        """A Task from a ``flax.nnx`` module (an instance, or ``rngs -> module``) and
        ``loss_fn(model, batch[, key])``; see :func:`hetd.zoo.flax_tasks.nnx_parts`. ``kwargs``
        are the Task's own (``eval_data``, ``optimizer``, ``target``, ``name``, ...)."""
        init, loss, eval_loss = nnx_parts(model, loss_fn)
        kwargs.setdefault("eval_loss", eval_loss)
        return Task(init, loss, train_data, **kwargs)

    @staticmethod
    def from_linen(
        module: Any, loss_fn: Callable[..., Any], train_data: Any, *, sample: Any, **kwargs: Any
    ) -> Task:
        """A Task from a ``flax.linen`` module, an example input ``sample`` for its ``init``, and
        ``loss_fn(apply, batch[, key])``; see :func:`hetd.zoo.flax_tasks.linen_parts`."""
        init, loss = linen_parts(module, loss_fn, sample)
        return Task(init, loss, train_data, **kwargs)


def _import(module_part: str, spec: str) -> Any:
    """The module a spec names: a dotted module found from the working directory (as ``python
    -m`` would), or a ``.py`` file by path (its folder joins ``sys.path`` for its own imports)."""
    if module_part.endswith(".py") or os.sep in module_part:
        path = Path(module_part).expanduser().resolve()
        if not path.is_file():
            raise TaskError(f"task {spec!r}: no file {path}")
        folder = str(path.parent)
        if folder not in sys.path:  # last: its own imports work, nothing of Python's is shadowed
            sys.path.append(folder)
        # a name of its own: a task file called token.py must not replace the standard module,
        # and two task files of one name in two folders must not replace each other
        digest = hashlib.sha256(str(path).encode()).hexdigest()[:12]
        name = f"hetd_task_{path.stem}_{digest}"
        if name in sys.modules:
            return sys.modules[name]
        loader_spec = importlib.util.spec_from_file_location(name, path)
        if loader_spec is None or loader_spec.loader is None:
            raise TaskError(f"task {spec!r}: {path} is not a Python module")
        module = importlib.util.module_from_spec(loader_spec)
        sys.modules[name] = module
        try:
            loader_spec.loader.exec_module(module)
        except BaseException as exc:
            del sys.modules[name]
            raise TaskError(f"task {spec!r}: importing {path} failed: {reason(exc)}") from exc
        return module
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.insert(0, cwd)
    try:
        return importlib.import_module(module_part)
    except Exception as exc:
        raise TaskError(f"task {spec!r}: cannot import {module_part!r}: {reason(exc)}") from exc


def load_task(spec: str) -> Task:
    """The Task that ``pkg.module:attr`` or ``path/file.py:attr`` names: a :class:`Task`, or a
    function of no arguments returning one (``attr`` may be dotted). Any failure raises one
    :class:`TaskError` that names the spec and what is wrong."""
    module_part, sep, attr_path = spec.strip().rpartition(":")
    if not sep or not module_part or not attr_path:
        raise TaskError(f"task {spec!r} must look like 'pkg.module:attr' or 'path/to/file.py:attr'")
    target: Any = _import(module_part, spec)
    for part in attr_path.split("."):
        if not hasattr(target, part):
            raise TaskError(f"task {spec!r}: module {module_part!r} has no attribute {attr_path!r}")
        target = getattr(target, part)
    if not isinstance(target, Task):
        if not callable(target):
            raise TaskError(
                f"task {spec!r} is a {type(target).__name__}, not a hetd.Task or a function "
                "returning one"
            )
        try:
            target = target()
        except Exception as exc:
            raise TaskError(f"task {spec!r}: building the task failed: {reason(exc)}") from exc
        if not isinstance(target, Task):
            raise TaskError(f"task {spec!r} returned a {type(target).__name__}, not a hetd.Task")
    if not target.name:
        stem = Path(module_part).stem if module_part.endswith(".py") else module_part
        target.name = f"{stem.rpartition('.')[2]}:{attr_path}"
    return target


def _scalar_metrics(name: str, out: Any) -> tuple[Any, dict[str, Any]]:
    """A loss function's result as (loss scalar, {metric: scalar}); TaskError if it is not one."""
    import jax.numpy as jnp

    if isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], Mapping):
        loss, metrics = out
    else:
        loss, metrics = out, {}
    loss = jnp.asarray(loss)
    if loss.shape != ():
        raise TaskError(
            f"task {name!r}: loss must return a scalar (or (scalar, metrics)), got shape "
            f"{tuple(loss.shape)}; take the mean over the batch"
        )
    clean: dict[str, Any] = {}
    for key, value in metrics.items():
        if not isinstance(key, str) or key == "loss":
            raise TaskError(
                f"task {name!r}: metric names must be strings other than 'loss', got {key!r}"
            )
        arr = jnp.asarray(value)
        if arr.shape != ():
            raise TaskError(
                f"task {name!r}: metric {key!r} must be a scalar, got shape {tuple(arr.shape)}"
            )
        clean[key] = arr.astype(jnp.float32)
    return loss.astype(jnp.float32), clean


class Bound:
    """A loaded task with its parameter layout: what the daemon and a worker use.

    ``loss_flat(flat, batch, key) -> (loss, metrics)`` takes the wire's flat parameters; the
    layout comes from ``init``'s shapes (:func:`jax.eval_shape`, nothing computed) and
    :attr:`fingerprint` identifies the task between processes.
    """

    def __init__(self, task: Task, seed: int = 0) -> None:
        import jax

        from hetd.zoo.trees import Layout

        self.task = task
        self.name = task.name or "task"
        self.seed = seed
        try:
            shapes = jax.eval_shape(task.init, jax.random.PRNGKey(seed))
        except TaskError:
            raise
        except Exception as exc:
            raise TaskError(f"task {self.name!r}: init failed: {reason(exc)}") from exc
        try:
            self.layout: Layout = Layout(shapes)
        except ValueError as exc:
            raise TaskError(f"task {self.name!r}: {exc}") from exc
        self.fingerprint = self.layout.fingerprint(self.name)

    def init_flat(self) -> dict[str, Any]:
        """The initial parameters as float32 host arrays, by path (``init`` run once, jitted)."""
        import jax
        import numpy as np

        try:
            tree = jax.jit(self.task.init)(jax.random.PRNGKey(self.seed))
        except Exception as exc:
            raise TaskError(f"task {self.name!r}: init failed: {reason(exc)}") from exc
        return {k: np.asarray(v, np.float32) for k, v in self.layout.flatten(tree).items()}

    def loss_flat(
        self, flat: Mapping[str, Any], batch: Batch, key: Any
    ) -> tuple[Any, dict[str, Any]]:
        """The task's loss and metrics on flat parameters (jit-able)."""
        return _scalar_metrics(self.name, self.task.loss(self.layout.unflatten(flat), batch, key))

    def eval_flat(
        self, flat: Mapping[str, Any], batch: Batch, key: Any
    ) -> tuple[Any, dict[str, Any]]:
        """The evaluation's loss and metrics on flat parameters (``eval_loss``, else ``loss``)."""
        fn = self.task.eval_loss or self.task.loss
        return _scalar_metrics(self.name, fn(self.layout.unflatten(flat), batch, key))

    def describe(self) -> dict[str, Any]:
        """What a worker compares with its own task: name, fingerprint and shapes."""
        return {
            "name": self.name,
            "fingerprint": self.fingerprint,
            "shapes": {k: list(v) for k, v in self.layout.shapes.items()},
        }

    def flat_optimizer(self, tx: optax.GradientTransformation) -> optax.GradientTransformation:
        """``tx`` on flat parameters: each call sees the user's own structure (so masks, labels
        and per-parameter schedules written for it apply), the store sees paths."""
        import optax

        layout = self.layout

        def init_fn(params: Any) -> Any:
            return tx.init(layout.unflatten(params))

        def update_fn(updates: Any, state: Any, params: Any = None) -> tuple[Any, Any]:
            tree_params = None if params is None else layout.unflatten(params)
            new, state = tx.update(layout.unflatten(updates), state, tree_params)
            return layout.flatten(new), state

        return optax.GradientTransformation(init_fn, update_fn)

    def eval_batches(self) -> Iterator[Batch]:
        """The evaluation batches, or TaskError when the task has none or they fail to start."""
        if self.task.eval_data is None:
            raise TaskError(f"task {self.name!r} has no eval_data")
        try:
            return iter(self.task.eval_data())
        except Exception as exc:
            raise TaskError(f"task {self.name!r}: eval_data failed: {reason(exc)}") from exc


def leading(batch: Batch) -> int:
    """The batch's leading (example) axis; TaskError when its arrays disagree or have none."""
    import jax

    sizes = {int(leaf.shape[0]) for leaf in jax.tree.leaves(batch) if getattr(leaf, "ndim", 0) >= 1}
    if len(sizes) != 1:
        raise ValueError(
            "a batch must be a pytree of arrays sharing a leading batch axis; got leading sizes "
            f"{sorted(sizes) or 'none'}"
        )
    return sizes.pop()
