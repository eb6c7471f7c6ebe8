"""A worker's compute for a user's Task (``hetd-worker --task``): the counterpart of
:class:`workers.loop.Core` and :class:`workers.loop.Trainer` for the bundled models.

The worker imports only the task its own operator named; the daemon's welcome describes its task
(name, fingerprint, shapes) and :func:`check_setup` compares the two, refusing a daemon that trains
something else with a message naming both.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from hetd.protocol.plan import Plan, data_range
from hetd.zoo.optim import parse_optimizer
from hetd.zoo.task import Bound, Shard
from hetd.zoo.task_steps import BatchStream, TaskSteps
from hetd.zoo.trees import shape_diff
from workers.loop import DEFAULT_MICRO_BATCH, Update, setup_key

log = logging.getLogger("hetd.worker")


class TaskMismatch(ValueError):
    """The daemon trains another task than this worker's (or none, or this worker has none)."""


def check_setup(setup: Mapping[str, Any], bound: Bound | None, full: bool = True) -> None:
    """Raise :class:`TaskMismatch` unless the daemon's setup trains ``bound`` (or, with ``bound``
    None, a bundled model). ``full``: the setup is a welcome's, which carries the fingerprint (the
    early ``/v1/prepare`` names the task only)."""
    theirs = (setup.get("model") or {}).get("task")
    if bound is None:
        if theirs:
            spec = theirs.get("spec", "?")
            raise TaskMismatch(
                f"the daemon trains the task {theirs.get('name', spec)!r} ({spec}); start this "
                f"worker with --task naming it (e.g. --task {spec}): a worker imports only the "
                "task its own command line names"
            )
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


class TaskCore:
    """A task's kernels on one device, for any shard: built early from ``/v1/prepare`` or at
    the welcome, and kept across reconnects."""

    def __init__(self, setup: Mapping[str, Any], device: jax.Device, bound: Bound) -> None:
        check_setup(setup, bound, full=False)
        train = setup["train"]
        self.key = setup_key(setup)
        self.bound = bound
        self.seed = int(train.get("seed", 0))
        self.device = device
        self.micro_batch = int(train.get("micro_batch") or 0) or DEFAULT_MICRO_BATCH
        task = bound.task
        if task.inner_optimizer is not None:
            inner = bound.flat_optimizer(task.inner_optimizer)
        else:
            spec = parse_optimizer(str(train.get("inner_optimizer") or "sgd"))
            inner = spec.with_default_lr(float(train.get("worker_lr") or 0.05)).build()
        self.steps = TaskSteps(bound, self.micro_batch, inner, device)
        self.warmed = False


class TaskTrainer:
    """A task and this worker's shard: the same ``step(params, plan)`` as
    :class:`workers.loop.Trainer`."""

    def __init__(
        self, welcome: Mapping[str, Any], device: jax.Device, bound: Bound, core: Any = None
    ) -> None:
        check_setup(welcome, bound)
        if (
            not isinstance(core, TaskCore)
            or core.key != setup_key(welcome)
            or core.device != device
        ):
            core = TaskCore(welcome, device, bound)
        self.core = core
        self.steps = core.steps
        shard = welcome["shard"]
        self.shard = Shard(int(shard["index"]), int(shard["count"]), core.seed, core.micro_batch)
        self.stream = BatchStream(bound, self.shard)
        self.key = jax.random.PRNGKey(core.seed * 1000 + self.shard.index)
        self._share_warned = False
        if not core.warmed:
            zeros = {k: np.zeros(v, np.float32) for k, v in bound.layout.shapes.items()}
            self.steps.warm(zeros, self.stream, self.key)
            core.warmed = True

    def step(self, params: Mapping[str, np.ndarray], plan: Plan) -> Update:
        """One plan's worth of work on the current parameters."""
        if data_range(plan) is not None and not self._share_warned:
            self._share_warned = True
            log.warning(
                "the plan gives this worker a data share; a task's data comes from its own "
                "train_data, so it keeps reading its shard"
            )
        batch = max(1, plan.batch_size)
        k = max(1, plan.local_steps)
        if k == 1 and plan.push_kind != "delta":
            r = self.steps.gradient(params, self.stream, batch, self.key)
        else:
            r = self.steps.local_steps(params, self.stream, batch, k, plan.lr_scale, self.key)
        return Update(r.kind, r.tensors, r.loss, r.samples, r.steps)
