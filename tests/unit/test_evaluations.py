"""The engine's evaluations as a part of their own (:class:`hetd.core.evals.Evaluations`): the grid,
inline evaluation, the keeper, the target, and the commands it submits — without an engine."""

from __future__ import annotations

import asyncio
import math
from typing import Any

import numpy as np
import pytest

from hetd.core import commands as cmd
from hetd.core.evals import Evaluation, Evaluations
from hetd.core.store import Snapshot
from hetd.zoo.task import Target
from policies import make_policy
from policies.types import Eval
from tests.conftest import FakeClock


def snap(version: int = 3) -> Snapshot:
    return Snapshot(version, {"w": np.zeros(2, np.float32)})


def make(inline: bool = True, evaluator: Any = None) -> tuple[Evaluations, list[cmd.Command]]:
    sent: list[cmd.Command] = []
    clock = FakeClock()
    ev = Evaluations(clock, 100.0, 1.0, inline, sent.append, evaluator)
    return ev, sent


def test_inline_evaluations_keep_their_grid_and_reach_the_target_once() -> None:
    ev, sent = make(evaluator=lambda s: Evaluation(0.5, math.nan, {"loss": 0.5, "mse": 0.01}))
    ev.target = Target.parse({"metric": "mse", "mode": "min", "value": 0.05})
    clock = ev.clock
    assert isinstance(clock, FakeClock)
    events = []
    for t in (100.0, 100.4, 101.2, 101.3, 103.9):
        clock.t = t
        events.append(ev.due(t, snap))
    got = [e for e in events if e is not None]
    assert all(isinstance(e, Eval) for e in got) and len(got) == 3  # 100, 101.2, 103.9
    assert [round(t, 2) for t, _, _ in ev.evals] == [0.0, 1.2, 3.9]
    assert ev.latest == {"loss": 0.5, "mse": 0.01} and len(ev.history) == 3
    assert ev.target_at == 0.0  # the first one met it; later ones do not move it
    assert sent == []  # inline: nothing goes through the engine's queue


def test_without_an_evaluator_nothing_is_due() -> None:
    ev, _ = make(evaluator=None)
    assert ev.due(200.0, snap) is None and ev.evals == []


def test_a_keeper_takes_the_snapshots_and_a_policy_reading_evals_refuses_one() -> None:
    ev, _ = make(evaluator=lambda s: (1.0, 0.0))
    kept: list[tuple[int, float]] = []
    ev.keep(lambda s, t: kept.append((s.version, t)), make_policy("asp"))
    assert ev.due(100.0, snap) is None and kept == [(3, 100.0)] and ev.evals == []
    assert make_policy("ashl").reads_evals  # its stage switch reads the loss
    with pytest.raises(ValueError, match="reads Eval events"):
        ev.keep(lambda s, t: None, make_policy("ashl"))


def test_a_threaded_evaluation_comes_back_as_a_command_with_its_snapshot_time() -> None:
    async def run() -> list[cmd.Command]:
        ev, sent = make(inline=False, evaluator=lambda s: (0.25, 0.75))
        assert ev.due(100.0, snap) is None
        assert ev.due(200.0, snap) is None  # one at a time: none starts while one runs
        for _ in range(200):
            if sent:
                break
            await asyncio.sleep(0.01)
        return sent

    sent = asyncio.run(run())
    assert sent == [cmd.EvalDone((0.25, 0.75), 100.0)]
