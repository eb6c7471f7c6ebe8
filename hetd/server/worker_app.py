"""The workers' HTTP app of a daemon: the websocket endpoint, the early setup and the health check.

It answers while the daemon still builds its engine: ``/v1/prepare`` and ``/healthz`` at once, and
``/v1/ws`` once the engine runs. It sees its daemon (:class:`hetd.server.daemon.Daemon`) through
:class:`WorkerHost`, what it reads of it.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Protocol

from aiohttp import hdrs, web

from hetd import config as config_mod
from hetd.server import front
from hetd.server.auth import (
    WORKER_ENDPOINT,
    RefusalLog,
    bearer_ok,
    from_browser,
    name_endpoint,
    throttled,
    token_problem,
)

if TYPE_CHECKING:
    from hetd.core.engine import Engine
    from hetd.server.budget import DecodeBudget
    from hetd.server.relay import Relay
    from hetd.server.shm_hub import ShmHub
    from hetd.server.throttle import AuthThrottle

log = logging.getLogger("hetd.server.sessions")  # where a worker's join and leave are logged


class WorkerHost(Protocol):
    """What the workers' app reads of its daemon."""

    @property
    def cfg(self) -> config_mod.Config: ...

    @property
    def throttle(self) -> AuthThrottle:
        """Wrong tokens per address, shared with the admin port."""

    @property
    def relay(self) -> Relay:
        """Pipeline replicas' act/gact frames between workers."""

    @property
    def shm(self) -> ShmHub:
        """Shared memory for same-host workers."""

    @property
    def decodes(self) -> DecodeBudget:
        """Pushes decoded at once, and their bytes."""

    @property
    def ready(self) -> bool:
        """Whether the engine runs."""

    @property
    def engine_or_none(self) -> Engine | None:
        """The engine, or None while the daemon still builds it."""

    async def wait_ready(self) -> Engine | None:
        """The running engine once it runs; None when the daemon stopped first."""

    async def serve_worker(self, request: web.Request, engine: Engine) -> web.StreamResponse:
        """One worker's websocket session on the running ``engine``
        (:func:`hetd.server.sessions.handle`)."""


def make_worker_app(daemon: WorkerHost) -> web.Application:
    """The workers' HTTP app: ``/v1/ws`` (waits for the engine while the daemon starts),
    ``/v1/prepare`` (what every worker builds, from the config: answers at once) and ``/healthz``
    (answers at once: ``ready`` false and version 0 until the engine runs). The first two want
    the worker token, refuse browsers, and answer 429 to an address that sent too many wrong
    tokens (``daemon.throttle``)."""
    server = daemon.cfg.server
    app = web.Application(client_max_size=server.max_frame_bytes)
    name_endpoint(app, WORKER_ENDPOINT)
    refusals = RefusalLog(log)
    throttle = daemon.throttle

    def gate(request: web.Request) -> web.Response | None:
        """None when ``request`` may go on (it showed the worker token), else the refusal: a
        browser (403), an address that guessed too often (429), a missing or wrong token (401).
        Checked at once, also while the daemon starts."""
        if from_browser(request):
            refusals.refused(request.remote or "?", "a browser (an Origin header)")
            return web.Response(
                status=403, text="the worker endpoint refuses browsers (an Origin header)"
            )
        busy = throttled(request, throttle, "too many wrong worker tokens from this address")
        if busy is not None:
            refusals.refused(request.remote or "?", "too many wrong worker tokens")
            return busy
        if not bearer_ok(request, server.worker_token):
            why = token_problem(request)
            if hdrs.AUTHORIZATION in request.headers and throttle.failed(request.remote):
                log.warning(
                    "%s sent %d wrong tokens within %g s: it gets 429 until that window ends",
                    request.remote,
                    throttle.failures,
                    throttle.window_s,
                )
            refusals.refused(request.remote or "?", why)
            return web.Response(status=401, text=f"{why} (Authorization: Bearer <worker token>)")
        front.trust(request)  # no longer pending: the caps and the header timeout are done
        return None

    async def ws(request: web.Request) -> web.StreamResponse:
        refused = gate(request)
        if refused is not None:
            return refused
        engine = await daemon.wait_ready()
        if engine is None:
            return web.json_response(
                {"error": "stopping", "message": "the daemon is stopping"}, status=503
            )
        return await daemon.serve_worker(request, engine)

    setup = config_mod.worker_setup(daemon.cfg)

    async def prepare(request: web.Request) -> web.Response:
        # Config only, so it answers while the engine builds: a worker that asks loads its data
        # and compiles its step at the same time, and its welcome then finds them ready.
        refused = gate(request)
        return refused if refused is not None else web.json_response(setup)

    async def healthz(request: web.Request) -> web.Response:
        engine = daemon.engine_or_none
        version = engine.store.version if engine is not None and daemon.ready else 0
        return web.json_response({"ok": True, "ready": daemon.ready, "version": version})

    app.router.add_get("/v1/ws", ws)
    app.router.add_get("/v1/prepare", prepare)
    app.router.add_get("/healthz", healthz)
    return app
