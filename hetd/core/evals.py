"""Evaluations, a part of :class:`hetd.core.engine.Engine`: on a fixed grid of the engine clock
(``eval_interval_s`` apart), of a snapshot of the parameters, in a worker thread (the daemon) or
inline (the simulator); each result is stored and reaches the policy as an ``Eval`` event.

Or deferred (:meth:`EvalMixin.keep_evals`, the real bench's default): at each point of the grid the
engine hands the snapshot and its time to a keeper, which copies the parameters; nothing is
evaluated, no ``Eval`` event is sent, and the bench evaluates the kept copies after the run, so a
benchmark's probe takes no CPU from what it measures. Only for a policy that does not read ``Eval``
events (``Policy.reads_evals``): :meth:`keep_evals` refuses one that does.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Callable

from hetd.core.commands import EvalDone, EvalDue
from hetd.core.entries import EngineBase
from hetd.core.store import Snapshot
from policies.types import Eval

log = logging.getLogger("hetd.core.engine")

Keeper = Callable[[Snapshot, float], None]
"""(snapshot, engine-clock time it was taken) -> None: keeps a copy to evaluate later."""


class Evaluation(tuple[float, float]):
    """An evaluator's ``(loss, accuracy)`` that also carries every metric by name (a Task's:
    ``loss`` and what its loss function returns; accuracy is NaN for a task without one)."""

    metrics: dict[str, float]

    def __new__(cls, loss: float, accuracy: float, metrics: dict[str, float]) -> Evaluation:
        made = super().__new__(cls, (loss, accuracy))
        made.metrics = metrics
        return made


def metrics_of(result: tuple[float, float]) -> dict[str, float]:
    """The metrics of an evaluator's result: an :class:`Evaluation`'s own, else loss and
    accuracy."""
    if isinstance(result, Evaluation):
        return dict(result.metrics)
    return {"loss": result[0], "accuracy": result[1]}


class EvalMixin(EngineBase):
    """:meth:`anchor_evals`, :meth:`keep_evals`, :meth:`record_eval` and the evaluation timer."""

    _keeper: Keeper | None = None  # deferred evaluations: who keeps the grid's snapshots

    async def _eval_timer(self) -> None:
        """Evaluations on their grid, not at the first tick after it (ticks are 0.25 s apart)."""
        while True:
            due = self._last_eval + self.config.eval_interval_s - self.clock.now()
            await asyncio.sleep(max(0.01, due) if math.isfinite(due) else self.config.tick_s)
            self.submit(EvalDue())

    def anchor_evals(self, at: float) -> None:
        """Evaluate at ``at`` + k × ``eval_interval_s`` from now on (engine clock): the real bench
        puts the grid on its t = 0, where the simulator evaluates."""
        self._last_eval = at

    def keep_evals(self, keeper: Keeper | None) -> None:
        """Defer evaluations: from now on each point of the grid calls ``keeper(snapshot, now)``
        (on the engine's task; the snapshot's memory is the store's, so the keeper copies what it
        keeps) instead of evaluating; None evaluates live again. ValueError if the running policy
        reads ``Eval`` events (it would never get one); a policy swapped in later is checked by
        the caller."""
        if keeper is not None and self.policy.reads_evals:
            raise ValueError(
                f"policy {self.policy.name!r} reads Eval events: its evaluations must stay live"
            )
        self._keeper = keeper

    def _evaluate_if_due(self, now: float) -> None:
        """Start an evaluation when the next point of the grid (``eval_interval_s`` apart, at a
        fixed rate: a late one does not move the next) is due and none is running."""
        interval = self.config.eval_interval_s
        if (
            self.evaluator is not None
            and self._eval_task is None
            and now - self._last_eval >= interval
        ):
            last = self._last_eval
            self._last_eval = now if not math.isfinite(last) else now - (now - last) % interval
            if self._keeper is not None:
                self._keeper(self.store.snapshot(), now)
            elif self.config.eval_inline:
                result = self.evaluator(self.store.snapshot())
                self.record_eval(*result, now, metrics=metrics_of(result))
            else:
                self._eval_task = asyncio.get_running_loop().create_task(
                    self._evaluate(self.store.snapshot(), now)
                )

    async def _evaluate(self, snap: Snapshot, taken: float) -> None:
        assert self.evaluator is not None  # checked by the caller; not network input
        try:
            result = await asyncio.to_thread(self.evaluator, snap)
        finally:
            self._eval_task = None
        self.submit(EvalDone(result, taken))

    def record_eval(
        self,
        loss: float,
        accuracy: float,
        taken: float | None = None,
        metrics: dict[str, float] | None = None,
    ) -> None:
        """Store an evaluation and tell the policy. ``taken`` (engine clock, default now) is when
        the evaluated parameters were snapshotted: ``evals`` keeps that time, not the end of an
        evaluation that took seconds on a loaded host (a time-to-target read from it would be
        late by as much, and the real bench's t = 0 restart would see an evaluation of the
        parameters before it land after it)."""
        now = self.clock.now()
        at = now if taken is None else taken
        self.evals.append((at - self.started_at, loss, accuracy))
        self.eval_metrics = metrics if metrics is not None else {"loss": loss, "accuracy": accuracy}
        self.metric_evals.append((at - self.started_at, self.eval_metrics))
        if (
            self.target is not None
            and self.target_at is None
            and self.target.reached(self.eval_metrics)
        ):
            self.target_at = at - self.started_at
            log.info(
                "target %s reached at %.1f s: %s",
                self.target,
                self.target_at,
                ", ".join(f"{k} {v:.4g}" for k, v in self.eval_metrics.items()),
            )
        self._dispatch(Eval(now, loss, accuracy))
