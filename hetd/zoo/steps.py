"""A worker's compute in fixed shapes: gradients over micro-batches, local steps through an inner
optimizer.

Every jitted call sees a batch of exactly ``micro_batch`` examples. A batch of ``b`` examples runs
as ``ceil(b / micro_batch)`` calls whose per-example losses are summed under a mask (the last
micro-batch padded with zeros and masked out), so a policy that changes a worker's batch every
round changes how many calls it makes, never a compiled shape. Without this a new batch size
cost a compilation that the worker then reported as compute time, and batch-share policies chased
their own compile times (docs/benchmark.md).

Local steps (a delta push) run the *inner* optimizer (:mod:`hetd.zoo.optim`) whose state this
object keeps across rounds, as DiLoCo-style training does; its learning rate is an injected
hyperparameter, so the plan's ``lr_scale`` changes it without recompiling.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from hetd.zoo.models import Model
from hetd.zoo.optim import OptimizerSpec

Sample = Callable[[int], tuple[np.ndarray, np.ndarray]]
"""Draws the next ``n`` examples ``(x, y)`` of the worker's data."""


@dataclass(frozen=True, slots=True)
class Result:
    """One plan's worth of work."""

    kind: str  # "grad" (mean gradient of one batch) | "delta" (θ_end − θ_start after k steps)
    tensors: dict[str, np.ndarray]
    loss: float  # mean training loss over the examples seen
    samples: int  # examples computed (padding excluded)
    steps: int  # optimizer steps taken (1 for a gradient)


def micro_batches(b: int, micro_batch: int) -> int:
    """How many fixed-shape calls a batch of ``b`` examples takes."""
    return max(1, math.ceil(b / micro_batch))


