"""The daemon's planning rounds: a forecast for a policy that reads forecasts (``auto``), every
``[policy] plan_every_s``.

Owns :class:`Planning`, a task the daemon starts with its engine and cancels on stop. Each round
takes a snapshot of the view and the running policy's candidates on the engine task (so they are
the state between two events), runs :func:`hetd.core.planner.plan` in a worker thread (the event
loop and the engine go on meanwhile) and submits the forecast as a
:class:`~hetd.core.commands.Forecast` command, which the engine hands to the policy if it still
reads forecasts. A round while the running policy reads none costs one engine call and nothing
else, so the task follows hot swaps to and from ``auto`` by itself.

When: the first round as soon as the running policy reads forecasts and every worker has a
timing estimate (probed every :data:`EARLY_POLL_S`: a probe is one engine call), then every
``every_s``; a policy swapped in later is planned for early the same way. A forecast made late
leaves a wrong policy running for the whole interval; one made before the workers are timed has
nothing to run the twin on.

Its CPU budget: planning may take :data:`CPU_SHARE` of one core over time. A round that took ``c``
CPU seconds (the planner's thread, ``time.thread_time``) lets the next one start no sooner than
``c / CPU_SHARE`` seconds after it began; the rounds due before then are skipped (counted). So
with the default 30 s a round of up to 1.5 s costs nothing, and a 3 s one skips the next round.

A round that fails is logged and the next one runs as usual: planning never stops the daemon.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the engine brings JAX: the daemon imports this module before it listens
    from hetd.core.engine import Engine
    from hetd.core.planner import Candidate, Planned, PlannerConfig
    from policies.types import ClusterView, Policy

log = logging.getLogger("hetd.server.planning")

CPU_SHARE = 0.05  # of one core, over time, at most
# s between probes until the running policy had its first forecast: a probe is one engine call,
# and each probe's delay is time a policy just swapped in (auto starts on its default) runs
# unweighed (1 s cost auto a fifth of S1's time to the target in real mode)
EARLY_POLL_S = 0.1


class Planning:
    """The planning rounds of one daemon: run by :meth:`run` (cancelled on stop), read by
    :meth:`describe` (``hetd status``)."""

    def __init__(
        self,
        engine: Engine,
        every_s: float,
        config: PlannerConfig | None = None,
        cpu_clock: Callable[[], float] = time.thread_time,
        wall: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        from hetd.core.planner import PlannerConfig

        self.engine = engine
        self.every_s = every_s
        self.config = config or PlannerConfig.for_engine(engine.config, engine.store.n_params)
        self.cpu_clock = cpu_clock  # read in the planner's thread: its CPU time alone
        self.wall = wall
        self.sleep = sleep
        self.planned_for: Policy | None = None  # the policy the last forecast was made for
        self.rounds = 0  # forecasts made
        self.skipped = 0  # rounds skipped for the CPU budget
        self.failed = 0  # rounds that raised
        self.not_before = -float("inf")  # wall s: the next round may start then
        self.last: Planned | None = None
        self.last_at = 0.0  # wall s: when the last forecast was made
        self._told: set[tuple[str, str]] = set()  # refusals logged once each

    def next_in(self) -> float:
        """Seconds to the next round: ``every_s`` once the running policy had a forecast, a probe
        sooner (:data:`EARLY_POLL_S`) before."""
        if self.planned_for is not None and self.planned_for is self.engine.host.policy:
            return self.every_s
        return min(self.every_s, EARLY_POLL_S)

    async def run(self) -> None:
        """Rounds until cancelled (:meth:`next_in` apart); a failed round is logged, never
        raised."""
        task = asyncio.current_task()
        while task is None or not task.cancelling():  # (a cancel swallowed below still ends it)
            await self.sleep(self.next_in())
            try:
                await self.round()
            except asyncio.CancelledError:
                raise
            except Exception:
                self.failed += 1
                log.exception("a planning round failed; the next one runs as usual")

    async def round(self) -> bool:
        """One round: whether a forecast was submitted."""
        from hetd.core import commands as cmd
        from hetd.core.planner import plan

        began = self.wall()
        if began < self.not_before:
            self.skipped += 1
            return False
        # asyncio.timeout, not wait_for: Python 3.11's wait_for loses a cancel that comes as the
        # call completes, and the daemon's stop then waited for this task for ever
        async with asyncio.timeout(self.every_s):
            taken = await self.engine.queue.call(self._take)
        if taken is None:  # the running policy reads no forecasts
            return False
        view, candidates, policy = taken
        planned = await asyncio.to_thread(plan, view, candidates, self.config, self.cpu_clock)
        self.not_before = began + planned.forecast.cost_s / CPU_SHARE
        self.last = planned
        self.last_at = self.wall()
        self.rounds += 1
        for refusal in planned.refused:
            if refusal not in self._told:
                self._told.add(refusal)
                log.info("planner: candidate %s left out: %s", *refusal)
        if not planned.forecast.predictions:
            return False
        self.engine.queue.submit(cmd.Forecast(planned.forecast))
        self.planned_for = policy
        return True

    def _take(self) -> tuple[ClusterView, tuple[Candidate, ...], Policy] | None:
        """On the engine task: the view, the candidates and the policy, or None when the running
        policy reads no forecasts, has no workers to plan for, or a worker has no timing
        estimate yet."""
        from hetd.core.planner import candidates_of, snapshot, untimed

        engine = self.engine
        policy = engine.host.policy
        if not policy.reads_forecasts or not engine.members.facts:
            return None
        view = snapshot(engine.view())
        if untimed(view):
            return None
        return view, candidates_of(policy), policy

    def describe(self) -> dict[str, Any]:
        """The rounds and the last forecast, as plain values (``hetd status``)."""
        from hetd.core.planner import describe_forecast

        out: dict[str, Any] = {
            "every_s": self.every_s,
            "rounds": self.rounds,
            "skipped": self.skipped,
            "failed": self.failed,
            "last": None,
        }
        if self.last is not None:
            out["last"] = {
                **describe_forecast(self.last.forecast),
                "age_s": max(0.0, self.wall() - self.last_at),
                "refused": [{"candidate": c, "why": why} for c, why in self.last.refused],
            }
        return out
