"""The two servers-side pieces of the system benchmark that are not the daemon itself.

* :class:`BareServer` — the physical limit: a bare aiohttp websocket server with no hetd code on the
  path. Every binary frame it receives is answered with frames of fixed sizes (those of an ``ack``
  and a ``params`` frame measured in the hetd run), prebuilt once, as the daemon shares each
  published version's frame. It counts what it received and sent.
* :func:`measure_startup` — seconds from launching ``hetd serve`` and N ``hetd-worker`` processes
  (all at once, as a user would) to the first applied update, read from the daemon's ``/healthz``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import socket
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from typing import Any

from aiohttp import WSMsgType, web

from hetd.local.procs import spawn_daemon, spawn_worker, stop_processes, wait_ready, worker_env


class BareServer:
    """A websocket echo of fixed-size replies on ``/bare``; counts frames and bytes."""

    def __init__(self, cap: int) -> None:
        self._cap = cap
        self._replies: list[bytes] = []
        self._runner: web.AppRunner | None = None
        self.port = 0
        self.exchanges = 0  # frames received and answered
        self.bytes_in = 0
        self.bytes_out = 0

    def set_replies(self, sizes: Sequence[int]) -> None:
        """Answer each frame with frames of these sizes (built once here)."""
        self._replies = [bytes(n) for n in sizes]

    async def start(self) -> int:
        """Listen on a free loopback port; returns it."""
        app = web.Application()
        app.router.add_get("/bare", self._handle)
        self._runner = web.AppRunner(app, handle_signals=False)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        sockets = getattr(site._server, "sockets", None) or []
        self.port = int(sockets[0].getsockname()[1])
        return self.port

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        ws = web.WebSocketResponse(max_msg_size=self._cap, compress=False)
        await ws.prepare(request)
        async for frame in ws:
            if frame.type != WSMsgType.BINARY:
                break
            self.exchanges += 1
            self.bytes_in += len(frame.data)
            for reply in self._replies:
                await ws.send_bytes(reply)
                self.bytes_out += len(reply)
        return ws

    async def stop(self) -> None:
        """Close the listener and every connection."""
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None


def free_port() -> int:
    """A loopback TCP port free right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _version(port: int) -> int | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=1.0) as reply:
            version: int = json.loads(reply.read())["version"]
            return version
    except (OSError, urllib.error.URLError, ValueError, KeyError):
        return None


async def measure_startup(
    workers: int, timeout: float = 90.0, extra: Sequence[str] = ()
) -> dict[str, Any]:
    """Launch a daemon (``python -m hetd serve``, its defaults: mnist5k, MLP, ssp) and ``workers``
    ``hetd-worker`` processes at the same moment; seconds until ``/healthz`` shows version >= 1.

    Also reports when the daemon first answered ``/healthz`` (listening: imports, data, model
    done). Every process started here is stopped before returning.
    """
    port = free_port()
    env = worker_env(secrets.token_hex(8))
    procs: list[asyncio.subprocess.Process] = []
    listening: float | None = None  # s from t0 to the first answer, and to version 1
    first: float | None = None
    t0 = time.monotonic()

    async def first_update() -> bool:
        nonlocal listening, first
        version = await asyncio.to_thread(_version, port)
        now = time.monotonic() - t0
        if version is not None and listening is None:
            listening = now
        if version is not None and version >= 1:
            first = now
        return first is not None

    try:
        procs.append(await spawn_daemon("--port", str(port), "--admin-port", "-1", *extra, env=env))
        for i in range(workers):
            procs.append(
                await spawn_worker(
                    f"ws://127.0.0.1:{port}",
                    "--name",
                    f"startup-{i}",
                    "--max-retries",
                    "100",
                    env=env,
                )
            )
        await wait_ready(
            first_update,
            procs[0],
            timeout=timeout - (time.monotonic() - t0),
            interval=0.02,
            late=f"no update applied within {timeout:g} s of start-up",
        )
        return {
            "workers": workers,
            "seconds_to_first_update": None if first is None else round(first, 3),
            "seconds_to_listening": None if listening is None else round(listening, 3),
        }
    finally:
        with contextlib.suppress(Exception):
            await stop_processes(procs)
