"""Building a daemon's engine from a config: the task (the user's ``[train] task``, or the bundled
model and data set as one, :mod:`hetd.zoo.bundled`), the store with its optimizers, the policy
and the evaluator. Both kinds of task take the same path.

JAX, flax, optax and the data set are imported inside the functions, so the daemon imports this
module before its sockets listen and builds the engine behind them (:mod:`hetd.server.daemon`).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from hetd import config as config_mod

if TYPE_CHECKING:  # the heavy modules (JAX, flax, optax) load when the engine is built
    import numpy as np

    from hetd.core.engine import Engine
    from hetd.core.evals import Evaluation
    from hetd.core.peers import Clock
    from hetd.core.store import Snapshot, Store
    from hetd.zoo.task import Bound

log = logging.getLogger("hetd.server")


def make_task_evaluator(bound: Bound, check: bool = True) -> Callable[[Snapshot], Evaluation]:
    """A Task's evaluation: its loss and metrics over every batch of ``eval_data()``, each
    averaged with the batches' sizes as weights, jitted once per batch shape. Raises
    :class:`hetd.zoo.task.TaskError` when the batches or the loss are wrong (the daemon runs it
    once at start-up, so a wrong task stops it with that one line)."""
    import jax
    import numpy as np

    from hetd.core.evals import Evaluation
    from hetd.zoo.task import TaskError, leading

    step = jax.jit(bound.eval_flat)
    key = jax.random.PRNGKey(bound.seed)

    def evaluate(snap: Snapshot) -> Evaluation:
        sums: dict[str, float] = {}
        total = 0
        for batch in bound.eval_batches():
            try:
                n = leading(batch)
            except ValueError as exc:
                raise TaskError(f"task {bound.name!r}: eval_data: {exc}") from None
            loss, metrics = step(snap.tensors, batch, key)
            for name, value in (("loss", loss), *metrics.items()):
                sums[name] = sums.get(name, 0.0) + float(value) * n
            total += n
        if total == 0:
            raise TaskError(f"task {bound.name!r}: eval_data yielded no batch")
        means = {name: value / total for name, value in sums.items()}
        return Evaluation(means["loss"], means.get("accuracy", math.nan), means)

    def guarded(snap: Snapshot) -> Evaluation:
        # at run time a failing evaluation is logged and recorded as NaN: the daemon goes on
        try:
            return evaluate(snap)
        except Exception as exc:
            log.error("evaluating task %r failed: %s", bound.name, exc)
            return Evaluation(math.nan, math.nan, {"loss": math.nan})

    if check:  # the start-up check, on zeros shaped like the parameters
        from hetd.core.store import Snapshot

        evaluate(Snapshot(0, {k: np.zeros(v, np.float32) for k, v in bound.layout.shapes.items()}))
    return guarded


def _engine_settings(cfg: config_mod.Config, recut: bool = False) -> Any:
    """The engine's settings from a config (its welcome and outer optimizer's rule come from the
    engine's spec)."""
    from hetd.core.entries import EngineConfig

    t = cfg.train
    return EngineConfig(
        global_batch=t.global_batch,
        batch_size=t.batch_size,
        codec=t.codec,
        downlink=t.downlink,
        heartbeat_s=cfg.server.heartbeat_s,
        heartbeat_timeout_s=cfg.server.heartbeat_timeout_s,
        departed_retention_s=cfg.server.departed_retention_s,
        max_departed=cfg.server.max_departed,
        eval_interval_s=t.eval_interval_s,
        max_staleness=t.max_staleness_drop,
        guard_factor=t.guard_factor,
        guard_warmup=t.guard_warmup,
        profile_steps=t.profile_steps,
        shards=t.shards,
        recut_shards=recut,
    )


@dataclass(frozen=True)
class Head:
    """What pservers need of the built engine beyond its log: the daemon's optimizer spec (None:
    the Task's own, which a pserver cannot build from a spec) and the initial parameters."""

    optimizer: str | None
    params: Mapping[str, np.ndarray]


def build_engine(cfg: config_mod.Config, clock: Clock | None = None) -> Engine:
    """Task, store, policy and engine from a config: ``[train] task`` (a user's
    :class:`hetd.Task`), or the bundled ``model`` on ``dataset`` as a task; with ``[pservers]
    log``, the engine writes a decision log (:class:`hetd.pserver.log.DecisionLog`)."""
    return build_head(cfg, clock)[0]


def build_head(cfg: config_mod.Config, clock: Clock | None = None) -> tuple[Engine, Head]:
    """:func:`build_engine`, and what pservers need of it (:class:`Head`)."""
    from hetd.core.assemble import EngineSpec, Optimizers, assemble
    from hetd.zoo.bundled import ZooTask, zoo_task
    from hetd.zoo.task import Bound, TaskError, load_task

    t = cfg.train
    setup = config_mod.worker_setup(cfg)
    bound = Bound(load_task(t.task) if t.task else zoo_task(setup), seed=t.seed)
    task = bound.task
    bundled = isinstance(task, ZooTask)
    if cfg.policy.name == "dpmp" and not bundled:
        raise TaskError(
            f"task {bound.name!r}: policy dpmp cuts a model into pipeline stages, and a Task "
            "offers no stages; pick another policy (lbbsp balances batches the same way)"
        )
    # delayed Nesterov's period ("auto" outer optimizer): the workers the batches describe
    optimizers = Optimizers.of(t, workers=max(1, t.global_batch // max(1, t.batch_size)))
    params = bound.init_flat()
    own, own_outer = task.optimizer, task.outer_optimizer
    task_optimizer = None if own is None else bound.flat_optimizer(own)
    task_outer = None if own_outer is None else bound.flat_optimizer(own_outer)
    evaluator = None
    if task.eval_data is not None:
        evaluator = make_task_evaluator(bound, check=not bundled)
    elif task.target is not None:
        log.warning("task %r has a target but no eval_data: it is never evaluated", bound.name)
    if not bundled:  # what a worker compares with the task its own operator named
        setup["model"]["task"] = {"spec": t.task, **bound.describe()}
        log.info(
            "task %r: %d parameters in %d arrays, optimizer %s%s",
            bound.name,
            bound.layout.size,
            len(bound.layout.shapes),
            "the task's own" if task.optimizer is not None else optimizers.specs()[0],
            "" if task.target is None else f", target {task.target}",
        )
    spec = EngineSpec(
        params=params,
        policy=cfg.policy.name,
        policy_params=cfg.policy.params,
        optimizers=optimizers,
        task_optimizer=task_optimizer,
        task_outer=task_outer,
        welcome=setup,
        settings=_engine_settings(cfg, recut=not bundled),
        store_type=_ledger() if cfg.pservers.headers else None,
    )
    decisions = None
    if cfg.pservers.log:
        from hetd.pserver.log import DecisionLog

        decisions = DecisionLog()
    engine = assemble(spec).engine(clock=clock, evaluator=evaluator, decisions=decisions)
    engine.evaluations.target = task.target
    head = Head(None if task_optimizer is not None else optimizers.specs()[0], params)
    return engine, head


def _ledger() -> type[Store]:
    """The store of a head that holds no parameters (its pservers do)."""
    from hetd.core.ledger import LedgerStore

    return LedgerStore
