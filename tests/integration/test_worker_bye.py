"""A worker that leaves cleanly is heard as a leave, with its reason and its last push, even when
the daemon reads its socket late: a real daemon on loopback and a real ``hetd-worker`` process.

A busy daemon (its loop in a publish, an evaluation, another session's decode) reads a worker's
socket some time after the bytes arrived. A worker that closed its connection right after its
``bye`` left them unread in the daemon's kernel buffer, and the daemon's next write to it (the
parameters it sends every worker) failed on the closed connection: asyncio then closes the
transport without reading what is still buffered, and the leave was logged as a crash
("connection closed"). Here the daemon stops reading the worker's socket after its second push
(as a busy loop does), and writes to it while the third push and the bye wait unread."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from aiohttp import web

from hetd.core import commands as cmd
from hetd.protocol.messages import PushIn
from hetd.server import sessions
from tests.conftest import Cluster, until
from workers.client import WAITING_FOR_CLOSE

pytestmark = pytest.mark.slow  # a real worker process

STEPS = 3


async def test_a_bye_the_daemon_reads_late_is_a_leave_with_its_last_push(
    cluster: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    c: Cluster = await cluster("asp")
    loop = asyncio.get_running_loop()
    requests: list[web.Request] = []
    pushes = 0
    handle, decode = sessions.handle, sessions._decode

    async def recorded(request: web.Request, *args: Any, **kwargs: Any) -> web.StreamResponse:
        requests.append(request)
        return await handle(request, *args, **kwargs)

    def paused_after_two(*args: Any, **kwargs: Any) -> Any:
        nonlocal pushes
        item = decode(*args, **kwargs)
        if isinstance(item, PushIn):
            pushes += 1
            transport = requests[-1].transport
            if pushes == STEPS - 1 and transport is not None:  # (maybe in a decode thread)
                loop.call_soon_threadsafe(transport.pause_reading)
        return item

    monkeypatch.setattr(sessions, "handle", recorded)
    monkeypatch.setattr(sessions, "_decode", paused_after_two)
    proc = await c.spawn(1.0, 0.02, "--steps", str(STEPS), "-v")
    log: list[str] = []

    async def read_log() -> None:
        assert proc.stderr is not None
        async for line in proc.stderr:
            log.append(line.decode())

    reader = asyncio.create_task(read_log())
    try:
        # the worker made its last push and said bye: it exited (it closed at once), or it waits
        # for the daemon to close
        await until(
            lambda: proc.returncode is not None or any(WAITING_FOR_CLOSE in s for s in log),
            "the worker's bye",
        )
        (wid,) = c.engine.members.active
        for _ in range(5):  # the daemon writes to it before it reads again: new parameters
            c.engine.queue.submit(cmd.Resend(wid))
            await asyncio.sleep(0.05)
        transport = requests[-1].transport
        if transport is not None:
            transport.resume_reading()
        await until(lambda: bool(c.engine.members.departures), "the worker to leave")
        await asyncio.wait_for(proc.wait(), 60)
        await asyncio.wait_for(reader, 60)
    finally:
        reader.cancel()
    text = "".join(log)
    ((_, _, reason),) = c.engine.members.departures
    assert reason == "max steps reached", (reason, text[-3000:])
    assert c.engine.applier.updates_applied == STEPS  # the push sent before the bye too
    assert proc.returncode == 0 and f"done after {STEPS} pushes" in text, text[-3000:]