class Steps:
    """Jitted, fixed-shape gradient and inner-optimizer kernels for one model on one device."""

    def __init__(
        self, model: Model, micro_batch: int, inner: OptimizerSpec, device: jax.Device
    ) -> None:
        if micro_batch < 1:
            raise ValueError(f"micro_batch must be >= 1, got {micro_batch}")
        if inner.lr is None:
            raise ValueError("the inner optimizer needs a learning rate")
        self.micro_batch = micro_batch
        self.inner = inner
        self.base_lr = inner.lr
        self.device = device
        self._tx = inner.injectable()
        self._state: Any = None  # the inner optimizer's state, kept across rounds
        self.traces = {"accumulate": 0, "apply": 0}  # times JAX traced (and so compiled) each

        def masked_sum(params: Any, x: jax.Array, y: jax.Array, mask: jax.Array) -> jax.Array:
            # Model.loss is a mean over examples, so per-example losses are loss(x[i:i+1]).
            per = jax.vmap(lambda xi, yi: model.loss(params, xi[None], yi[None]))(x, y)
            return jnp.sum(per * mask)

        grad_sum = jax.value_and_grad(masked_sum)

        def accumulate(
            params: Any, acc: Any, loss: jax.Array, x: jax.Array, y: jax.Array, mask: jax.Array
        ) -> Any:
            self.traces["accumulate"] += 1  # runs only while JAX traces: a new signature
            part_loss, part = grad_sum(params, x, y, mask)
            return loss + part_loss, {k: acc[k] + part[k] for k in acc}

        def apply_inner(
            params: Any, state: Any, g_sum: Any, inv_n: jax.Array, lr: jax.Array
        ) -> tuple[Any, Any]:
            self.traces["apply"] += 1
            state.hyperparams["learning_rate"] = lr
            grads = {k: g_sum[k] * inv_n for k in g_sum}
            updates, state = self._tx.update(grads, state, params)
            return {k: params[k] + updates[k] for k in params}, state

        # Inputs are placed on ``device`` (jit's own device argument is deprecated): the
        # computation follows its operands.
        # One kernel per job: accumulating a micro-batch (from zeros for the first) and an
        # inner-optimizer step; each compiles once.
        self._accumulate = jax.jit(accumulate)
        self._apply = jax.jit(apply_inner)
        self._zeros: tuple[Any, Any] | None = None  # (loss, grads) zeros on the device, reused

    def warm(
        self, params: Mapping[str, np.ndarray], x_like: np.ndarray, y_like: np.ndarray
    ) -> None:
        """Compile both kernels now, on zeros shaped like ``params`` and a batch like ``x_like``,
        ``y_like`` (shapes past the first, and dtypes). A worker does this before its first
        push: a kernel first compiled when a plan first asks for local steps would count its
        compile time as compute and skew what policies measure."""
        m = self.micro_batch
        zeros = {k: np.zeros_like(v) for k, v in params.items()}

        def sample(n: int) -> tuple[np.ndarray, np.ndarray]:
            return (
                np.zeros((n, *x_like.shape[1:]), x_like.dtype),
                np.zeros((n, *y_like.shape[1:]), y_like.dtype),
            )

        # The calls a plan makes, not kernels alone: two local steps, since the second takes an
        # inner state that came out of the kernel (committed to the device, where a fresh one
        # is not), and XLA compiles that signature apart (1.7-3 s at the first push of two or
        # more local steps on a loaded host). The warm-up's inner state is then forgotten.
        self.gradient(zeros, sample, m)
        self.local_steps(zeros, sample, m, 2, 1.0)
        self._state = None

    def _zeros_like(self, params: Mapping[str, jax.Array]) -> tuple[Any, Any]:
        if self._zeros is None:
            zero = jax.device_put(np.float32(0.0), self.device)
            grads = {
                k: jax.device_put(np.zeros(v.shape, np.float32), self.device)
                for k, v in params.items()
            }
            self._zeros = (zero, grads)
        return self._zeros

    def _init_state(self, params: Mapping[str, jax.Array]) -> Any:
        """A fresh inner state whose learning rate is a float32 array like every later one (a
        weakly typed Python float would be a second compiled signature)."""
        state = self._tx.init(params)
        state.hyperparams["learning_rate"] = jax.device_put(np.float32(self.base_lr), self.device)
        return state

    def _grad_sum(self, params: Mapping[str, jax.Array], sample: Sample, b: int) -> Any:
        """Σ over ``b`` fresh examples of the per-example loss and its gradient."""
        m = self.micro_batch
        x, y = sample(b)
        calls = micro_batches(b, m)
        pad = calls * m - b
        if pad:
            x = np.concatenate([x, np.zeros((pad, *x.shape[1:]), x.dtype)])
            y = np.concatenate([y, np.zeros((pad, *y.shape[1:]), y.dtype)])
        mask_host = np.ones(calls * m, np.float32)
        if pad:
            mask_host[b:] = 0.0

        def part(i: int) -> tuple[jax.Array, ...]:
            s = slice(i * m, (i + 1) * m)  # host slices, one transfer each
            return tuple(jax.device_put(a[s], self.device) for a in (x, y, mask_host))

        loss, acc = self._zeros_like(params)
        for i in range(calls):
            loss, acc = self._accumulate(params, acc, loss, *part(i))
        return loss, acc

    def gradient(self, params: Mapping[str, np.ndarray], sample: Sample, b: int) -> Result:
        """The mean gradient over ``b`` examples."""
        dev = {k: jax.device_put(v, self.device) for k, v in params.items()}
        loss, acc = self._grad_sum(dev, sample, b)
        inv = np.float32(1.0 / b)
        tensors = {k: np.asarray(v, dtype=np.float32) * inv for k, v in acc.items()}
        return Result("grad", tensors, float(loss) / b, b, 1)

    def local_steps(
        self, params: Mapping[str, np.ndarray], sample: Sample, b: int, k: int, lr_scale: float
    ) -> Result:
        """``k`` inner-optimizer steps of ``b`` examples each; the change as a delta."""
        start = {k_: jax.device_put(v, self.device) for k_, v in params.items()}
        if self._state is None:
            self._state = self._init_state(start)
        lr = jnp.float32(self.base_lr * lr_scale)
        inv = jax.device_put(np.float32(1.0 / b), self.device)
        lr = jax.device_put(lr, self.device)
        local: Any = start
        total = 0.0
        for _ in range(k):
            loss, acc = self._grad_sum(local, sample, b)
            local, self._state = self._apply(local, self._state, acc, inv, lr)
            total += float(loss)
        # On the host: an eager ``local - start`` on the device compiles one subtraction per
        # parameter shape the first time, 0.7-1.9 s on a loaded host, charged to the first
        # local-step push as compute (every ashl worker stalled 1.7 s at once in S3b).
        delta = {
            name: np.asarray(local[name], dtype=np.float32)
            - np.asarray(params[name], dtype=np.float32)
            for name in start
        }
        return Result("delta", delta, total / (b * k), b * k, k)
