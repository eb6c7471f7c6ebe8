"""The emulated workers' compute for the simulator: real JAX gradients, batched across workers.

Owns :class:`Compute` (the jitted, vmapped kernels for one model and data set, cached per process so
that a benchmark compiles them once), :class:`StepWork` (one emulated step waiting for its
gradient), :class:`Straggler` (the transient straggler process of docs/benchmark.md S2) and
:func:`samples_to_target` (the single-process sample count behind ``tta_ideal_s``).

Gradients are computed lazily: the simulator records each step when it starts (its parameters and
the indices of its batch) and asks for the result only when the push reaches the daemon. By then
most workers have started a step, so :meth:`Compute.run` does them all in one jitted call (one
``jax.vmap`` over workers; parameters shared when every step started from the same version).
Nothing here reads a clock.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import numpy.typing as npt
import optax

from hetd.core.store import make_optimizer
from hetd.sim.scenario import Scenario, Stragglers
from hetd.zoo.data import BatchSampler, Dataset, load_dataset
from hetd.zoo.models import Model, get_model
from hetd.zoo.optim import parse_optimizer

Tensors = Mapping[str, np.ndarray]


class Straggler:
    """Per step: outside an episode, start one with probability ``p`` (geometric length, mean
    ``mean_len`` steps); steps inside an episode are ``factor`` × slower. Same rule as
    ``workers.emulate.Emulation``, with an explicit generator."""

    def __init__(self, spec: Stragglers, rng: np.random.Generator) -> None:
        self.spec = spec
        self._rng = rng
        self._left = 0  # steps left in the current episode

    def factor(self) -> float:
        """The multiplier of the next step's time."""
        if self._left == 0 and self.spec.p > 0 and self._rng.random() < self.spec.p:
            self._left = int(self._rng.geometric(1.0 / self.spec.mean_len))
        if self._left > 0:
            self._left -= 1
            return self.spec.factor
        return 1.0


@dataclass(eq=False)
class StepWork:
    """One emulated step: its inputs when it starts, its update once computed."""

    params: Tensors  # the parameters it started from
    indices: npt.NDArray[np.int32]  # (local_steps, batch) rows of x_train
    lr: float  # the worker's local lr (delta pushes only)
    delta: bool = False  # push the change after local SGD steps, not the gradient
    tensors: dict[str, np.ndarray] | None = None  # the update, once computed
    loss: float = 0.0
    # Local steps run this inner optimizer (a spec without lr; plain "sgd" has no state). Its
    # state comes from the worker's previous delta step (``prev``, computed first if it has not
    # been), as a real worker keeps it across rounds; ``state_out`` once computed.
    inner: str = "sgd"
    prev: StepWork | None = None
    state_out: Any = None


def _bucket(n: int) -> int:
    """The padded group size: a power of two, so a run compiles a handful of shapes."""
    return 1 << max(0, (n - 1).bit_length())


def _batch_bucket(b: int) -> int:
    """The padded batch: the next of 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, ... (at most 1.5x)."""
    p = _bucket(b)
    return p * 3 // 4 if p >= 4 and p * 3 // 4 >= b else p


class Kernels(NamedTuple):
    """The jitted functions for one model; data arrays are arguments, so any data set of the
    same shapes reuses them (a benchmark compiles once). ``idx`` is ``[n, k, b]`` rows of the
    training set (n workers, k local steps, b samples). Groups whose batches differ are padded to
    a bucket width and the padding is masked out of the mean loss (``mask``), so plans that change
    batch sizes every round do not compile a kernel per size; equal batches use the plain loss,
    which compiles twice as fast."""

    grad: Callable[..., Any]  # (params[n], x, y, idx) -> (loss[n], grads[n])
    grad_masked: Callable[..., Any]  # (params[n], x, y, idx, mask) -> (loss[n], grads[n])
    delta_masked: Callable[..., Any]  # (params[n], x, y, idx, mask, lr[n]) -> (loss, delta)
    metrics: Callable[..., Any]  # (params, x, y) -> (loss, accuracy)


