"""The worker's compute: a gradient on one batch, or k local steps of the inner optimizer returned
as a delta, for a Task (:mod:`hetd.zoo.task`): the user's own, which this worker's operator named
(``hetd-worker --task``), or a bundled model and data set (:mod:`hetd.zoo.bundled`) that the
daemon's welcome names.

``Trainer`` is built from the daemon's welcome (shard, seed, micro-batch) and is pure compute:
parameters in, update out. It never talks to the network; ``workers.client`` does. The worker
imports only the task its own operator named; the welcome describes the daemon's task (name,
fingerprint, shapes) and :func:`check_setup` compares the two, refusing a daemon that trains
something else with a message naming both. The same goes for a bundled model's plug-in specs
(:mod:`workers.imports`): a ``pkg.module:attr`` model or data set is imported only when this
worker's operator named it (``--model``, ``--dataset``).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

from hetd.protocol.plan import Plan, data_range
from hetd.zoo.bundled import ZooTask, zoo_task
from hetd.zoo.data import Dataset
from hetd.zoo.optim import parse_optimizer
from hetd.zoo.task import Bound, Shard
from hetd.zoo.task_steps import BatchStream, TaskSteps
from hetd.zoo.trees import shape_diff
from workers.imports import Allowed, check_imports

log = logging.getLogger("hetd.worker")

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


class TaskMismatch(ValueError):
    """The daemon trains another task than this worker's (or none, or this worker has none)."""


def check_setup(
    setup: Mapping[str, Any],
    bound: Bound | None,
    full: bool = True,
    allowed: Allowed | None = None,
) -> None:
    """Raise :class:`TaskMismatch` unless the daemon's setup trains ``bound`` (or, with ``bound``
    None, a bundled model), :class:`workers.imports.ImportRefused` when that bundled model names
    a plug-in that ``allowed`` (what this worker's operator named) does not. ``full``: the setup
    is a welcome's, which carries the fingerprint (the early ``/v1/prepare`` names the task
    only)."""
    theirs = (setup.get("model") or {}).get("task")
    if bound is None:
        if theirs:
            spec = theirs.get("spec", "?")
            raise TaskMismatch(
                f"the daemon trains the task {theirs.get('name', spec)!r} ({spec}); start this "
                f"worker with --task naming it (e.g. --task {spec}): a worker imports only the "
                "task its own command line names"
            )
        check_imports(setup, allowed)  # before anything the setup names is imported
        return
    if not theirs:
        model = (setup.get("model") or {}).get("spec", "?")
        data = (setup.get("dataset") or {}).get("spec", "?")
        raise TaskMismatch(
            f"this worker was started with --task ({bound.name!r}) but the daemon trains the "
            f"bundled model {model!r} on {data!r}; give the daemon the same task "
            "(hetd serve --task, or [train] task)"
        )
    if not full or "fingerprint" not in theirs:
        return
    if theirs["fingerprint"] != bound.fingerprint:
        diff = shape_diff(bound.layout.shapes, theirs.get("shapes") or {})
        raise TaskMismatch(
            f"the daemon's task {theirs.get('name')!r} is not this worker's {bound.name!r} "
            f"(another version or another task; parameters that differ: {diff}); start both "
            "with the same code"
        )


class Core:
    """A task's kernels on one device, for any shard, warmed: built early from ``/v1/prepare``
    (while the daemon builds its own) or at the welcome, and kept across reconnects.

    ``task``: the Task this worker's operator named (``--task``); None builds the bundled model
    and data set the setup names (:func:`hetd.zoo.bundled.zoo_task`), plug-ins only those in
    ``allowed`` (what the operator named with ``--model`` and ``--dataset``)."""

    def __init__(
        self,
        setup: Mapping[str, Any],
        device: jax.Device,
        task: Bound | None = None,
        allowed: Allowed | None = None,
    ) -> None:
        check_setup(setup, task, full=False, allowed=allowed)
        train = setup["train"]
        self.key = setup_key(setup)
        self.seed = int(train.get("seed", 0))
        self.bound = task if task is not None else Bound(zoo_task(setup), self.seed)
        self.device = device
        # Fixed shapes: every jitted call takes micro_batch examples, so a plan that changes
        # the batch never compiles (hetd.zoo.task_steps). Older daemons send neither key.
        self.micro_batch = int(train.get("micro_batch") or 0) or DEFAULT_MICRO_BATCH
        own = self.bound.task.inner_optimizer
        if own is not None:
            inner = self.bound.flat_optimizer(own)
        else:
            spec = parse_optimizer(str(train.get("inner_optimizer") or "sgd"))
            inner = spec.with_default_lr(float(train.get("worker_lr") or 0.05)).build()
        self.steps = TaskSteps(self.bound, self.micro_batch, inner, device)
        # Compile both kernels before the first push (a kernel first compiled when a plan first
        # asks for local steps would count its compile time as compute and skew what policies
        # measure), on zeros shaped like the parameters and a batch of the first shard.
        zeros = {k: np.zeros(v, np.float32) for k, v in self.bound.layout.shapes.items()}
        warm = BatchStream(self.bound, Shard(0, 1, self.seed, self.micro_batch))
        self.steps.warm(zeros, warm, jax.random.PRNGKey(self.seed))

    @property
    def data(self) -> Dataset | None:
        """A bundled task's data set (pipeline stages read it); None for a user's task."""
        task = self.bound.task
        return task.data if isinstance(task, ZooTask) else None


