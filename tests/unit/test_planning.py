"""The daemon's planning rounds (hetd/server/planning.py) on a running engine: a snapshot on the
engine task, the planner in a thread, the forecast back as a command; the CPU budget; a failing
round logged and the next one run."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import AsyncIterator, Callable

import pytest

from hetd.server.planning import CPU_SHARE, EARLY_POLL_S, Planning
from policies.types import Forecast, Policy
from tests.unit.test_engine import Harness
from tests.unit.test_engine_forecast import recording


@contextlib.asynccontextmanager
async def running(policy: Policy) -> AsyncIterator[Harness]:
    """An engine with two workers timed by a push each, running on its task."""
    h = Harness.of(policy)
    for name in ("a", "b"):
        h.run(f"join {name}")
    for name in ("a", "b"):
        h.run(f"push {name}")
    task = asyncio.create_task(h.engine.run())
    try:
        yield h
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def with_candidates(policy: Policy, candidates: str) -> Policy:
    return policy._replace(params={"candidates": candidates})


def cpu_steps(step: float) -> Callable[[], float]:
    """A CPU clock that moves ``step`` s per reading (a round reads it twice)."""
    ticks = itertools.count()
    return lambda: next(ticks) * step


async def settled(h: Harness) -> list[Forecast]:
    """The forecasts the policy got, once the engine took what was queued."""
    await h.engine.queue.call(lambda: None)
    return [e for e in h.engine.host.state[1] if isinstance(e, Forecast)]


async def test_a_round_hands_the_policy_a_forecast_of_its_candidates() -> None:
    async with running(with_candidates(recording(reads=True), "bsp,asp,dpmp")) as h:
        planning = Planning(h.engine, 30.0)
        assert await planning.round()
        (f,) = await settled(h)
        assert [p.name for p in f.predictions] == ["bsp", "asp"]
        shown = planning.describe()
        assert shown["rounds"] == 1
        assert {p["candidate"] for p in shown["last"]["predictions"]} == {"bsp", "asp"}
        assert [r["candidate"] for r in shown["last"]["refused"]] == ["dpmp"]
        # a full frame is the model's (4 bytes a parameter of the store), not the pushes' bytes
        twin = planning.config.twin
        assert twin is not None and twin.model_bytes == 4.0 * h.engine.store.n_params


async def test_no_round_plans_for_a_policy_that_reads_no_forecasts() -> None:
    async with running(with_candidates(recording(reads=False), "bsp")) as h:
        planning = Planning(h.engine, 30.0)
        assert not await planning.round()
        assert planning.rounds == 0 and planning.describe()["last"] is None
        assert await settled(h) == []


@pytest.mark.parametrize(
    ("cost", "pattern"),
    [(0.5, "RRRR"), (30.0 * CPU_SHARE, "RRRR"), (3.0, "R-R-"), (4.0, "R--R")],
)
async def test_a_costly_round_skips_the_next_ones(cost: float, pattern: str) -> None:
    """Every 30 s, 5 % of a core: 1.5 s a round is free, 3 s skips the next, 4 s two (80 s)."""
    wall = [0.0]
    async with running(with_candidates(recording(reads=True), "bsp")) as h:
        planning = Planning(h.engine, 30.0, cpu_clock=cpu_steps(cost), wall=lambda: wall[0])
        ran = ""
        for k in range(4):
            wall[0] = 30.0 * k
            ran += "R" if await planning.round() else "-"
        assert ran == pattern
        assert planning.skipped == pattern.count("-")
        assert len(await settled(h)) == pattern.count("R")


async def test_a_failing_round_is_logged_and_the_next_one_runs(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async with running(with_candidates(recording(reads=True), "ssp:staleness")) as h:
        planning = Planning(h.engine, 0.01)
        task = asyncio.create_task(planning.run())
        try:
            while planning.failed < 3:
                await asyncio.sleep(0.01)
            assert not task.done()
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        assert task.cancelled()
        assert "a planning round failed" in caplog.text
        assert "must look like key=value" in caplog.text
        # the engine went on: it still answers and the policy still runs
        assert await h.engine.queue.call(lambda: h.engine.host.policy.name) == "recording"


async def test_the_first_round_comes_early_then_every_interval() -> None:
    """Until the running policy had a forecast, a probe every EARLY_POLL_S; then every_s; a
    policy swapped in is planned for early again."""
    slept: list[float] = []

    async def sleep(s: float) -> None:
        slept.append(s)
        if len(slept) > 3:
            raise asyncio.CancelledError

    async with running(with_candidates(recording(reads=True), "bsp,asp")) as h:
        planning = Planning(h.engine, 30.0, cpu_clock=lambda: 0.0, sleep=sleep)
        assert planning.next_in() == EARLY_POLL_S < 30.0
        with contextlib.suppress(asyncio.CancelledError):
            await planning.run()
        assert slept == [EARLY_POLL_S, 30.0, 30.0, 30.0]
        assert len(await settled(h)) == 3
        h.run("swap auto")  # another policy that reads forecasts: planned for early again
        assert planning.next_in() == EARLY_POLL_S


async def test_no_round_while_a_worker_has_no_timing_estimate() -> None:
    async with running(with_candidates(recording(reads=True), "bsp")) as h:
        h.run("join c")  # joined, not yet timed
        planning = Planning(h.engine, 30.0)
        assert not await planning.round()
        assert planning.rounds == 0 and planning.next_in() == EARLY_POLL_S
        h.run("push c")
        assert await planning.round()
        assert planning.next_in() == 30.0
