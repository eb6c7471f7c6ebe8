"""Bearer-token checks shared by the daemon's HTTP routes, the header that tells its two endpoints
apart, and the rate-limited log of refused workers (nothing heavier than aiohttp imported, so the
routes that answer while the daemon starts can use them)."""

from __future__ import annotations

import hmac
import logging
import time
from collections.abc import Callable

from aiohttp import hdrs, web

from hetd.protocol.endpoints import ADMIN_ENDPOINT, ENDPOINT_HEADER, WORKER_ENDPOINT
from hetd.server.throttle import AuthThrottle

__all__ = [
    "ADMIN_ENDPOINT",
    "WORKER_ENDPOINT",
    "RefusalLog",
    "bearer_ok",
    "from_browser",
    "name_endpoint",
    "throttled",
    "token_problem",
]


def bearer_ok(request: web.Request, token: str) -> bool:
    """``Authorization: Bearer <token>`` matches (an empty configured token admits everyone);
    compared in constant time. Bytes that are not UTF-8 are a wrong token, not an error."""
    if not token:
        return True
    got = request.headers.get("Authorization", "").encode("utf-8", "surrogateescape")
    return hmac.compare_digest(got, f"Bearer {token}".encode())


def from_browser(request: web.Request) -> bool:
    """Whether a browser sent ``request``: browsers send ``Origin`` on every websocket handshake
    and cross-site request, which no script can leave out; workers (aiohttp) never send it."""
    return hdrs.ORIGIN in request.headers


def throttled(request: web.Request, throttle: AuthThrottle, text: str) -> web.Response | None:
    """A 429 for an address that used up its wrong tokens (:mod:`hetd.server.throttle`); None:
    it may try."""
    wait = throttle.retry_after(request.remote)
    if wait is None:
        return None
    return web.Response(
        status=429,
        text=f"{text}: retry after {wait} s",
        headers={hdrs.RETRY_AFTER: str(wait)},
    )


def name_endpoint(app: web.Application, name: str) -> None:
    """Send :data:`ENDPOINT_HEADER` ``name`` on every reply of ``app`` (errors and 404s too)."""

    async def stamp(request: web.Request, response: web.StreamResponse) -> None:
        response.headers[ENDPOINT_HEADER] = name

    app.on_response_prepare.append(stamp)


def token_problem(request: web.Request) -> str:
    """Why a request failed :func:`bearer_ok`, for the refused client and the log."""
    if not request.headers.get("Authorization"):
        return "no worker token"
    return "a wrong worker token"


class RefusalLog:
    """Logs refused workers at most once per address and reason per ``every_s`` seconds (a worker
    retrying with a wrong token, or many of them behind one address, must not flood the journal);
    the next line counts the refusals it left out."""

    def __init__(
        self, log: logging.Logger, every_s: float = 60.0, now: Callable[[], float] = time.monotonic
    ) -> None:
        self._log, self._every, self._now = log, every_s, now
        self._last: dict[tuple[str, str], float] = {}  # (address, why) -> its last line's time
        self._held: dict[tuple[str, str], int] = {}  # (address, why) -> refusals not logged since

    def refused(self, address: str, why: str) -> bool:
        """Note one refusal; True when it was logged."""
        now = self._now()
        key = (address, why)
        last = self._last.get(key)
        if last is not None and now - last < self._every:
            self._held[key] = self._held.get(key, 0) + 1
            return False
        if len(self._last) > 4096:  # a scan of many addresses: forget the quiet ones
            self._last = {a: t for a, t in self._last.items() if now - t < self._every}
            self._held = {a: n for a, n in self._held.items() if a in self._last}
        more = self._held.pop(key, 0)
        self._last[key] = now
        self._log.warning(
            "refused a worker from %s: %s (HETD_WORKER_TOKEN must be the daemon's "
            "[server] worker_token)%s",
            address,
            why,
            f"; {more} more refusals from it since the last line" if more else "",
        )
        return True
