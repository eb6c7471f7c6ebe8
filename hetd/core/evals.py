"""Evaluations, a part of :class:`hetd.core.engine.Engine` (:class:`Evaluations`): on a fixed grid
of the engine clock (``eval_interval_s`` apart), of a snapshot of the parameters, in a worker
thread (the daemon) or inline (the simulator); each result is stored, and the engine hands the
``Eval`` event it makes to the policy.

Or deferred (:meth:`Evaluations.keep`, the real bench's default): at each point of the grid the
engine hands the snapshot and its time to a keeper, which copies the parameters; nothing is
evaluated, no ``Eval`` event is sent, and the bench evaluates the kept copies after the run, so a
benchmark's probe takes no CPU from what it measures. Only for a policy that does not read ``Eval``
events (``Policy.reads_evals``): :meth:`Evaluations.keep` refuses one that does.

Where the store holds no parameters (a head whose pservers do), :attr:`Evaluations.source` pulls
them: the place is taken when the point is due, the pull and the evaluation (or the keeper's
copy) run in a task, and a point whose parameters cannot be had is passed over.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Awaitable, Callable
from typing import Any

from hetd.core.commands import Command, EvalDone, EvalDue
from hetd.core.peers import Clock
from hetd.core.store import Snapshot
from hetd.zoo.task import Target
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


class Evaluations:
    """The evaluation grid, its results and the task's target. Reaches the engine only through
    ``submit`` (a due point, a finished evaluation: commands on its queue); what the engine does
    with a result (the policy's ``Eval`` event) is the engine's."""

    def __init__(
        self,
        clock: Clock,
        started_at: float,
        interval_s: float,
        inline: bool,
        submit: Callable[[Command], None],
        evaluator: Callable[[Snapshot], tuple[float, float]] | None = None,
    ) -> None:
        self.clock = clock
        self.started_at = started_at
        self.interval_s = interval_s
        self.inline = inline  # evaluate inside the due check (the simulator: virtual time)
        self.submit = submit
        self.evaluator = evaluator
        self.evals: list[tuple[float, float, float]] = []  # (t since start, loss, accuracy)
        # a Task's evaluations: every metric of the last one, by name ("loss" included)
        self.latest: dict[str, float] = {}
        self.history: list[tuple[float, dict[str, float]]] = []  # (t since start, metrics)
        self.target: Target | None = None  # a Task's target: when reached, target_at is set
        self.target_at: float | None = None  # s since start of the first evaluation meeting it
        self.keeper: Keeper | None = None  # deferred evaluations: who keeps the grid's snapshots
        # where the parameters come from when the store holds none (a head whose pservers do):
        # called on the engine's task, it takes the place; what it returns is awaited later
        # (None: not to be had now, this point of the grid is passed over)
        self.source: Callable[[], Awaitable[Snapshot | None]] | None = None
        self._last = -math.inf
        self._task: asyncio.Task[None] | None = None

    async def timer(self, idle_s: float) -> None:
        """Due points on their grid, not at the first tick after them (``idle_s``: how long to
        wait while there is no grid yet)."""
        while True:
            due = self._last + self.interval_s - self.clock.now()
            await asyncio.sleep(max(0.01, due) if math.isfinite(due) else idle_s)
            self.submit(EvalDue())

    def anchor(self, at: float) -> None:
        """Evaluate at ``at`` + k × ``interval_s`` from now on (engine clock)."""
        self._last = at

    def keep(self, keeper: Keeper | None, policy: Any) -> None:
        """Defer evaluations to ``keeper`` (None: evaluate live again); ValueError when
        ``policy`` reads ``Eval`` events (it would never get one)."""
        if keeper is not None and policy.reads_evals:
            raise ValueError(
                f"policy {policy.name!r} reads Eval events: its evaluations must stay live"
            )
        self.keeper = keeper

    def due(self, now: float, snapshot: Callable[[], Snapshot]) -> Eval | None:
        """Start an evaluation when the next point of the grid (at a fixed rate: a late one does
        not move the next) is due and none is running; an inline one's ``Eval`` event."""
        interval = self.interval_s
        if self.evaluator is None or self._task is not None or now - self._last < interval:
            return None
        last = self._last
        self._last = now if not math.isfinite(last) else now - (now - last) % interval
        if self.source is not None and not self.inline:
            pulled = self.source()
            self._task = asyncio.get_running_loop().create_task(self._pulled(pulled, now))
        elif self.keeper is not None:
            self.keeper(snapshot(), now)
        elif self.inline:
            result = self.evaluator(snapshot())
            return self.record(*result, now, metrics=metrics_of(result))
        else:
            self._task = asyncio.get_running_loop().create_task(self._evaluate(snapshot(), now))
        return None

    async def _evaluate(self, snap: Snapshot, taken: float) -> None:
        assert self.evaluator is not None  # checked by the caller; not network input
        try:
            result = await asyncio.to_thread(self.evaluator, snap)
        finally:
            self._task = None
        self.submit(EvalDone(result, taken))

    async def _pulled(self, pulled: Awaitable[Snapshot | None], taken: float) -> None:
        """An evaluation (or a keeper's copy) of parameters pulled from elsewhere."""
        try:
            try:
                snap = await pulled
            except (OSError, ValueError) as exc:  # (a slice that failed its hash check)
                log.warning("no evaluation at %.1f s: the parameters: %s", taken, exc)
                return
            if snap is None:
                log.info("no evaluation at %.1f s: the parameters were not to be had", taken)
                return
            if self.keeper is not None:
                self.keeper(snap, taken)
                return
            assert self.evaluator is not None  # (due checks it)
            result = await asyncio.to_thread(self.evaluator, snap)
        finally:
            self._task = None
        self.submit(EvalDone(result, taken))

    def cancel(self) -> None:
        """Stop an evaluation under way (the engine stops)."""
        if self._task is not None:
            self._task.cancel()

    def record(
        self,
        loss: float,
        accuracy: float,
        taken: float | None = None,
        metrics: dict[str, float] | None = None,
    ) -> Eval:
        """Store an evaluation; the ``Eval`` event for the policy. ``taken`` (engine clock,
        default now) is when the evaluated parameters were snapshotted: ``evals`` keeps that
        time, not the end of an evaluation that took seconds on a loaded host (a time-to-target
        read from it would be late by as much)."""
        now = self.clock.now()
        at = (now if taken is None else taken) - self.started_at
        self.evals.append((at, loss, accuracy))
        self.latest = metrics if metrics is not None else {"loss": loss, "accuracy": accuracy}
        self.history.append((at, self.latest))
        if self.target is not None and self.target_at is None and self.target.reached(self.latest):
            self.target_at = at
            log.info(
                "target %s reached at %.1f s: %s",
                self.target,
                at,
                ", ".join(f"{k} {v:.4g}" for k, v in self.latest.items()),
            )
        return Eval(now, loss, accuracy)
