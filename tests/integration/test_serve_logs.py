"""What ``hetd serve`` tells an operator: the listening line first (before the model is built),
then one INFO line per event (``-q`` and ``-v``: tests/unit/test_log_levels.py)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import urllib.request

import pytest

from hetd.local.procs import spawn_daemon
from tests.conftest import ADMIN_TOKEN, WORKER_TOKEN

pytestmark = pytest.mark.slow


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


async def serve(*flags: str) -> tuple[asyncio.subprocess.Process, int]:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("HETD_")}
    env.update(
        HETD_WORKER_TOKEN=WORKER_TOKEN,
        HETD_ADMIN_TOKEN=ADMIN_TOKEN,
        JAX_PLATFORMS="cpu",
    )
    proc = await spawn_daemon(
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--admin-port",
        "-1",
        "--dataset",
        "digits",
        *flags,
        env=env,
        stderr=asyncio.subprocess.PIPE,
    )
    return proc, port


def health(port: int) -> dict[str, object] | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2) as reply:
            body: dict[str, object] = json.loads(reply.read())
            return body
    except OSError:
        return None


async def test_serve_logs_listening_first_then_ready_and_stops_cleanly() -> None:
    proc, port = await serve()
    assert proc.stderr is not None
    try:
        first = (await asyncio.wait_for(proc.stderr.readline(), 120)).decode()
        assert "INFO hetd.server.daemon: listening on " in first, first
        assert f"ws://127.0.0.1:{port} (workers)" in first and "admin API off" in first
        seen = [first]
        while not any("ready after" in line for line in seen):
            seen.append((await asyncio.wait_for(proc.stderr.readline(), 120)).decode())
        ready = seen[-1]
        assert "mlp on digits, policy auto" in ready, seen
        body = await asyncio.to_thread(health, port)
        assert body is not None and body["ready"] is True, body
    finally:
        proc.send_signal(signal.SIGTERM)
        _, rest = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 0, rest.decode()
    assert "stopping: saying bye to 0 workers" in rest.decode()