def _masked_mean_loss(model: Model) -> Callable[..., jax.Array]:
    """``(params, x, y, mask) -> loss`` of the unpadded rows: model.loss is a mean over examples
    (hetd.zoo.models.Model), so the masked mean of per-example losses is the unpadded batch's."""

    def masked_loss(params: Any, x: jax.Array, y: jax.Array, mask: jax.Array) -> jax.Array:
        per = jax.vmap(lambda xi, yi: model.loss(params, xi[None], yi[None]))(x, y)
        return jnp.sum(per * mask) / jnp.maximum(jnp.sum(mask), 1.0)

    return masked_loss


def make_kernels(model: Model) -> Kernels:
    """Gradient and local-SGD kernels for ``model``, vmapped over workers."""

    masked_loss = _masked_mean_loss(model)

    plain_grad = jax.value_and_grad(model.loss)
    masked_grad = jax.value_and_grad(masked_loss)

    def one(params: Any, x_all: jax.Array, y_all: jax.Array, idx: jax.Array) -> Any:
        return plain_grad(params, x_all[idx[0]], y_all[idx[0]])

    def one_masked(
        params: Any, x_all: jax.Array, y_all: jax.Array, idx: jax.Array, mask: jax.Array
    ) -> Any:
        return masked_grad(params, x_all[idx[0]], y_all[idx[0]], mask[0])

    def local(
        params: Any,
        x_all: jax.Array,
        y_all: jax.Array,
        idx: jax.Array,
        mask: jax.Array,
        lr: jax.Array,
    ) -> Any:
        def body(p: Any, step: tuple[jax.Array, jax.Array]) -> tuple[Any, jax.Array]:
            rows, m = step
            loss, g = masked_grad(p, x_all[rows], y_all[rows], m)
            return {k: p[k] - lr * g[k] for k in p}, loss

        final, losses = jax.lax.scan(body, params, (idx, mask))
        return jnp.mean(losses), {k: final[k] - params[k] for k in params}

    def metrics(params: Any, x: jax.Array, y: jax.Array) -> tuple[jax.Array, jax.Array]:
        return model.loss(params, x, y), model.accuracy(params, x, y)

    return Kernels(
        grad=jax.jit(jax.vmap(one, in_axes=(0, None, None, 0))),
        grad_masked=jax.jit(jax.vmap(one_masked, in_axes=(0, None, None, 0, 0))),
        delta_masked=jax.jit(jax.vmap(local, in_axes=(0, None, None, 0, 0, 0))),
        metrics=jax.jit(metrics),
    )


