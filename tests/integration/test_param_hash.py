"""A real worker checks the hash of every full ``params`` frame: against the daemon it finds no
mismatch; behind a peer that tampers with one frame it finds that one, pulls again and trains on
the parameters the daemon published."""

from __future__ import annotations

import asyncio
import contextlib
import re
import time

import aiohttp
import msgpack
import pytest
from aiohttp import web

from hetd.local.procs import stop_processes

pytestmark = pytest.mark.slow  # a real daemon on loopback (and real worker processes)

VERIFIED = re.compile(r"params hash verified: version (\d+) \(hash_mismatches=(\d+)\)")
MISMATCH = re.compile(r"params hash mismatch: version (\d+) .*\(hash_mismatches=(\d+)\)")


async def _log_until(
    proc: asyncio.subprocess.Process, pattern: re.Pattern[str], timeout: float
) -> tuple[list[str], re.Match[str]]:
    """The worker's log lines up to the first that matches ``pattern``."""
    assert proc.stderr is not None
    lines: list[str] = []
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        assert left > 0, f"no {pattern.pattern!r} in the worker's log: {''.join(lines)[-3000:]}"
        raw = await asyncio.wait_for(proc.stderr.readline(), left)
        assert raw, f"the worker ended: {''.join(lines)[-3000:]}"
        lines.append(raw.decode())
        found = pattern.search(lines[-1])
        if found:
            return lines, found


async def test_a_worker_verifies_full_pulls(cluster) -> None:  # type: ignore[no-untyped-def]
    c = await cluster("asp")
    proc = await c.spawn(1.0, 0.01, "-v")
    lines, found = await _log_until(proc, VERIFIED, 60)
    assert found.group(2) == "0"
    assert not any(MISMATCH.search(line) for line in lines)
    await c.wait_for(lambda: c.engine.store.version >= 10, 60, "10 updates on verified params")
    await stop_processes([proc])
    assert proc.stderr is not None
    rest = (await proc.stderr.read()).decode()
    assert "hash mismatch" not in rest, rest[-2000:]


async def _tampering_proxy(upstream: str, tampered: list[int]) -> tuple[web.AppRunner, str]:
    """A websocket peer between worker and daemon that flips one bit in the first tensor of the
    first full ``params`` frame it forwards (the frame keeps its hash)."""

    async def handle(request: web.Request) -> web.WebSocketResponse:
        down = web.WebSocketResponse(max_msg_size=0)
        await down.prepare(request)
        headers = {"Authorization": request.headers.get("Authorization", "")}
        async with aiohttp.ClientSession() as http:
            up = await http.ws_connect(upstream + "/v1/ws", headers=headers, max_msg_size=0)

            async def to_daemon() -> None:
                async for msg in down:
                    if msg.type != aiohttp.WSMsgType.BINARY:
                        break
                    await up.send_bytes(msg.data)
                await up.close()

            async def to_worker() -> None:
                async for msg in up:
                    if msg.type != aiohttp.WSMsgType.BINARY:
                        break
                    data = msg.data
                    raw = msgpack.unpackb(data, raw=False)
                    if raw.get("type") == "params" and raw.get("full") and not tampered:
                        tensor = raw["tensors"][next(iter(raw["tensors"]))]
                        flipped = bytearray(tensor["data"])
                        flipped[0] ^= 1
                        tensor["data"] = bytes(flipped)
                        tampered.append(raw["version"])
                        data = msgpack.packb(raw, use_bin_type=True)
                    await down.send_bytes(data)
                await down.close()

            tasks = [asyncio.create_task(to_daemon()), asyncio.create_task(to_worker())]
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            for task in tasks:
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task
            await up.close()
        return down

    app = web.Application()
    app.router.add_get("/v1/ws", handle)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return runner, f"ws://127.0.0.1:{port}"


async def test_a_tampered_frame_is_detected_and_pulled_again(cluster) -> None:  # type: ignore[no-untyped-def]
    c = await cluster("asp")
    tampered: list[int] = []
    runner, proxy = await _tampering_proxy(c.url, tampered)
    try:
        daemon_url, c.url = c.url, proxy  # the worker connects through the tampering peer
        proc = await c.spawn(1.0, 0.01, "-v")
        c.url = daemon_url
        lines, bad = await _log_until(proc, MISMATCH, 60)
        assert tampered and int(bad.group(1)) == tampered[0]
        assert bad.group(2) == "1"
        more, good = await _log_until(proc, VERIFIED, 60)
        assert good.group(2) == "1"  # the count stays visible in the verified line
        rows = c.engine.workers()
        assert len(rows) == 1
        # The tampered parameters were never delivered to the compute loop; training goes on.
        await c.wait_for(lambda: c.engine.store.version >= 10, 60, "10 updates after the mismatch")
        await stop_processes([proc])
        assert proc.stderr is not None
        rest = (await proc.stderr.read()).decode()
        assert len(MISMATCH.findall("".join(lines + more) + rest)) == 1, rest[-2000:]
    finally:
        await runner.cleanup()
