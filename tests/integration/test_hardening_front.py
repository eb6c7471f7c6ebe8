"""The daemon's HTTP front against clients that do not play by the rules, on a real daemon on
loopback: requests that never finish their headers, floods of them, odd ``Authorization`` bytes,
browser origins on the worker endpoint, token guessing, megabyte strings from a worker, and a
dashboard viewer that leaves. Each case is answered, the daemon logs it briefly and workers go on.

The attackers dial from other loopback addresses (127.0.0.2-127.0.0.9) where the test needs them
apart from the real clients on 127.0.0.1: the daemon keys its limits on the client's address.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import struct
from collections.abc import AsyncIterator

import aiohttp
import msgpack
import pytest
import pytest_asyncio

from hetd import config as config_mod
from hetd.protocol import wire
from tests.conftest import (
    ADMIN_TOKEN,
    SHARED_LOOP,
    WORKER_AUTH,
    Cluster,
    clusters,
    make_config,
    raw_hello,
    recv_type,
)

pytestmark = pytest.mark.slow

ADMIN_AUTH = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
# Small limits, so that a test reaches them with a few sockets; a long header timeout, so that
# what closes a socket in the flood test is the cap and not the timeout.
FRONT = {
    "header_timeout_s": 60.0,
    "max_pending": 10,
    "max_pending_per_address": 4,
    "max_auth_failures": 5,
}
HALF_REQUEST = b"GET /healthz HTTP/1.1\r\nHost: hetd\r\nX-Slow: "  # and nothing more, ever


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def front() -> AsyncIterator[Cluster]:
    async with clusters() as make:
        yield await make("asp", server=FRONT)


async def half_request(port: int, source: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A socket from ``source`` that sends the start of a request and then nothing."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port, local_addr=(source, 0))
    writer.write(HALF_REQUEST)
    await writer.drain()
    return reader, writer


async def closed_by_daemon(reader: asyncio.StreamReader) -> bool:
    """Whether the daemon has closed this socket (what it sent before is skipped)."""
    try:
        while True:
            data = await asyncio.wait_for(reader.read(4096), 0.01)
            if not data:
                return True
    except TimeoutError:
        return False
    except ConnectionError:
        return True


async def raw_status(port: int, request: bytes) -> int:
    """The HTTP status the daemon answers a raw ``request`` with."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(request)
        await writer.drain()
        line = await asyncio.wait_for(reader.readline(), 30)
        return int(line.split()[1])
    finally:
        writer.close()


def errors(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]


# --- 1: header timeout, pending caps --------------------------------------------------------------


