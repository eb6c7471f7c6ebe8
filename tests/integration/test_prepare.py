"""A worker that connects while the daemon still builds gets the setup from ``/v1/prepare`` and
builds its data and compiled step at the same time; its welcome then finds them ready."""

from __future__ import annotations

import asyncio
import contextlib
import json

import aiohttp
import pytest

from hetd import config as config_mod
from hetd.local.procs import stop_processes
from hetd.server.daemon import Daemon
from tests.conftest import WORKER_AUTH, make_config, start_worker

pytestmark = pytest.mark.slow


async def _lines_until(stream: asyncio.StreamReader, needle: str, timeout: float) -> list[str]:
    seen: list[str] = []
    async with asyncio.timeout(timeout):
        while True:
            raw = await stream.readline()
            if not raw:
                pytest.fail(f"the worker ended before logging {needle!r}: {seen[-20:]}")
            seen.append(raw.decode(errors="replace").rstrip())
            if needle in seen[-1]:
                return seen


async def test_a_worker_prepares_while_the_daemon_builds() -> None:
    cfg = make_config("asp")
    daemon = Daemon(cfg)
    procs: list[asyncio.subprocess.Process] = []
    try:
        port = await daemon.listen()  # listening, nothing built yet
        base = f"http://127.0.0.1:{port}"
        async with aiohttp.ClientSession() as http:
            async with http.get(base + "/v1/prepare") as resp:
                assert resp.status == 401  # the worker token is needed
            async with http.get(base + "/v1/prepare", headers=WORKER_AUTH) as resp:
                assert resp.status == 200
                setup = await resp.json()
            async with http.get(base + "/healthz") as resp:
                assert (await resp.json())["ready"] is False
        # the same setup every welcome carries, from the config alone
        assert setup == json.loads(json.dumps(config_mod.worker_setup(cfg)))
        assert setup["model"]["spec"] == "mlp" and setup["dataset"]["spec"] == "digits"

        proc = await start_worker(port, 3)
        procs.append(proc)
        assert proc.stderr is not None
        # The worker's data and compiled step are ready while the daemon has built nothing.
        await _lines_until(proc.stderr, "prepared the model in", timeout=180)
        assert not daemon.ready
        await daemon.build()
        lines = await _lines_until(proc.stderr, "joined as worker", timeout=120)
        assert "(model prepared before the welcome)" in lines[-1]
        rest = (await asyncio.wait_for(proc.stderr.read(), 120)).decode(errors="replace")
        assert await asyncio.wait_for(proc.wait(), 60) == 0, rest[-2000:]
        assert daemon.engine.store.version >= 1  # its pushes trained the model
    finally:
        await stop_processes(procs)
        with contextlib.suppress(Exception):
            await daemon.stop()
