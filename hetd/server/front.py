"""The daemon's listening sockets, guarded against clients that connect and never finish.

A connection is *pending* from the moment it is accepted (after TLS) until a request on it shows a
valid token (:func:`trust`: the worker endpoint's ``/v1/ws`` and ``/v1/prepare``, an admin call).
For a pending connection:

* its first request's line and headers must arrive within ``header_timeout_s``, and each request
  on it must end within that time; otherwise it is closed (a slow client holds no socket for
  long). aiohttp's keep-alive timeout, set to the same value, bounds the wait for a later
  request's headers, and asyncio's TLS handshake timeout the handshake;
* at most ``max_pending_per_address`` of them come from one address (an IPv6 /64), and at most
  ``max_pending`` in all: over a cap the *oldest* is closed (one without a request under way
  first), so a flood of unfinished requests holds a bounded number of sockets while a real client,
  which sends its request at once, still gets through;
* what was closed is logged at most once per :data:`LOG_EVERY_S`, counted.

A connection that showed a token is no longer watched. :class:`GuardedSite` is an aiohttp site that
puts each accepted connection of a runner under a :class:`FrontGuard`; the guard's
:attr:`FrontGuard.middleware` sees each request begin and end.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import cast

from aiohttp import web

from hetd.server.throttle import client_key

log = logging.getLogger("hetd.server.front")

LOG_EVERY_S = 10.0


@dataclass(frozen=True)
class FrontLimits:
    """``[server] header_timeout_s``, ``max_pending`` and ``max_pending_per_address``."""

    header_timeout_s: float = 10.0
    max_pending: int = 256
    max_pending_per_address: int = 64


class _Pending:
    """One pending connection."""

    __slots__ = ("busy_since", "key", "requests", "timer", "transport")

    def __init__(self, transport: asyncio.Transport, key: str) -> None:
        self.transport, self.key = transport, key
        self.requests = 0  # requests begun on it
        self.busy_since: float | None = None  # loop time its current request began
        self.timer: asyncio.TimerHandle | None = None


class FrontGuard:
    """The pending connections of a daemon's endpoints (both share one guard and its caps)."""

    def __init__(self, limits: FrontLimits) -> None:
        self.limits = limits
        self._pending: dict[asyncio.Transport, _Pending] = {}  # oldest first
        self._by_key: dict[str, dict[asyncio.Transport, _Pending]] = {}
        self._closed: dict[str, int] = {}  # why -> connections closed since the last line
        self._example: dict[str, str] = {}  # why -> an address it happened to
        self._last_line = -LOG_EVERY_S
        self._flush: asyncio.TimerHandle | None = None

    @property
    def pending(self) -> int:
        """Connections pending now."""
        return len(self._pending)

    # --- connections ---------------------------------------------------------------------------

    def protocol_factory(
        self, inner: Callable[[], asyncio.Protocol]
    ) -> Callable[[], asyncio.Protocol]:
        """``inner`` (aiohttp's server) with each of its connections under this guard."""
        return lambda: _Guarded(self, inner())

    def opened(self, transport: asyncio.Transport) -> None:
        """A connection was accepted: pending, on a timer; the oldest go when over a cap."""
        peer = transport.get_extra_info("peername")
        key = client_key(peer[0] if isinstance(peer, tuple) and peer else None)
        mine = self._by_key.setdefault(key, {})
        while len(mine) >= self.limits.max_pending_per_address:
            self._close(_victim(mine), "over the per-address cap")
        while len(self._pending) >= self.limits.max_pending:
            self._close(_victim(self._pending), "over the total cap")
        conn = _Pending(transport, key)
        self._pending[transport] = mine[transport] = conn
        self._arm(conn, self.limits.header_timeout_s)

    def closed(self, transport: asyncio.Transport) -> None:
        """A connection ended (or showed a token): forget it."""
        conn = self._pending.pop(transport, None)
        if conn is None:
            return
        if conn.timer is not None:
            conn.timer.cancel()
        mine = self._by_key.get(conn.key)
        if mine is not None:
            mine.pop(transport, None)
            if not mine:
                del self._by_key[conn.key]

    def trust(self, transport: asyncio.Transport | None) -> None:
        """A request on ``transport`` showed a valid token: it is no longer pending."""
        if transport is not None:
            self.closed(transport)

    # --- requests ------------------------------------------------------------------------------

    @web.middleware
    async def middleware(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        """Times each request on a pending connection (it must end within the timeout)."""
        transport = request.transport
        conn = self._pending.get(transport) if transport is not None else None
        if conn is None:
            return await handler(request)
        conn.requests += 1
        conn.busy_since = asyncio.get_running_loop().time()
        self._arm(conn, self.limits.header_timeout_s)
        try:
            return await handler(request)
        finally:
            conn.busy_since = None  # (idle: aiohttp's keep-alive timeout closes it)
            if conn.timer is not None:
                conn.timer.cancel()
                conn.timer = None

    def _arm(self, conn: _Pending, delay: float) -> None:
        if conn.timer is not None:
            conn.timer.cancel()
        conn.timer = asyncio.get_running_loop().call_later(delay, self._expire, conn)

    def _expire(self, conn: _Pending) -> None:
        conn.timer = None
        if self._pending.get(conn.transport) is not conn:
            return  # closed, or showed its token
        if conn.busy_since is not None:
            self._close(conn, "a request without a token that did not end in time")
        elif conn.requests == 0:
            self._close(conn, "no request headers in time")

    def _close(self, conn: _Pending, why: str) -> None:
        self.closed(conn.transport)
        conn.transport.abort()
        self._closed[why] = self._closed.get(why, 0) + 1
        self._example[why] = conn.key
        now = time.monotonic()
        if now - self._last_line >= LOG_EVERY_S:
            self._log(now)
        elif self._flush is None:
            self._flush = asyncio.get_running_loop().call_later(
                self._last_line + LOG_EVERY_S - now, lambda: self._log(time.monotonic())
            )

    def _log(self, now: float) -> None:
        """One line for what was closed since the last."""
        self._flush = None
        if not self._closed:
            return
        total = sum(self._closed.values())
        parts = [f"{n} {why} (e.g. {self._example[why]})" for why, n in self._closed.items()]
        lim = self.limits
        log.warning(
            "closed %d pending connection%s (no token shown yet): %s; limits: [server] "
            "header_timeout_s = %g, max_pending = %d, max_pending_per_address = %d",
            total,
            "" if total == 1 else "s",
            ", ".join(parts),
            lim.header_timeout_s,
            lim.max_pending,
            lim.max_pending_per_address,
        )
        self._closed.clear()
        self._example.clear()
        self._last_line = now

    def close(self) -> None:
        """Stop the pending log line (the daemon stops)."""
        if self._flush is not None:
            self._flush.cancel()
            self._flush = None
        for conn in self._pending.values():
            if conn.timer is not None:
                conn.timer.cancel()


def _victim(conns: dict[asyncio.Transport, _Pending]) -> _Pending:
    """Whom a cap closes: the oldest connection that has no request under way (a slow client's
    headers never make one; a real client's request is being answered), else the oldest."""
    for conn in conns.values():
        if conn.busy_since is None:
            return conn
    return next(iter(conns.values()))


GUARD = web.AppKey("front_guard", FrontGuard)


def trust(request: web.Request) -> None:
    """``request`` showed a valid token: its connection is no longer pending (no-op for an app
    that is not behind a :class:`FrontGuard`)."""
    guard = request.app.get(GUARD)
    if guard is not None:
        guard.trust(request.transport)


def install(app: web.Application, guard: FrontGuard) -> None:
    """Put ``app``'s requests under ``guard`` (before its runner is set up)."""
    app[GUARD] = guard
    app.middlewares.insert(0, guard.middleware)


class _Guarded(asyncio.Protocol):
    """aiohttp's protocol for one connection, with the guard told when it opens and closes."""

    def __init__(self, guard: FrontGuard, inner: asyncio.Protocol) -> None:
        self._guard, self._inner = guard, inner
        self._transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # (a server's: a stream)
        self._inner.connection_made(transport)
        self._guard.opened(self._transport)

    def connection_lost(self, exc: Exception | None) -> None:
        if self._transport is not None:
            self._guard.closed(self._transport)
        self._inner.connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        self._inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self._inner.eof_received()

    def pause_writing(self) -> None:
        self._inner.pause_writing()

    def resume_writing(self) -> None:
        self._inner.resume_writing()


class GuardedSite(web.BaseSite):
    """A TCP site whose connections are under ``guard``; TLS handshakes end within the guard's
    header timeout. ``port``: the bound port once started."""

    def __init__(
        self,
        runner: web.BaseRunner,
        host: str,
        port: int,
        guard: FrontGuard,
        *,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        super().__init__(runner, ssl_context=ssl_context)
        self._host, self._guard = host, guard
        self.port = port

    @property
    def name(self) -> str:
        scheme = "https" if self._ssl_context else "http"
        return f"{scheme}://{self._host}:{self.port}"

    async def start(self) -> None:
        await super().start()
        server = self._runner.server
        assert server is not None  # (the runner was set up)
        tls = self._ssl_context
        self._server = await asyncio.get_running_loop().create_server(
            self._guard.protocol_factory(server),
            self._host,
            self.port,
            ssl=tls,
            ssl_handshake_timeout=self._guard.limits.header_timeout_s if tls else None,
        )
        sockets = self._server.sockets
        if sockets:
            self.port = sockets[0].getsockname()[1]
