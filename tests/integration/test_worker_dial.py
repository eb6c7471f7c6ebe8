"""A worker URL of the wrong scheme for its port (issue 35, item 11): ``wss://`` to a daemon
without TLS, and ``ws://`` to one with it, exit 2 at once naming the scheme to use, where they
used to be retried forever; a plain port that drops the connection (a daemon going away) is still
retried. Real ``hetd-worker`` processes against aiohttp servers on loopback, one with a throw-away
certificate."""

from __future__ import annotations

import asyncio
import contextlib
import ssl
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import trustme
from aiohttp import web

from hetd.local.demo import worker_env
from tests.conftest import WORKER_TOKEN

pytestmark = pytest.mark.slow


@contextlib.asynccontextmanager
async def servers() -> AsyncIterator[tuple[int, int]]:
    """A plain port and a TLS port of one app whose worker endpoint drops every connection;
    yields (plain port, TLS port)."""

    async def drop(request: web.Request) -> web.StreamResponse:
        assert request.transport is not None
        request.transport.close()
        return web.Response()

    ca = trustme.CA()
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("127.0.0.1").configure_cert(context)
    app = web.Application()
    app.router.add_get("/v1/ws", drop)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    await web.TCPSite(runner, "127.0.0.1", 0, ssl_context=context).start()
    try:
        yield runner.addresses[0][1], runner.addresses[1][1]
    finally:
        await runner.cleanup()


async def worker(url: str, *args: str) -> tuple[int, str]:
    """A real ``hetd-worker URL ARGS`` (retrying forever unless ARGS say otherwise); (exit
    status, stderr), or a failure when it has not ended within a minute."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "workers.cli",
        url,
        "--retry-max-delay",
        "0.5",
        *args,
        env=worker_env(WORKER_TOKEN),
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        _, err = await asyncio.wait_for(proc.communicate(), 60)
    except TimeoutError:
        pytest.fail(f"hetd-worker {url} still retrying after a minute")
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert proc.returncode is not None
    return proc.returncode, err.decode(errors="replace")


async def test_the_wrong_scheme_for_the_port_exits_2_naming_the_right_one(tmp_path: Path) -> None:
    async with servers() as (plain, tls):
        (code_s, err_s), (code_p, err_p), (code_r, err_r) = await asyncio.gather(
            worker(f"wss://127.0.0.1:{plain}"),
            worker(f"ws://127.0.0.1:{tls}"),
            worker(f"ws://127.0.0.1:{plain}", "--max-retries", "1"),
        )
    assert code_s == 2, err_s
    assert "answered without it" in err_s and f"use ws://127.0.0.1:{plain}" in err_s, err_s
    assert code_p == 2, err_p
    assert f"speaks TLS: use wss://127.0.0.1:{tls}" in err_p, err_p
    # a plain port that drops the connection is a daemon going away: retried as before
    assert code_r == 2 and "daemon unreachable after 1 retries" in err_r, err_r
    assert "TLS" not in err_r, err_r
    for err in (err_s, err_p, err_r):
        assert "Traceback" not in err, err
