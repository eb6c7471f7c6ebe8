"""What every route on the admin port shares: the context the daemon attaches once its engine runs
(:class:`AdminContext`, held by :class:`AdminSlot`), the JSON error reply (:class:`ApiError`,
:func:`error_response`), the per-address count of wrong tokens, a bounded call on the engine task
and the strict JSON body reader.

The admin API (:mod:`hetd.server.admin`), its replica routes (:mod:`hetd.server.admin_replicas`)
and the dashboard (:mod:`hetd.server.dashboard`) import this module and not each other; the daemon
puts them on one app. The context sees the daemon's parts through what the routes call of them
(:class:`MetricsSource`, :class:`ReplicaControl`, callables), so none of this needs the daemon.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from aiohttp import hdrs, web

from hetd.protocol.endpoints import ADMIN_REALM
from hetd.server.throttle import AuthThrottle

if TYPE_CHECKING:  # the engine's modules import JAX: the admin app is built before they load
    from hetd.core.engine import Engine
    from hetd.server.ckpt_file import CheckpointInfo

log = logging.getLogger("hetd.server.admin")


class MetricsSource(Protocol):
    """What ``GET /metrics`` calls of the daemon's metrics (:class:`hetd.server.metrics.Metrics`)."""

    def sample(self) -> None:
        """Copy the engine's numbers (on the engine task)."""

    def render(self) -> bytes:
        """The last sample in the Prometheus text format."""


class ReplicaControl(Protocol):
    """What ``GET|POST /v1/replicas`` call of the daemon's pipeline replicas
    (:class:`hetd.server.replicas.ReplicaDriver`)."""

    def describe(self) -> dict[str, Any]:
        """Members, generation, steps assembled and aborted."""

    async def form(
        self,
        members: Sequence[int],
        cuts: Sequence[int],
        micro: int,
        micro_batches: int,
        inflight: Sequence[int] = (),
    ) -> None:
        """Form the replica from connected workers; ValueError when they cannot form it."""


@dataclass(frozen=True)
class AdminContext:
    """What the admin routes need from the daemon."""

    engine: Engine
    token: str  # empty: every call but /healthz is refused
    metrics: MetricsSource
    checkpoint: Callable[[], Awaitable[CheckpointInfo]] | None  # None: no [store] dir
    daemon_status: Callable[[], dict[str, Any]]  # ports, checkpoint state
    timeout_s: float = 10.0  # how long a call may wait for the engine
    export: Callable[[str], Awaitable[dict[str, Any]]] | None = None  # POST /v1/export
    replicas: ReplicaControl | None = None  # GET/POST /v1/replicas (docs/policies.md §11)


class AdminSlot:
    """What the admin app knows before and after the engine exists.

    The app listens before the daemon has built its engine (start-up: listen first): until
    :meth:`attach` gives it the context, every route but ``/healthz`` and the dashboard's login
    answers 503 ``starting``. The token and the TLS flag are known from the start.
    """

    def __init__(
        self, token: str, *, tls: bool = False, throttle: AuthThrottle | None = None
    ) -> None:
        self.token = token
        self.tls = tls
        # wrong tokens per address (the daemon's, shared with its worker endpoint)
        self.throttle = throttle if throttle is not None else AuthThrottle()
        self.ctx: AdminContext | None = None

    def attach(self, ctx: AdminContext) -> None:
        self.ctx = ctx


SLOT = web.AppKey("admin_slot", AdminSlot)
# more public paths than /healthz: the dashboard's login page and static files
PUBLIC_KEY = web.AppKey("admin_public_paths", frozenset)
SessionCheck = Callable[[web.Request], bool]
# a request the dashboard's session cookie authenticates, besides the admin token
SESSION_CHECK: web.AppKey[SessionCheck] = web.AppKey("admin_session_check")


def context(request: web.Request) -> AdminContext:
    """The admin context of a request (the guard made sure it is attached)."""
    ctx = request.app[SLOT].ctx
    if ctx is None:
        raise ApiError(503, "starting", "the daemon is starting: it builds its model and data")
    return ctx


class ApiError(Exception):
    """An error reply: HTTP status, a short code, and a message that says how to fix it."""

    def __init__(self, status: int, code: str, message: str, **extra: Any) -> None:
        super().__init__(message)
        self.status, self.code, self.message, self.extra = status, code, message, extra


def error_response(status: int, code: str, message: str, **extra: Any) -> web.Response:
    """The JSON error body every route uses: ``{"error": code, "message": ..., ...}``."""
    headers = {"WWW-Authenticate": f"Bearer {ADMIN_REALM}"} if status == 401 else None
    return web.json_response(
        {"error": code, "message": message, **extra}, status=status, headers=headers
    )


def too_many_failures(slot: AdminSlot, request: web.Request) -> web.Response | None:
    """A 429 (JSON, ``Retry-After``) for an address that sent too many wrong tokens; None: it may
    try."""
    wait = slot.throttle.retry_after(request.remote)
    if wait is None:
        return None
    reply = error_response(
        429,
        "too_many_failures",
        f"too many wrong tokens from this address: retry after {wait} s",
    )
    reply.headers[hdrs.RETRY_AFTER] = str(wait)
    return reply


def note_failure(slot: AdminSlot, request: web.Request) -> None:
    """Count a wrong token from ``request``'s address; log once when it is used up."""
    if slot.throttle.failed(request.remote):
        log.warning(
            "%s sent %d wrong tokens within %g s: it gets 429 until that window ends",
            request.remote,
            slot.throttle.failures,
            slot.throttle.window_s,
        )


async def call(ctx: AdminContext, fn: Callable[[], Any]) -> Any:
    """Run ``fn`` on the engine task, bounded in time."""
    try:
        return await asyncio.wait_for(ctx.engine.queue.call(fn), ctx.timeout_s)
    except TimeoutError:
        raise ApiError(
            503, "engine_busy", f"the engine did not answer within {ctx.timeout_s:g}s"
        ) from None


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not allowed")


async def json_object(
    request: web.Request, allowed: set[str], required: set[str]
) -> dict[str, Any]:
    """The request body as a JSON object with only ``allowed`` keys and every ``required`` one."""
    raw = await request.read()
    try:
        body = json.loads(raw.decode("utf-8"), parse_constant=_reject_constant)
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise ApiError(400, "bad_json", f"the body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise ApiError(400, "bad_request", f"the body must be a JSON object, not {kind(body)}")
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise ApiError(
            400, "bad_request", f"unknown fields {unknown}; allowed: {', '.join(sorted(allowed))}"
        )
    missing = sorted(required - set(body))
    if missing:
        raise ApiError(400, "bad_request", f"missing fields {missing}")
    return body


def kind(value: Any) -> str:
    """What a JSON value is, for an error message: "an object", "a string", ..."""
    return {dict: "an object", list: "an array", str: "a string", bool: "a boolean"}.get(
        type(value), "a number" if isinstance(value, int | float) else "null"
    )
