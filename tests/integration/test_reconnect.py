"""A worker outlives a daemon restart: it reconnects with backoff and carries on."""

from __future__ import annotations

import socket

import pytest

from hetd import config as config_mod
from hetd.local.procs import stop_processes
from hetd.server.daemon import Daemon
from tests.conftest import Cluster, make_config

pytestmark = pytest.mark.slow


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


async def test_worker_reconnects_after_daemon_restart() -> None:
    port = free_port()
    cfg = config_mod.replace(make_config("asp"), "server", port=port)
    first = Daemon(cfg)
    await first.start()
    c = Cluster(first, f"ws://127.0.0.1:{port}")
    second: Daemon | None = None
    try:
        proc = await c.spawn(1.0, 0.02, "--max-retries", "20")
        await c.wait_for(lambda: first.engine.applier.updates_applied >= 10, 60, "10 updates")
        await first.stop()

        second = Daemon(cfg)
        await second.start()
        c.daemon, c.engine = second, second.engine
        await c.wait_for(
            lambda: second.engine.applier.updates_applied >= 10, 60, "10 updates after restart"
        )
        assert proc.returncode is None, "the worker exited instead of reconnecting"
        assert len(second.engine.members.facts) == 1
    finally:
        await stop_processes(c.procs)
        if second is not None:
            await second.stop()
