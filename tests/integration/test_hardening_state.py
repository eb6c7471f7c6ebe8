"""What a flood costs a real daemon: hello-then-leave connections leave nothing in the worker table
or the checkpoint, and big frames are decoded within the daemon's decode budget."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from tests.conftest import WORKER_AUTH as AUTH
from tests.conftest import raw_hello as hello
from tests.conftest import recv_type as recv

pytestmark = pytest.mark.slow


async def test_hello_then_leave_connections_leave_nothing_behind(cluster) -> None:  # type: ignore[no-untyped-def]
    c = await cluster("asp")
    before = len((await c.engine.queue.call(c.engine.state)).workers)

    async def hello_then_leave(http: aiohttp.ClientSession) -> int:
        async with http.ws_connect(c.url + "/v1/ws", headers=AUTH, max_msg_size=0) as ws:
            await ws.send_bytes(hello())
            return int((await recv(ws, "welcome"))["worker_id"])

    async with aiohttp.ClientSession() as http:
        ids: list[int] = []
        for _ in range(10):  # 200 connections, 20 at a time
            ids += await asyncio.gather(*(hello_then_leave(http) for _ in range(20)))
    assert len(set(ids)) == 200  # each was a worker, welcomed with its own id
    await c.wait_for(lambda: not c.engine.members.entries, 60, "the flood's sessions to end")
    state = await c.engine.queue.call(c.engine.state)
    assert len(state.workers) == before and not c.engine.members.departed


async def test_big_frames_are_decoded_within_the_budget(cluster) -> None:  # type: ignore[no-untyped-def]
    c = await cluster("asp", server={"max_decodes": 1, "decode_bytes": 1 << 20})
    budget = c.daemon.decodes
    assert (budget.max_decodes, budget.max_bytes) == (1, 1 << 20)
    async with aiohttp.ClientSession() as http:
        ws = await http.ws_connect(c.url + "/v1/ws", headers=AUTH, max_msg_size=0)
        await ws.send_bytes(hello())
        await recv(ws, "welcome")
        held = budget.held
        await ws.send_bytes(b"\xc1" * (512 * 1024))  # big enough to decode off the loop
        err = await recv(ws, "error")
        assert err["code"] == "malformed"
        assert budget.held == held + 1 and (budget.running, budget.bytes) == (0, 0)
        await ws.close()
