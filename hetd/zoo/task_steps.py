"""A Task's compute on a worker: batches from its iterator, gradients over micro-batches, local
steps through an inner optimizer.

Every batch a Task's ``train_data`` yields has exactly ``shard.batch_size`` (the micro-batch m)
examples, and the same shapes every time, so each jitted call compiles once. A plan of ``b``
examples runs ``ceil(b / m)`` calls; the gradient is the mean of their (mean) gradients and the
samples reported are ``calls * m``. The loss sees whole batches (a contrastive or masked loss
works as written), so nothing is padded. A Task whose loss is a mean of per-example terms
(``Task.per_example``) is computed on exactly ``b`` examples instead: the stream hands out ``b``
(keeping the rest of a batch for the next call), the last call is padded with zeros and its
padding masked out of a sum of per-example losses, as the bundled models always were.

:class:`BatchStream` wraps the user's iterator: an iterator that ends starts the next epoch, on
the next shard (``index + epoch`` modulo the count), so over ``count`` epochs a worker reads every
shard and every example is read by some worker whatever the number of workers; a batch whose
structure, shapes or dtypes change, or an iterator that raises, is a :class:`TaskError`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from hetd.zoo.task import Batch, Bound, Shard, TaskError, reason


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


def _spec(batch: Batch) -> tuple[Any, tuple[tuple[tuple[int, ...], str], ...]]:
    leaves, treedef = jax.tree.flatten(batch)
    return treedef, tuple((tuple(np.shape(x)), str(np.asarray(x).dtype)) for x in leaves)


class BatchStream:
    """The batches of one worker's shard, epoch after epoch, checked."""

    def __init__(self, bound: Bound, shard: Shard) -> None:
        self.bound = bound
        self.shard = shard
        self.epoch = 0
        self._it: Iterator[Batch] | None = None
        self._spec: Any = None
        self._left: Batch | None = None  # what take() has not handed out of the last batch
        self._left_n = 0

    def current(self) -> Shard:
        """The shard this epoch reads: the next one along after each pass."""
        s = self.shard
        return dataclasses.replace(s, index=(s.index + self.epoch) % s.count, epoch=self.epoch)

    def next(self) -> Batch:
        """The next batch; a new epoch when the iterator ends."""
        name = self.bound.name
        for fresh in (self._it is None, True):
            if self._it is None:
                try:
                    self._it = iter(self.bound.task.train_data(self.current()))
                except Exception as exc:
                    raise TaskError(f"task {name!r}: train_data failed: {reason(exc)}") from exc
            try:
                batch = next(self._it)
            except StopIteration:
                self._it = None
                if fresh:
                    raise TaskError(
                        f"task {name!r}: train_data({self.current()}) yielded no batch"
                    ) from None
                self.epoch += 1
                continue
            except Exception as exc:
                raise TaskError(f"task {name!r}: train_data failed: {reason(exc)}") from exc
            self._check(batch)
            return batch
        raise AssertionError("unreachable")  # the second pass starts a fresh iterator

    def take(self, n: int) -> Batch:
        """Exactly ``n`` examples (host arrays), from as many batches as it takes; the rest of the
        last one is kept for the next call."""
        parts: list[Batch] = []
        have = 0
        while have < n:
            if self._left is None:
                self._left, self._left_n = self.next(), self.shard.batch_size
            need = n - have
            if self._left_n <= need:
                parts.append(self._left)
                have += self._left_n
                self._left, self._left_n = None, 0
            else:
                left = self._left
                parts.append(jax.tree.map(lambda a, k=need: np.asarray(a)[:k], left))
                self._left = jax.tree.map(lambda a, k=need: np.asarray(a)[k:], left)
                self._left_n -= need
                have = n
        if len(parts) == 1:
            return parts[0]
        return jax.tree.map(lambda *xs: np.concatenate([np.asarray(x) for x in xs]), *parts)

    def _check(self, batch: Batch) -> None:
        spec = _spec(batch)
        name = self.bound.name
        if self._spec is None:
            sizes = {shape[0] if shape else None for shape, _ in spec[1]}
            if sizes != {self.shard.batch_size}:
                raise TaskError(
                    f"task {name!r}: every train batch must have shard.batch_size = "
                    f"{self.shard.batch_size} examples along the leading axis of each array; "
                    f"got leading sizes {sorted(map(str, sizes))}"
                )
            self._spec = spec
        elif spec != self._spec:
            raise TaskError(
                f"task {name!r}: a train batch's shapes changed between calls: "
                f"{[s for s, _ in spec[1]]} after {[s for s, _ in self._spec[1]]} "
                "(every batch must be shaped alike, so each step compiles once)"
            )