class Compute:
    """The kernels plus one data set held on the device."""

    def __init__(self, model: Model, kernels: Kernels, data: Dataset) -> None:
        self.model = model
        self.kernels = kernels
        self.x_train = jnp.asarray(data.x_train)
        self.y_train = jnp.asarray(data.y_train)
        self.x_test = jnp.asarray(data.x_test)
        self.y_test = jnp.asarray(data.y_test)

    def evaluate(self, params: Tensors) -> tuple[float, float]:
        """(loss, accuracy) of ``params`` on the test set."""
        loss, acc = self.kernels.metrics(dict(params), self.x_test, self.y_test)
        return float(loss), float(acc)

    def run(self, steps: Sequence[StepWork]) -> None:
        """Compute every step's update: one jitted call per (local steps, batch bucket)."""
        waiting = [s.prev for s in steps if s.prev is not None and s.prev.tensors is None]
        if waiting:  # an inner optimizer's state comes from the step before
            self.run(waiting)
        groups: dict[tuple[bool, str, int, int], list[StepWork]] = {}
        for s in steps:
            if s.tensors is not None:
                continue
            k, b = s.indices.shape
            inner = s.inner if s.delta else ""
            groups.setdefault((s.delta, inner, int(k), _batch_bucket(int(b))), []).append(s)
        for (delta, inner, k, bucket), group in sorted(groups.items()):
            widths = {int(s.indices.shape[1]) for s in group}
            width = widths.pop() if len(widths) == 1 else bucket
            if delta and not parse_optimizer(inner).plain_sgd:
                self._run_inner(group, inner, k, width)
            else:
                self._run_group(group, delta, k, width)

    def _padded_rows(
        self, padded: list[StepWork], k: int, width: int
    ) -> tuple[np.ndarray, np.ndarray]:
        idx = np.zeros((len(padded), k, width), np.int32)
        mask = np.zeros((len(padded), k, width), np.float32)
        for i, s in enumerate(padded):
            b = s.indices.shape[1]
            idx[i, :, :b] = s.indices
            mask[i, :, :b] = 1.0
        return idx, mask

    def _run_inner(self, group: list[StepWork], inner: str, k: int, width: int) -> None:
        """Local steps through a stateful inner optimizer, each worker's state carried on."""
        key = (id(self.kernels), inner)
        kernel = _INNER.get(key)
        tx = parse_optimizer(inner).with_default_lr(1.0).injectable()
        if kernel is None:
            kernel = _INNER[key] = make_inner_kernel(self.model, tx)
        size = _bucket(len(group))
        padded = group + [group[0]] * (size - len(group))
        params = {p: np.stack([s.params[p] for s in padded]) for p in group[0].params}
        states = []
        for s in padded:
            prev = s.prev.state_out if s.prev is not None else None
            states.append(prev if prev is not None else tx.init(dict(s.params)))
        state = jax.tree.map(lambda *xs: np.stack([np.asarray(x) for x in xs]), *states)
        idx, mask = self._padded_rows(padded, k, width)
        lr = np.array([s.lr for s in padded], np.float32)
        losses, out, new_state = kernel(params, state, self.x_train, self.y_train, idx, mask, lr)
        host = {p: np.asarray(v, dtype=np.float32) for p, v in out.items()}
        host_state = jax.device_get(new_state)
        loss_host = np.asarray(losses)
        for i, s in enumerate(group):
            s.tensors = {p: v[i] for p, v in host.items()}
            s.loss = float(loss_host[i])
            s.state_out = jax.tree.map(lambda v, i=i: v[i], host_state)
            s.prev = None  # its state is taken: let the chain go

    def _run_group(self, group: list[StepWork], delta: bool, k: int, width: int) -> None:
        n = len(group)
        size = _bucket(n)  # padded with copies of the first step, whose results are dropped
        padded = group + [group[0]] * (size - n)
        params = {p: np.stack([s.params[p] for s in padded]) for p in group[0].params}
        x, y = self.x_train, self.y_train
        if not delta and all(s.indices.shape[1] == width for s in group):
            losses, out = self.kernels.grad(params, x, y, np.stack([s.indices for s in padded]))
        else:
            idx, mask = self._padded_rows(padded, k, width)
            if not delta:
                losses, out = self.kernels.grad_masked(params, x, y, idx, mask)
            else:
                lr = np.array([s.lr for s in padded], np.float32)
                losses, out = self.kernels.delta_masked(params, x, y, idx, mask, lr)
        host = {p: np.asarray(v, dtype=np.float32) for p, v in out.items()}
        loss_host = np.asarray(losses)
        for i, s in enumerate(group):
            s.tensors = {p: v[i] for p, v in host.items()}
            s.loss = float(loss_host[i])


