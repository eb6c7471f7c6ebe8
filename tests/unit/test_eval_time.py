"""An evaluation is recorded at the time its parameters were taken, not when it finished: on a
loaded host a 2M-parameter evaluation took seconds, and a time-to-target read from the end would
be late by as much (and the real bench's t = 0 restart saw an evaluation of the parameters before
it land after it)."""

from __future__ import annotations

import asyncio
import contextlib

import numpy as np
import optax

from hetd.core import Engine, EngineConfig
from hetd.core.store import Snapshot, Store
from policies import make_policy
from tests.conftest import FakeClock

EVAL_S = 5.0  # how long each evaluation takes on the engine's clock


def engine(inline: bool) -> tuple[Engine, FakeClock]:
    clock = FakeClock()

    def slow(snap: Snapshot) -> tuple[float, float]:
        clock.t += EVAL_S
        return 1.0, 0.5

    params = {"w": np.zeros((3, 2), np.float32)}
    config = EngineConfig(batch_size=16, profile_steps=0, eval_interval_s=2.0, eval_inline=inline)
    return Engine(Store(params, optax.sgd(0.1)), make_policy("asp"), config, clock, slow), clock


def test_an_inline_evaluation_is_timed_at_its_snapshot() -> None:
    e, clock = engine(inline=True)
    clock.t += 3.0
    e.tick()
    assert [t for t, _, _ in e.evaluations.evals] == [3.0]
    assert clock.t - e.started_at == 3.0 + EVAL_S


async def test_a_threaded_evaluation_is_timed_at_its_snapshot() -> None:
    e, clock = engine(inline=False)
    task = asyncio.create_task(e.run())
    try:
        clock.t += 3.0
        await e.queue.call(e.tick)
        for _ in range(200):
            if e.evaluations.evals:
                break
            await asyncio.sleep(0.01)
        assert [t for t, _, _ in e.evaluations.evals[:1]] == [3.0]
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
