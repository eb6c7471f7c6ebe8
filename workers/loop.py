"""The worker's compute: a gradient on one batch, or k local SGD steps returned as a delta.

``Trainer`` is built from the daemon's welcome (model, data set, shard, seed) and is pure compute:
parameters in, update out. It never talks to the network; ``workers.client`` does.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from hetd.protocol.plan import Plan, data_range
from hetd.zoo.data import BatchSampler, load_dataset, shard_indices
from hetd.zoo.models import get_model


@dataclass(frozen=True, slots=True)
class Update:
    """One step's result."""

    kind: str  # "grad" | "delta"
    tensors: dict[str, np.ndarray]
    loss: float
    samples: int
    steps: int


def pick_device(spec: str | None) -> jax.Device:
    """``None``: JAX's default; ``"cpu"``/``"gpu"``: the first of that platform; ``"gpu:1"``: that
    one; ``"2"``: ``jax.devices()[2]``. A device that is not there raises ValueError listing them."""
    devices = jax.devices()
    if spec is None:
        return devices[0]
    try:
        if spec.isdigit():
            return devices[int(spec)]
        platform, _, index = spec.partition(":")
        chosen = jax.devices(platform)
        return chosen[int(index or 0)]
    except (IndexError, RuntimeError, ValueError):
        listed = ", ".join(f"{i}:{d.platform}:{d.device_kind}" for i, d in enumerate(devices))
        raise ValueError(f"no device {spec!r}; this machine has {listed}") from None


def device_info(device: jax.Device) -> dict[str, Any]:
    """Platform, kind and memory (bytes) of a device, as far as JAX or the OS tell."""
    info: dict[str, Any] = {"platform": device.platform, "kind": device.device_kind}
    stats = None
    try:
        stats = device.memory_stats()
    except Exception:  # CPU backends may not implement it
        stats = None
    if stats and "bytes_limit" in stats:
        info["memory"] = int(stats["bytes_limit"])
        info["free_memory"] = int(stats["bytes_limit"] - stats.get("bytes_in_use", 0))
    else:
        free = host_free_memory()
        if free is not None:
            info["free_memory"] = free
    return info


def host_free_memory() -> int | None:
    """MemAvailable from /proc/meminfo in bytes, where there is one."""
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


class Trainer:
    """Model + this worker's shard, with jitted gradient and SGD steps."""

    def __init__(self, welcome: Mapping[str, Any], device: jax.Device) -> None:
        model_spec = welcome["model"]
        data_spec = welcome["dataset"]
        shard = welcome["shard"]
        train = welcome["train"]
        seed = int(data_spec.get("seed", 0))
        self.data = load_dataset(data_spec["spec"], seed=seed, **dict(data_spec.get("kwargs", {})))
        self.model = get_model(
            model_spec["spec"], self.data.num_classes, **dict(model_spec.get("kwargs", {}))
        )
        self.seed = seed
        self.shard_index = int(shard["index"])
        idx = shard_indices(len(self.data.y_train), shard["index"], shard["count"], seed)
        self.sampler = BatchSampler(
            self.data.x_train[idx], self.data.y_train[idx], seed=seed * 1000 + shard["index"]
        )
        self._share: tuple[float, float] | None = None  # (offset, share) the sampler covers
        self.worker_lr = float(train.get("worker_lr", 0.05))
        self.device = device
        self._grad = jax.jit(jax.value_and_grad(self.model.loss), device=device)

        def sgd(
            params: dict[str, jax.Array], x: jax.Array, y: jax.Array, lr: jax.Array
        ) -> tuple[dict[str, jax.Array], jax.Array]:
            loss, g = jax.value_and_grad(self.model.loss)(params, x, y)
            return {k: params[k] - lr * g[k] for k in params}, loss

        self._sgd = jax.jit(sgd, device=device)

    def _follow_share(self, plan: Plan) -> None:
        """A plan with ``data_share`` (and ``data_offset``) moves this worker to that fraction of
        one seed-fixed permutation of the training set (ASHL's data shares)."""
        wanted = data_range(plan)
        if wanted is None or self._share == wanted:
            return
        offset, share = wanted
        n = len(self.data.y_train)
        perm = np.random.default_rng(self.seed).permutation(n)
        lo = int(offset * n)
        idx = perm[lo : max(lo + 1, min(n, int((offset + share) * n)))]
        self.sampler = BatchSampler(
            self.data.x_train[idx], self.data.y_train[idx], seed=self.seed * 1000 + self.shard_index
        )
        self._share = wanted

    def step(self, params: Mapping[str, np.ndarray], plan: Plan) -> Update:
        """One plan's worth of work on the current parameters."""
        batch = max(1, plan.batch_size)
        k = max(1, plan.local_steps)
        self._follow_share(plan)
        dev = {name: jax.device_put(v, self.device) for name, v in params.items()}
        if k == 1 and plan.push_kind != "delta":
            x, y = self.sampler.next(batch)
            loss, grads = self._grad(dev, jnp.asarray(x), jnp.asarray(y))
            tensors = {name: np.asarray(g, dtype=np.float32) for name, g in grads.items()}
            return Update("grad", tensors, float(loss), batch, 1)
        lr = jnp.float32(self.worker_lr * plan.lr_scale)
        local = dev
        losses = []
        for _ in range(k):
            x, y = self.sampler.next(batch)
            local, loss = self._sgd(local, jnp.asarray(x), jnp.asarray(y), lr)
            losses.append(loss)
        delta = {name: np.asarray(local[name] - dev[name], dtype=np.float32) for name in dev}
        return Update("delta", delta, float(np.mean([float(v) for v in losses])), batch * k, k)


def quiet_xla_threads() -> None:
    """Many workers share few cores: one compute thread each (docs/benchmark.md)."""
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_cpu_multi_thread_eigen" not in flags:
        os.environ["XLA_FLAGS"] = (flags + " --xla_cpu_multi_thread_eigen=false").strip()
