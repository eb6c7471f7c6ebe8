"""A worker URL of the wrong scheme for its port (issue 35, item 11): ``wss://`` to a daemon
without TLS, and ``ws://`` to one with it, exit 2 at once naming the scheme to use, where they
used to be retried forever; a plain port that drops the connection (a daemon going away) is still
retried. The real ``hetd-worker`` entry point against aiohttp servers on loopback, one port with a
throw-away certificate."""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections.abc import AsyncIterator

import pytest
import trustme
from aiohttp import web

from workers.cli import main


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


async def worker(capsys: pytest.CaptureFixture[str], url: str, *args: str) -> tuple[int, str]:
    """``hetd-worker URL ARGS`` (its ``main``, in a thread: no process start-up to wait for);
    (exit status, what it printed on stderr). It gives up after 20 failed reconnects (about 10 s):
    what it did before it learnt to tell a wrong scheme, and a bound for this test."""
    argv = [url, "--retry-max-delay", "0.5", "--max-retries", "20", "-q", *args]
    code = await asyncio.wait_for(asyncio.to_thread(main, argv), 120)
    return code, capsys.readouterr().err


async def test_the_wrong_scheme_for_the_port_exits_2_naming_the_right_one(
    capsys: pytest.CaptureFixture[str],
) -> None:
    async with servers() as (plain, tls):
        code, err = await worker(capsys, f"wss://127.0.0.1:{plain}")
        assert code == 2, err
        assert "answered without it" in err and f"use ws://127.0.0.1:{plain}" in err, err

        code, err = await worker(capsys, f"ws://127.0.0.1:{tls}")
        assert code == 2, err
        assert f"speaks TLS: use wss://127.0.0.1:{tls}" in err, err

        # a plain port that drops the connection is a daemon going away: retried as before
        code, err = await worker(capsys, f"ws://127.0.0.1:{plain}", "--max-retries", "1")
        assert code == 2 and "daemon unreachable after 1 retries" in err, err
        assert "TLS" not in err, err