class Trainer:
    """A task and this worker's shard, with the core's fixed-shape jitted gradients and
    inner-optimizer local steps (:class:`hetd.zoo.task_steps.TaskSteps`)."""

    def __init__(
        self,
        welcome: Mapping[str, Any],
        device: jax.Device,
        core: Core | None = None,
        task: Bound | None = None,
        allowed: Allowed | None = None,
    ) -> None:
        """``core``: one built earlier (a prepared one, or the last session's); used when it is
        for the same task and settings, built afresh otherwise. ``task``: the operator's Task
        (None: the bundled one the welcome names, its plug-ins only those in ``allowed``);
        :class:`TaskMismatch` when the daemon's differs."""
        check_setup(welcome, task, allowed=allowed)
        if core is None or core.key != setup_key(welcome) or core.device != device:
            core = Core(welcome, device, task, allowed)
        self.core = core
        self.bound = core.bound
        self.data = core.data
        self.steps = core.steps
        self.seed = seed = core.seed
        shard = welcome["shard"]
        self.shard = Shard(int(shard["index"]), int(shard["count"]), seed, core.micro_batch)
        self.stream = BatchStream(self.bound, self.shard)
        self.key = jax.random.PRNGKey(seed * 1000 + self.shard.index)
        self._share: tuple[float, float] | None = None  # (offset, share) the stream covers
        self._next_shard: Shard | None = None  # a re-cut, taken at the start of the next step

    def reshard(self, index: int, count: int) -> None:
        """Read part ``index`` of ``count`` from the next step on (the daemon cut the data again
        after a join or a leave): the iterator is built anew for it. Called from the receiving
        task while a step may run in a thread, so the step itself makes the change."""
        if 0 <= index < count:
            self._next_shard = dataclasses.replace(self.shard, index=index, count=count)

    def _follow_share(self, plan: Plan) -> None:
        """A plan with ``data_share`` (and ``data_offset``) moves this worker to that fraction of
        the training set (ASHL's data shares): the task's ``train_data`` is asked again with a
        shard that carries it (:meth:`hetd.zoo.task.Shard.slice`)."""
        wanted = data_range(plan)
        if wanted is None or self._share == wanted:
            return
        self.stream = BatchStream(self.bound, dataclasses.replace(self.shard, share=wanted))
        self._share = wanted

    def step(self, params: Mapping[str, np.ndarray], plan: Plan) -> Update:
        """One plan's worth of work on the current parameters."""
        batch = max(1, plan.batch_size)
        k = max(1, plan.local_steps)
        shard, self._next_shard = self._next_shard, None
        if shard is not None and shard != self.shard:
            self.shard = shard
            self.stream = BatchStream(self.bound, dataclasses.replace(shard, share=self._share))
        self._follow_share(plan)
        if k == 1 and plan.push_kind != "delta":
            r = self.steps.gradient(params, self.stream, batch, self.key)
        else:
            r = self.steps.local_steps(params, self.stream, batch, k, plan.lr_scale, self.key)
        return Update(r.kind, r.tensors, r.loss, r.samples, r.steps)


def quiet_xla_threads() -> None:
    """Many workers share few cores: one compute thread each (docs/benchmark.md)."""
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_cpu_multi_thread_eigen" not in flags:
        os.environ["XLA_FLAGS"] = (flags + " --xla_cpu_multi_thread_eigen=false").strip()