class TaskSteps:
    """Jitted gradient and inner-optimizer kernels for one Task on one device."""

    def __init__(
        self,
        bound: Bound,
        micro_batch: int,
        inner: optax.GradientTransformation,
        device: jax.Device,
    ) -> None:
        if micro_batch < 1:
            raise ValueError(f"micro_batch must be >= 1, got {micro_batch}")
        self.bound = bound
        self.micro_batch = micro_batch
        self.device = device
        self._tx = inner
        self._state: Any = None  # the inner optimizer's state, kept across rounds
        self.traces = {"accumulate": 0, "apply": 0}

        self.per_example = bound.task.per_example

        def accumulate(
            params: Any, acc: Any, loss_sum: jax.Array, batch: Any, key: jax.Array, i: jax.Array
        ) -> tuple[jax.Array, Any]:
            self.traces["accumulate"] += 1  # runs only while JAX traces
            k = jax.random.fold_in(key, i)
            (loss, _), grads = jax.value_and_grad(bound.loss_flat, has_aux=True)(params, batch, k)
            return loss_sum + loss, {name: acc[name] + grads[name] for name in acc}

        def masked_sum(params: Any, batch: Any, mask: jax.Array, key: jax.Array) -> jax.Array:
            def one(example: Any, j: jax.Array) -> jax.Array:
                single = jax.tree.map(lambda a: a[None], example)
                term: jax.Array = bound.loss_flat(params, single, jax.random.fold_in(key, j))[0]
                return term

            per = jax.vmap(one)(batch, jnp.arange(mask.shape[0]))
            return jnp.sum(per * mask)

        def accumulate_masked(
            params: Any,
            acc: Any,
            loss_sum: jax.Array,
            batch: Any,
            key: jax.Array,
            i: jax.Array,
            mask: jax.Array,
        ) -> tuple[jax.Array, Any]:
            self.traces["accumulate"] += 1
            k = jax.random.fold_in(key, i)
            loss, grads = jax.value_and_grad(masked_sum)(params, batch, mask, k)
            return loss_sum + loss, {name: acc[name] + grads[name] for name in acc}

        def apply(
            params: Any, state: Any, g_sum: Any, inv_calls: jax.Array, lr_scale: jax.Array
        ) -> tuple[Any, Any]:
            self.traces["apply"] += 1
            grads = {name: g * inv_calls for name, g in g_sum.items()}
            updates, state = inner.update(grads, state, params)
            return {name: params[name] + lr_scale * updates[name] for name in params}, state

        self._accumulate = jax.jit(accumulate_masked if self.per_example else accumulate)
        self._apply = jax.jit(apply)
        self._calls = 0  # micro-batches computed: each folds its count into the key
        self._zeros: tuple[Any, Any] | None = None  # (loss, grads) zeros on the device, reused

    def warm(self, params: Mapping[str, np.ndarray], stream: BatchStream, key: jax.Array) -> None:
        """Compile both kernels now (a gradient and two local steps, as a plan makes them), so a
        first push does not count compile time as compute; the inner state is then forgotten."""
        self.gradient(params, stream, self.micro_batch, key)
        self.local_steps(params, stream, self.micro_batch, 2, 1.0, key)
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

    def _grad_sum(
        self, params: Mapping[str, jax.Array], stream: BatchStream, b: int, key: jax.Array
    ) -> tuple[jax.Array, Any, int]:
        """Σ of the loss and its gradient over the plan's micro-batches, and the divisor that
        makes them means: the calls (whole micro-batches) or, per example, ``b``."""
        m = self.micro_batch
        calls = micro_batches(b, m)
        loss, acc = self._zeros_like(params)
        if not self.per_example:
            for _ in range(calls):
                batch = jax.device_put(stream.next(), self.device)
                self._calls += 1
                loss, acc = self._accumulate(params, acc, loss, batch, key, np.uint32(self._calls))
            return loss, acc, calls
        host = stream.take(b)
        pad = calls * m - b
        if pad:
            host = jax.tree.map(
                lambda a: np.concatenate([a, np.zeros((pad, *a.shape[1:]), a.dtype)]), host
            )
        mask = np.ones(calls * m, np.float32)
        mask[b:] = 0.0
        for i in range(calls):
            s = slice(i * m, (i + 1) * m)  # host slices, one transfer each
            part = jax.device_put(jax.tree.map(lambda a, s=s: a[s], host), self.device)
            self._calls += 1
            loss, acc = self._accumulate(
                params, acc, loss, part, key, np.uint32(self._calls), mask[s]
            )
        return loss, acc, b

    def gradient(
        self, params: Mapping[str, np.ndarray], stream: BatchStream, b: int, key: jax.Array
    ) -> Result:
        """The mean gradient over ``ceil(b / m)`` micro-batches."""
        dev = {k: jax.device_put(v, self.device) for k, v in params.items()}
        loss, acc, n = self._grad_sum(dev, stream, b, key)
        inv = np.float32(1.0 / n)
        # np.asarray again: a 0-d array times a scalar is a numpy scalar, not an array
        tensors = {k: np.asarray(np.asarray(v, dtype=np.float32) * inv) for k, v in acc.items()}
        return Result("grad", tensors, float(loss) / n, self._samples(b), 1)

    def _samples(self, b: int) -> int:
        """Examples one plan of ``b`` computes: ``b`` per example, else whole micro-batches."""
        m = self.micro_batch
        return b if self.per_example else micro_batches(b, m) * m

    def local_steps(
        self,
        params: Mapping[str, np.ndarray],
        stream: BatchStream,
        b: int,
        k: int,
        lr_scale: float,
        key: jax.Array,
    ) -> Result:
        """``k`` inner-optimizer steps of ``ceil(b / m)`` micro-batches each; the change as a
        delta. ``lr_scale`` scales the inner updates (a learning-rate scale for optimizers whose
        step is proportional to their rate: SGD, momentum, Adam and their chains)."""
        start = {name: jax.device_put(v, self.device) for name, v in params.items()}
        if self._state is None:
            self._state = self._tx.init(start)
        scale = jax.device_put(np.float32(lr_scale), self.device)
        local: Any = start
        total = 0.0
        samples = 0
        for _ in range(k):
            loss, acc, n = self._grad_sum(local, stream, b, key)
            inv = jax.device_put(np.float32(1.0 / n), self.device)
            local, self._state = self._apply(local, self._state, acc, inv, scale)
            total += float(loss) / n
            samples += self._samples(b)
        delta = {
            name: np.asarray(
                np.asarray(local[name], dtype=np.float32)
                - np.asarray(params[name], dtype=np.float32)
            )
            for name in start
        }
        return Result("delta", delta, total / k, samples, k)
