"""What a worker logs at the default level (:mod:`workers.progress`), driven by a table of steps
under a fake clock: the join with the first parameters, staleness as the versions others applied
between two steps, plan and stage changes (not the per-round batch sizes), the transport."""

from __future__ import annotations

import logging
from typing import NamedTuple

import pytest

from hetd.protocol.plan import Plan
from workers.progress import Progress


class Shard(NamedTuple):
    index: int
    count: int


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def now(self) -> float:
        return self.t


def messages(caplog: pytest.LogCaptureFixture) -> list[str]:
    out = [r.getMessage() for r in caplog.records if r.name == "hetd.worker.progress"]
    caplog.clear()
    return out


def test_join_progress_and_changes(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, "hetd.worker.progress")
    clock = Clock()
    p = Progress("ws://head:7070", now=clock.now)
    assert p.line() == "no push in the last 0 s: waiting for the daemon"

    p.joined(3, "gpu-box", Shard(1, 4))
    assert messages(caplog) == []  # logged with the first parameters
    plan = Plan(batch_size=32)
    # (version of the step's parameters, batch) for four steps: 3 then 1 then 0 updates by others
    for version, batch in ((10, 32), (14, 32), (16, 48), (17, 64)):
        p.took(version, Plan(batch_size=batch), "websocket")
        p.pushed(batch, batch)
        clock.t += 5.0
    assert messages(caplog) == [
        "joined ws://head:7070 as worker 3 (gpu-box), shard 1 of 4, over websocket; stage main, "
        "plan: batch 32, 1 local step, codec none, version 10"
    ]  # batch sizes move every round under lbbsp: no line for them
    assert p.line() == (
        "4 pushes (+4 in 20 s), 8.8 samples/s, batch 32-64, staleness 1.3, version 17, "
        "over websocket"
    )
    clock.t += 30.0
    assert p.line() == "no push in the last 30 s (holding version 17): waiting for the daemon"

    p.took(18, Plan(batch_size=32, codec="int8"), "shared memory")
    p.took(19, Plan(batch_size=32, codec="int8", stage="shl"), "shared memory")
    assert messages(caplog) == [
        "parameters and pushes now go over shared memory",
        "plan changed: codec none -> int8",
        "stage main -> shl, plan: batch 32, 1 local step, codec int8",
    ]
    assert plan.stage == "main"


def test_a_new_session_logs_its_join_and_does_not_count_staleness_across_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, "hetd.worker.progress")
    p = Progress("ws://head:7070", now=Clock().now)
    p.joined(3, "w", None)
    p.took(100, Plan(), "websocket")
    p.pushed(32, 32)
    p.joined(3, "w", None)  # reconnected
    p.took(500, Plan(), "websocket")
    p.pushed(32, 32)
    lines = messages(caplog)
    assert len(lines) == 2 and all(
        line.startswith("joined ws://head:7070 as worker 3 (w), over") for line in lines
    ), lines
    assert ", staleness -, version 500" in p.line()  # none measured within one session
