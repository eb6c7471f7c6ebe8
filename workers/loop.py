"""The worker's compute: a gradient on one batch, or k local steps of the inner optimizer returned
as a delta.

``Trainer`` is built from the daemon's welcome (model, data set, shard, seed) and is pure compute:
parameters in, update out. It never talks to the network; ``workers.client`` does.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

from hetd.protocol.plan import Plan, data_range
from hetd.zoo.data import BatchSampler, load_dataset, shard_indices, share_indices
from hetd.zoo.models import get_model
from hetd.zoo.optim import parse_optimizer
from hetd.zoo.steps import Steps

DEFAULT_MICRO_BATCH = 32  # examples per compiled call when the daemon does not say


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


def setup_key(setup: Mapping[str, Any]) -> str:
    """What makes two :class:`Core` s alike: the model, dataset and train parts of a welcome (or
    of the daemon's ``/v1/prepare``)."""
    return repr((setup["model"], setup["dataset"], setup["train"]))


class Core:
    """The part of a worker's trainer that does not depend on which worker it is: the data set,
    the model and its warmed, fixed-shape jitted steps. Built from a welcome, or earlier from the
    daemon's ``/v1/prepare`` while the daemon itself builds, and kept across reconnects."""

    def __init__(self, setup: Mapping[str, Any], device: jax.Device) -> None:
        model_spec = setup["model"]
        data_spec = setup["dataset"]
        train = setup["train"]
        self.key = setup_key(setup)
        self.seed = int(data_spec.get("seed", 0))
        self.data = load_dataset(
            data_spec["spec"], seed=self.seed, **dict(data_spec.get("kwargs", {}))
        )
        self.model = get_model(
            model_spec["spec"], self.data.num_classes, **dict(model_spec.get("kwargs", {}))
        )
        self.device = device
        # Fixed shapes: every jitted call takes micro_batch examples, so a plan that changes
        # the batch never compiles (hetd.zoo.steps). Older daemons send neither key.
        micro = int(train.get("micro_batch") or 0) or DEFAULT_MICRO_BATCH
        inner = parse_optimizer(str(train.get("inner_optimizer") or "sgd")).with_default_lr(
            float(train.get("worker_lr") or 0.05)
        )
        self.steps = Steps(self.model, micro, inner, device)
        shapes = jax.eval_shape(
            lambda key: self.model.init(key, self.data.input_shape), jax.random.PRNGKey(0)
        )
        zeros = {k: np.zeros(v.shape, v.dtype) for k, v in shapes.items()}
        self.steps.warm(zeros, self.data.x_train[:1], self.data.y_train[:1])


class Trainer:
    """Model + this worker's shard, with fixed-shape jitted gradients and inner-optimizer
    local steps (:class:`hetd.zoo.steps.Steps`)."""

    def __init__(
        self, welcome: Mapping[str, Any], device: jax.Device, core: Core | None = None
    ) -> None:
        """``core``: one built earlier (a prepared one, or the last session's); used when it is
        for the same model, data and training settings, built afresh otherwise."""
        if core is None or core.key != setup_key(welcome) or core.device != device:
            core = Core(welcome, device)
        self.core = core
        self.data = core.data
        self.model = core.model
        self.seed = seed = core.seed
        self.steps = core.steps
        self.device = device
        shard = welcome["shard"]
        self.shard_index = int(shard["index"])
        idx = shard_indices(len(self.data.y_train), shard["index"], shard["count"], seed)
        self.sampler = BatchSampler(
            self.data.x_train[idx], self.data.y_train[idx], seed=seed * 1000 + shard["index"]
        )
        self._share: tuple[float, float] | None = None  # (offset, share) the sampler covers

    def _follow_share(self, plan: Plan) -> None:
        """A plan with ``data_share`` (and ``data_offset``) moves this worker to that fraction of
        one seed-fixed permutation of the training set (ASHL's data shares)."""
        wanted = data_range(plan)
        if wanted is None or self._share == wanted:
            return
        idx = share_indices(len(self.data.y_train), *wanted, self.seed)
        self.sampler = BatchSampler(
            self.data.x_train[idx], self.data.y_train[idx], seed=self.seed * 1000 + self.shard_index
        )
        self._share = wanted

    def step(self, params: Mapping[str, np.ndarray], plan: Plan) -> Update:
        """One plan's worth of work on the current parameters."""
        batch = max(1, plan.batch_size)
        k = max(1, plan.local_steps)
        self._follow_share(plan)
        if k == 1 and plan.push_kind != "delta":
            r = self.steps.gradient(params, self.sampler.next, batch)
        else:
            r = self.steps.local_steps(params, self.sampler.next, batch, k, plan.lr_scale)
        return Update(r.kind, r.tensors, r.loss, r.samples, r.steps)


def quiet_xla_threads() -> None:
    """Many workers share few cores: one compute thread each (docs/benchmark.md)."""
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_cpu_multi_thread_eigen" not in flags:
        os.environ["XLA_FLAGS"] = (flags + " --xla_cpu_multi_thread_eigen=false").strip()