async def test_a_request_that_never_ends_its_headers_is_closed_on_both_ports(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """No engine needed: the endpoints listen before the daemon builds it."""
    from hetd.server.daemon import Daemon

    cfg = make_config("asp", server={"header_timeout_s": 1.0})
    daemon = Daemon(cfg)
    try:
        await daemon.listen()
        assert daemon.admin_port is not None
        socks = [await half_request(p, "127.0.0.4") for p in (daemon.port, daemon.admin_port)]

        async def eof(reader: asyncio.StreamReader) -> bytes:
            return await reader.read()  # up to EOF

        # generous: 1 s configured, a loaded machine may take longer to get there
        await asyncio.wait_for(asyncio.gather(*(eof(r) for r, _ in socks)), 30)
        for _, w in socks:
            w.close()
        # a client that sends its request at once is served as before
        async with (
            aiohttp.ClientSession() as http,
            http.get(f"http://127.0.0.1:{daemon.port}/healthz") as resp,
        ):
            assert resp.status == 200
    finally:
        await daemon.stop(final_checkpoint=False)
    assert not errors(caplog)


@SHARED_LOOP
async def test_a_flood_of_unfinished_requests_is_capped_and_workers_still_join(
    front: Cluster, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    port = front.daemon.port
    sources = ("127.0.0.3", "127.0.0.5", "127.0.0.1")
    socks = {s: [await half_request(port, s) for _ in range(12)] for s in sources}
    try:
        # The oldest pending sockets go as new ones come: at most 4 per address, 10 in all.
        deadline = asyncio.get_running_loop().time() + 20
        while True:
            open_ = {s: [r for r, _ in socks[s] if not await closed_by_daemon(r)] for s in sources}
            counts = {s: len(v) for s, v in open_.items()}
            if max(counts.values()) <= 4 and sum(counts.values()) <= 10:
                break
            assert asyncio.get_running_loop().time() < deadline, counts
            await asyncio.sleep(0.1)
        # ... so a worker from the flooding address still joins, and both ports answer.
        async with aiohttp.ClientSession() as http:
            ws = await http.ws_connect(front.url + "/v1/ws", headers=WORKER_AUTH)
            await ws.send_bytes(raw_hello())
            await recv_type(ws, "welcome")
            await ws.close()
            for url in (front.url.replace("ws://", "http://"), front.admin_url):
                async with http.get(url + "/healthz") as resp:
                    assert resp.status == 200
    finally:
        for s in sources:
            for _, w in socks[s]:
                w.close()
    # what was closed is logged, not once per socket
    lines = [r.getMessage() for r in caplog.records if "pending connection" in r.getMessage()]
    assert 1 <= len(lines) <= 3, lines
    assert not errors(caplog)


# --- 2: a non-UTF-8 Authorization header -----------------------------------------------------------


@SHARED_LOOP
async def test_an_authorization_header_that_is_not_utf8_gets_401(
    front: Cluster, caplog: pytest.LogCaptureFixture
) -> None:
    assert front.daemon.admin_port is not None
    for port, path in (
        (front.daemon.port, "/v1/prepare"),
        (front.daemon.port, "/v1/ws"),
        (front.daemon.admin_port, "/v1/status"),
    ):
        request = (
            f"GET {path} HTTP/1.1\r\nHost: hetd\r\nConnection: close\r\n".encode()
            + b"Authorization: Bearer \xff\xfe\xc3\x28\r\n\r\n"
        )
        assert await raw_status(port, request) == 401, path
    assert not errors(caplog)
    assert not [r for r in caplog.records if r.exc_info]


# --- 3: browser origins on the worker endpoint; open workers only when asked ----------------------


@SHARED_LOOP
async def test_a_browser_origin_is_refused_on_the_worker_endpoint(front: Cluster) -> None:
    async with aiohttp.ClientSession() as http:
        with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
            await http.ws_connect(
                front.url + "/v1/ws", headers=WORKER_AUTH, origin="http://localhost:8000"
            )
        assert refused.value.status == 403
        http_url = front.url.replace("ws://", "http://")
        async with http.get(
            http_url + "/v1/prepare", headers={**WORKER_AUTH, "Origin": "null"}
        ) as resp:
            assert resp.status == 403
            assert "browser" in await resp.text()
        async with http.get(http_url + "/v1/prepare", headers=WORKER_AUTH) as resp:
            assert resp.status == 200  # a worker sends no Origin


async def test_an_empty_worker_token_runs_only_when_opted_in_and_says_so(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from hetd.server.daemon import Daemon

    cfg = config_mod.replace(make_config("asp"), "server", worker_token="")
    with pytest.raises(config_mod.ConfigError, match="open_workers"):
        Daemon(cfg)
    daemon = Daemon(config_mod.replace(cfg, "server", open_workers=True))
    try:
        with caplog.at_level(logging.WARNING):
            await daemon.listen()
    finally:
        await daemon.stop(final_checkpoint=False)
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("no worker token" in m and "any process" in m for m in warned), warned


# --- 9: token guessing ----------------------------------------------------------------------------


@SHARED_LOOP
async def test_token_guesses_from_one_address_are_throttled_on_both_ports(front: Cluster) -> None:
    worker_http = front.url.replace("ws://", "http://")
    wrong = {"Authorization": "Bearer not-the-worker-token-at-all"}
    guesser = aiohttp.TCPConnector(local_addr=("127.0.0.2", 0))
    async with aiohttp.ClientSession(connector=guesser) as http:
        answers = []
        for _ in range(40):
            async with http.get(worker_http + "/v1/prepare", headers=wrong) as resp:
                answers.append(resp.status)
                retry_after = resp.headers.get("Retry-After")
        assert answers.count(401) == 5 and answers.count(429) == 35, answers
        assert retry_after is not None and 1 <= int(retry_after) <= 60
        # Blocked: its next try is not even checked (a right guess would tell nothing) ...
        async with http.get(worker_http + "/v1/prepare", headers=WORKER_AUTH) as resp:
            assert resp.status == 429
        # ... on the admin API and the dashboard's login too.
        async with http.get(front.admin_url + "/v1/status", headers=wrong) as resp:
            assert resp.status == 429 and resp.headers.get("Retry-After")
            assert (await resp.json())["error"] == "too_many_failures"
        async with http.post(front.admin_url + "/login", data={"token": "guess"}) as resp:
            assert resp.status == 429
    # Another address is not held back.
    async with aiohttp.ClientSession() as http:
        async with http.get(worker_http + "/v1/prepare", headers=WORKER_AUTH) as resp:
            assert resp.status == 200
        async with http.get(front.admin_url + "/v1/status", headers=ADMIN_AUTH) as resp:
            assert resp.status == 200


async def test_parallel_dashboard_logins_are_throttled_too() -> None:
    """The login's delay is per request; the per-address count holds for parallel guesses."""
    from hetd.server.daemon import Daemon

    daemon = Daemon(make_config("asp", server={"max_auth_failures": 3}))
    try:
        await daemon.listen()
        url = f"http://127.0.0.1:{daemon.admin_port}/login"
        async with aiohttp.ClientSession() as http:

            async def guess(i: int) -> int:
                async with http.post(url, data={"token": f"guess-{i}"}) as resp:
                    return resp.status

            statuses = await asyncio.gather(*(guess(i) for i in range(30)))
    finally:
        await daemon.stop(final_checkpoint=False)
    assert statuses.count(401) <= 3 and statuses.count(429) >= 27, statuses


# --- 6: megabyte strings from a worker -------------------------------------------------------------


@SHARED_LOOP
async def test_a_workers_long_strings_are_cut_in_the_log_the_engine_and_the_dashboard(
    front: Cluster, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    big = 200_000
    async with aiohttp.ClientSession() as http:
        ws = await http.ws_connect(front.url + "/v1/ws", headers=WORKER_AUTH)
        await ws.send_bytes(raw_hello())
        wid = (await recv_type(ws, "welcome"))["worker_id"]
        await ws.send_bytes(msgpack.packb({"v": 1, "type": "t" * big, "id": 5}))
        error = await recv_type(ws, "error")
        assert error["code"] == "unknown_type" and len(error["message"]) < 1000
        await ws.send_bytes(wire.encode("bye", 6, reason="r" * big))
        await ws.receive(timeout=20)  # closed
        await ws.close()
        await front.wait_for(
            lambda: any(w == wid for _, w, _ in front.engine.members.departures), 20, "the bye"
        )
        reason = next(r for _, w, r in front.engine.members.departures if w == wid)
        assert reason.startswith("rrr") and len(reason) <= 220, len(reason)
        # the dashboard shows the leave, cut too
        deadline = asyncio.get_running_loop().time() + 30
        while True:
            async with http.get(front.admin_url + "/v1/dashboard", headers=ADMIN_AUTH) as resp:
                text = await resp.text()
            if f"worker {wid} (" in text and "left: rrr" in text:
                break
            assert asyncio.get_running_loop().time() < deadline, "no leave event"
            await asyncio.sleep(0.5)
        assert len(text) < 100_000, len(text)
    longest = max(len(r.getMessage()) for r in caplog.records)
    assert longest < 2000, longest


# --- 11a: a dashboard viewer that leaves ----------------------------------------------------------


async def test_a_viewer_that_leaves_the_dashboard_stream_logs_no_error(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A viewer that reads slowly (the daemon's writes wait for it) and then leaves: the daemon
    ends that stream quietly. No engine needed: the stream sends the recorder's document."""
    from hetd.server import dashboard
    from hetd.server.daemon import Daemon

    daemon = Daemon(make_config("asp"))
    try:
        await daemon.listen()
        assert daemon.admin_app is not None and daemon.admin_port is not None
        daemon.admin_app[dashboard.RECORDER].state = {"big": "x" * 4_000_000}
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a slow reader
        sock.setblocking(False)
        await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", daemon.admin_port))
        _, writer = await asyncio.open_connection(sock=sock)
        writer.write(
            b"GET /v1/dashboard/stream HTTP/1.1\r\nHost: hetd\r\n"
            + f"Authorization: Bearer {ADMIN_TOKEN}\r\n\r\n".encode()
        )
        await writer.drain()
        await asyncio.sleep(1.0)  # the daemon writes the document and waits
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        writer.close()  # gone (a reset, as a closed tab may leave it)
        await asyncio.sleep(1.0)
    finally:
        await daemon.stop(final_checkpoint=False)
    assert not errors(caplog), errors(caplog)
    assert not [r for r in caplog.records if r.exc_info]
