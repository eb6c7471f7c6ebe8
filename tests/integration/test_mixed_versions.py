"""What 0.x promises a worker and a daemon of different releases (docs/design.md, "Compatibility
across 0.x"): the optional fields go only to a worker whose hello names them, and a peer that does
not speak this protocol gets an error that says so, not a crash; a worker leaves at once."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import aiohttp
import msgpack
import pytest
from aiohttp import web

from hetd.local.demo import stop_processes
from hetd.protocol import wire
from hetd.protocol.frames import as_params
from hetd.protocol.params import apply_params, hash_matches
from hetd.server.daemon import Daemon
from tests.conftest import (
    SHARED_LOOP,
    WORKER_AUTH,
    Cluster,
    make_config,
    recv_type,
    start_worker,
)

pytestmark = pytest.mark.slow


def _hello(features: list[str] | None) -> bytes:
    extra = {} if features is None else {"features": features}
    return wire.encode("hello", 1, name="raw", device={"platform": "cpu"}, codecs=["none"], **extra)


@SHARED_LOOP
async def test_only_workers_that_name_the_hash_get_it(raw_asp: Cluster) -> None:
    c = raw_asp
    async with aiohttp.ClientSession() as http:
        plain = await http.ws_connect(c.url + "/v1/ws", headers=WORKER_AUTH)
        new = await http.ws_connect(c.url + "/v1/ws", headers=WORKER_AUTH)
        await plain.send_bytes(_hello(None))  # a worker that takes none of the optional fields
        await new.send_bytes(_hello(["hash", "a-feature-from-the-future"]))
        unhashed = await recv_type(plain, "params")
        hashed = await recv_type(new, "params")
        assert unhashed["full"] and hashed["full"]
        # What a strict decoder that knows no hash would refuse is not in its frame ...
        assert "hash" not in unhashed.body
        # ... and the worker that asked gets the version's hash of the same parameters.
        assert hashed["version"] == unhashed["version"]
        held = apply_params(None, as_params(hashed))
        assert held is not None and hash_matches(held, as_params(hashed)) is True
        await plain.close()
        await new.close()


@SHARED_LOOP
async def test_a_frame_of_another_protocol_version_is_refused_and_the_session_goes_on(
    raw_asp: Cluster,
) -> None:
    c = raw_asp
    async with aiohttp.ClientSession() as http:
        ws = await http.ws_connect(c.url + "/v1/ws", headers=WORKER_AUTH)
        future = {"v": 2, "type": "hello", "id": 5, "name": "next", "device": {}, "codecs": []}
        await ws.send_bytes(msgpack.packb(future))
        refused = await recv_type(ws, "error")
        assert refused["code"] == "bad_version" and refused.id == 5
        assert "speaks 1" in refused["message"] and "same protocol version" in refused["message"]
        await ws.send_bytes(_hello([]))  # the same socket, in this daemon's version: joined
        assert (await recv_type(ws, "welcome"))["worker_id"] >= 1
        await ws.close()


@contextlib.asynccontextmanager
async def _welcomes_in(version: int, seen: list[bytes]) -> AsyncIterator[int]:
    """A daemon of protocol ``version`` as far as a worker can tell: it answers the hello with
    a welcome in that version's envelope (its first frame: its port), and records what it got."""

    async def ws_handler(request: web.Request) -> web.WebSocketResponse:
        ws = web.WebSocketResponse()
        await ws.prepare(request)
        async for frame in ws:
            seen.append(frame.data)
            body = {"worker_id": 1, "plan": {}, "heartbeat_s": 2.0, "shard": {}}
            await ws.send_bytes(msgpack.packb({"v": version, "type": "welcome", "id": 1, **body}))
        return ws

    app = web.Application()
    app.router.add_get("/v1/ws", ws_handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    finally:
        await runner.cleanup()


async def test_a_worker_leaves_with_a_reason_when_its_daemon_speaks_another_version() -> None:
    seen: list[bytes] = []
    procs: list[asyncio.subprocess.Process] = []
    try:
        async with _welcomes_in(2, seen) as port:
            proc = await start_worker(port, 2)
            procs.append(proc)
            assert proc.stderr is not None
            log = (await asyncio.wait_for(proc.stderr.read(), 180)).decode(errors="replace")
            assert await asyncio.wait_for(proc.wait(), 60) != 0, log[-2000:]
            assert "cannot read (bad_version: protocol version 2" in log, log[-2000:]
            assert "Traceback" not in log, log[-2000:]  # said, not crashed
            assert len(seen) == 2  # its hello, then its bye: it did not try again
            assert wire.decode(seen[-1]).type == "bye"
    finally:
        await stop_processes(procs)


async def test_a_worker_leaves_at_once_when_the_daemon_refuses_its_hello(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # This daemon decodes hello as one from before hello's features did: the field is unknown.
    monkeypatch.delitem(wire.SCHEMA["hello"], "features")
    daemon = Daemon(make_config("asp"))
    procs: list[asyncio.subprocess.Process] = []
    try:
        port = await daemon.start()
        proc = await start_worker(port, 2)
        procs.append(proc)
        assert proc.stderr is not None
        log = (await asyncio.wait_for(proc.stderr.read(), 180)).decode(errors="replace")
        assert await asyncio.wait_for(proc.wait(), 60) != 0, log[-2000:]
        assert "the daemon refused this worker's hello (malformed: hello: unknown fields" in log
        assert "Traceback" not in log, log[-2000:]
        assert daemon.engine.store.version == 0  # nobody joined, nothing was applied
    finally:
        await stop_processes(procs)
        with contextlib.suppress(Exception):
            await daemon.stop()