def make_inner_kernel(model: Model, tx: optax.GradientTransformation) -> Callable[..., Any]:
    """Local steps through ``tx`` (its learning rate injected per worker), vmapped over
    workers: ``(params[n], state[n], x, y, idx, mask, lr[n]) -> (loss[n], delta[n], state[n])``.
    Each step is the masked mean gradient of its rows, as a real worker's micro-batches give."""

    grad = jax.value_and_grad(_masked_mean_loss(model))

    def local(
        params: Any,
        state: Any,
        x_all: jax.Array,
        y_all: jax.Array,
        idx: jax.Array,
        mask: jax.Array,
        lr: jax.Array,
    ) -> Any:
        state.hyperparams["learning_rate"] = lr

        def body(carry: Any, step: tuple[jax.Array, jax.Array]) -> tuple[Any, jax.Array]:
            p, st = carry
            rows, m = step
            loss, g = grad(p, x_all[rows], y_all[rows], m)
            updates, st = tx.update(g, st, p)
            return ({k: p[k] + updates[k] for k in p}, st), loss

        (final, state), losses = jax.lax.scan(body, (params, state), (idx, mask))
        return jnp.mean(losses), {k: final[k] - params[k] for k in params}, state

    return jax.jit(jax.vmap(local, in_axes=(0, 0, None, None, 0, 0, 0)))


_INNER: dict[Hashable, Callable[..., Any]] = {}  # (kernels, inner spec) -> inner-step kernel
_KERNELS: dict[Hashable, Kernels] = {}
_COMPUTE: dict[Hashable, Compute] = {}


def compute_for(model_key: Hashable, model: Model, data_key: Hashable, data: Dataset) -> Compute:
    """A :class:`Compute` for this model and data set; kernels and device arrays are cached per
    process by their keys."""
    kernels = _KERNELS.get(model_key)
    if kernels is None:
        kernels = _KERNELS[model_key] = make_kernels(model)
    key = (model_key, data_key)
    found = _COMPUTE.get(key)
    if found is None:
        if len(_COMPUTE) > 4:
            _COMPUTE.clear()
        found = _COMPUTE[key] = Compute(model, kernels, data)
    return found


def scenario_compute(sc: Scenario, seed: int) -> tuple[Dataset, Model, Compute]:
    """The data set, model and cached :class:`Compute` of a scenario."""
    data = load_dataset(sc.dataset, seed=seed, **dict(sc.dataset_kwargs))
    model = get_model(sc.model, data.num_classes, **dict(sc.model_kwargs))
    kwargs = repr(sorted(sc.model_kwargs.items()))
    model_key = (sc.model, kwargs, data.input_shape, data.num_classes)
    data_key = (sc.dataset, repr(sorted(sc.dataset_kwargs.items())), seed)
    return data, model, compute_for(model_key, model, data_key, data)


_STEPS: dict[tuple[int, str, float], Callable[..., Any]] = {}  # kernels (model), optimizer, lr


def samples_to_target(
    compute: Compute,
    init: Tensors,
    data: Dataset,
    *,
    batch: int,
    lr: float,
    optimizer: str,
    target: float,
    seed: int,
    max_samples: int = 2_000_000,
) -> int | None:
    """Samples one process needs to reach ``target`` test accuracy: plain minibatch training with
    the daemon's optimizer on the whole training set, evaluated after every step."""
    tx = make_optimizer(optimizer, lr)
    key = (id(compute.kernels), optimizer, lr)
    step = _STEPS.get(key)
    if step is None:
        model = compute.model

        def train_step(
            params: Any, state: Any, x: jax.Array, y: jax.Array, xt: jax.Array, yt: jax.Array
        ) -> tuple[Any, Any, jax.Array]:
            grads = jax.grad(model.loss)(params, x, y)
            updates, state = tx.update(grads, state, params)
            params = optax.apply_updates(params, updates)
            return params, state, model.accuracy(params, xt, yt)

        step = _STEPS[key] = jax.jit(train_step)
    params = {k: jnp.asarray(v) for k, v in init.items()}
    state = tx.init(params)
    sampler = BatchSampler(data.x_train, data.y_train, seed=seed)
    samples = 0
    while samples < max_samples:
        rows = sampler.next_indices(batch)
        x, y = compute.x_train[rows], compute.y_train[rows]
        params, state, acc = step(params, state, x, y, compute.x_test, compute.y_test)
        samples += batch
        if float(acc) >= target:
            return samples
    return None
