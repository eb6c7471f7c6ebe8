"""The admin HTTP API: status, workers, policy hot-swap, checkpoints, Prometheus metrics, OpenAPI.

Every route but ``/healthz`` needs ``Authorization: Bearer <admin token>``; with no admin token
configured every such call is refused (401). An address that sent too many wrong tokens gets 429
(with ``Retry-After``) until its window ends (:mod:`hetd.server.throttle`). The engine is only read
or changed through ``engine.queue.call``, so each answer is consistent and each change lands between two
events. Nothing an operator sends can stop the daemon: bad JSON, wrong types or a policy that will
not build get a 400 whose message says what to fix, and the running policy stays.
``hetd/openapi.json`` documents the routes and is served at ``/openapi.json``. What these routes
share with the replica routes and the dashboard (the context, errors, token counts) is
:mod:`hetd.server.admin_context`.
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import Awaitable, Callable, Mapping
from importlib import resources
from typing import TYPE_CHECKING, Any

from aiohttp import hdrs, web

from hetd.server import front
from hetd.server.admin_context import (
    PUBLIC_KEY,
    SESSION_CHECK,
    SLOT,
    AdminContext,
    AdminSlot,
    ApiError,
    call,
    context,
    error_response,
    json_object,
    kind,
    note_failure,
    too_many_failures,
)
from hetd.server.auth import ADMIN_ENDPOINT, name_endpoint
from hetd.server.safe_files import Refused

if TYPE_CHECKING:  # the engine's modules import JAX: the admin app is built before they load
    from hetd.core.engine import Engine

log = logging.getLogger("hetd.server.admin")

MAX_BODY = 1024 * 1024  # bytes; policy parameters are small
PUBLIC_PATHS = frozenset({"/healthz"})  # no token needed (the dashboard adds its own: PUBLIC_KEY)


def _authorized(request: web.Request, token: str) -> bool:
    got = request.headers.get("Authorization", "").encode("utf-8", "surrogateescape")
    return hmac.compare_digest(got, f"Bearer {token}".encode())


@web.middleware
async def _guard(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    """Token (or dashboard session) check on every route but the public ones; every failure
    becomes a JSON error reply."""
    slot = request.app[SLOT]
    public = request.path in PUBLIC_PATHS or request.path in request.app.get(PUBLIC_KEY, ())
    if not public:
        if not slot.token:
            return error_response(
                401,
                "unauthorized",
                "the admin API is disabled: no admin token is configured "
                "(set HETD_ADMIN_TOKEN or [server] admin_token)",
            )
        busy = too_many_failures(slot, request)
        if busy is not None:
            return busy
        session = request.app.get(SESSION_CHECK)
        if not _authorized(request, slot.token) and not (session is not None and session(request)):
            if hdrs.AUTHORIZATION in request.headers:  # a guess (not a browser without a session)
                note_failure(slot, request)
            return error_response(
                401, "unauthorized", "missing or wrong admin token (Authorization: Bearer <token>)"
            )
        front.trust(request)  # no longer pending: the caps and the header timeout are done
    try:
        return await handler(request)
    except ApiError as exc:
        return error_response(exc.status, exc.code, exc.message, **exc.extra)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return error_response(exc.status, exc.reason.lower().replace(" ", "_"), exc.reason)
    except Exception as exc:
        log.exception("admin %s %s failed", request.method, request.path)
        return error_response(500, "internal", f"internal error: {type(exc).__name__}: {exc}")


def _params(body: Mapping[str, Any]) -> dict[str, Any]:
    params = body.get("params", {})
    if params is None:
        return {}
    if not isinstance(params, dict):
        raise ApiError(400, "bad_request", f"params must be a JSON object, not {kind(params)}")
    return params


# --- routes ----------------------------------------------------------------------------------------


async def healthz(request: web.Request) -> web.Response:
    """Liveness, without a token; ``ready`` false (and version 0) while the daemon starts."""
    ctx = request.app[SLOT].ctx
    version = ctx.engine.store.version if ctx is not None else 0
    return web.json_response({"ok": True, "ready": ctx is not None, "version": version})


async def status(request: web.Request) -> web.Response:
    """Version, stage, policy, uptime, workers, updates applied, last evaluation, daemon info."""
    ctx = context(request)
    engine = ctx.engine
    body: dict[str, Any] = await call(ctx, engine.status)
    body["buffered"] = engine.applier.buffered()
    body.update(ctx.daemon_status())
    return web.json_response(body)


async def workers(request: web.Request) -> web.Response:
    """One row per active worker."""
    ctx = context(request)
    rows = await call(ctx, ctx.engine.workers)
    return web.json_response({"workers": rows})


def _policy_body(engine: Engine) -> dict[str, Any]:
    from policies.registry import policy_names

    return {**engine.host.policy.describe(), "known": policy_names()}


async def get_policy(request: web.Request) -> web.Response:
    """The running policy, its parameters, and every registered name."""
    ctx = context(request)
    return web.json_response(await call(ctx, lambda: _policy_body(ctx.engine)))


async def _swap(ctx: AdminContext, build: Callable[[], tuple[str, dict[str, Any]]]) -> web.Response:
    """Swap on the engine task; on any error the old policy stays and the reply says why. With a
    state directory a checkpoint is written at once (its info in the reply's ``checkpoint``)."""
    from policies.registry import PolicyError

    engine = ctx.engine

    def swap() -> tuple[dict[str, Any], dict[str, Any]]:
        old = engine.host.policy.describe()
        name, params = build()
        return old, engine.swap_policy(name, params)

    try:
        old, new = await call(ctx, swap)
    except (PolicyError, ValueError, TypeError, KeyError) as exc:
        current = await call(ctx, lambda: engine.host.policy.describe())
        raise ApiError(400, "bad_policy", str(exc), policy=current) from None
    except ApiError:
        raise
    except Exception as exc:  # the policy's own init failed: still a refusal, the old one runs
        log.exception("policy swap failed")
        current = await call(ctx, lambda: engine.host.policy.describe())
        raise ApiError(
            400,
            "bad_policy",
            f"the policy failed to start: {type(exc).__name__}: {exc}",
            policy=current,
        ) from None
    log.debug("admin: policy %s -> %s", old, new)  # the engine logs the swap at INFO
    body: dict[str, Any] = {**new, "previous": old}
    if ctx.checkpoint is not None:  # durable at once: a crash now must not undo the change
        try:
            body["checkpoint"] = (await ctx.checkpoint()).to_json()
        except Exception as exc:  # the swap stands; the reply says it is not on disk yet
            log.exception("the checkpoint after a policy change failed")
            body["checkpoint_error"] = f"{type(exc).__name__}: {exc}"
    return web.json_response(body)


async def put_policy(request: web.Request) -> web.Response:
    """Replace the policy: ``{"name": ..., "params": {...}}`` (params default to the factory's)."""
    ctx = context(request)
    body = await json_object(request, {"name", "params"}, {"name"})
    name = body["name"]
    if not isinstance(name, str) or not name:
        raise ApiError(400, "bad_request", 'name must be a non-empty string, e.g. "ssp"')
    params = _params(body)
    return await _swap(ctx, lambda: (name, params))


async def patch_policy(request: web.Request) -> web.Response:
    """Change some parameters of the running policy (JSON merge patch: ``null`` removes a key)."""
    ctx = context(request)
    body = await json_object(request, {"params"}, {"params"})
    patch = _params(body)
    engine = ctx.engine

    def build() -> tuple[str, dict[str, Any]]:
        merged = dict(engine.host.policy.params)
        for k, v in patch.items():
            if v is None:
                merged.pop(k, None)
            else:
                merged[k] = v
        return engine.host.policy.name, merged

    return await _swap(ctx, build)


async def post_checkpoint(request: web.Request) -> web.Response:
    """Write a checkpoint now; 409 when no state directory is configured."""
    ctx = context(request)
    if ctx.checkpoint is None:
        raise ApiError(
            409,
            "no_state_dir",
            "checkpoints are off: set [store] dir in the config or hetd serve --state-dir",
        )
    try:
        info = await ctx.checkpoint()
    except OSError as exc:
        raise ApiError(500, "checkpoint_failed", f"writing the checkpoint failed: {exc}") from None
    return web.json_response(info.to_json())


async def metrics(request: web.Request) -> web.Response:
    """Prometheus text format."""
    ctx = context(request)
    from prometheus_client import CONTENT_TYPE_LATEST

    await call(ctx, ctx.metrics.sample)
    return web.Response(body=ctx.metrics.render(), headers={"Content-Type": CONTENT_TYPE_LATEST})


def openapi_document() -> bytes:
    """The OpenAPI 3.1 document shipped in the package."""
    return resources.files("hetd.server").joinpath("openapi.json").read_bytes()


async def openapi(request: web.Request) -> web.Response:
    """The OpenAPI document of these routes."""
    return web.Response(body=openapi_document(), content_type="application/json")


async def post_export(request: web.Request) -> web.Response:
    """Write the model for users: ``{"out": NAME}``, a directory under the daemon's export root
    (:func:`hetd.server.export.export_root`), gets an orbax CheckpointManager directory (step =
    version) and a bare ``params.msgpack``."""
    ctx = context(request)
    body = await json_object(request, {"out"}, {"out"})
    out = body["out"]
    if not isinstance(out, str) or not out:
        raise ApiError(400, "bad_request", 'out must be a name under the export root, e.g. "model"')
    if ctx.export is None:
        raise ApiError(409, "no_export", "this daemon cannot export")
    try:
        reply = await ctx.export(out)
    except Refused as exc:  # out outside the export root, through a link; no export root
        raise ApiError(exc.status, exc.code, str(exc)) from None
    except (OSError, ValueError) as exc:
        raise ApiError(500, "export_failed", f"writing the export to {out} failed: {exc}") from None
    return web.json_response(reply)


def make_admin_app(slot: AdminSlot | AdminContext) -> web.Application:
    """The admin application (mounted on ``[server] admin_host:admin_port``): the token guard and
    the routes above; the daemon adds the replica routes and the dashboard
    (:func:`hetd.server.admin_replicas.add_routes`, :func:`hetd.server.dashboard.install`).

    ``slot`` is an :class:`AdminSlot` (the daemon attaches the context once its engine runs) or a
    ready context."""
    if isinstance(slot, AdminContext):
        ready, slot = slot, AdminSlot(slot.token)
        slot.attach(ready)
    app = web.Application(middlewares=[_guard], client_max_size=MAX_BODY)
    name_endpoint(app, ADMIN_ENDPOINT)  # a worker dialling this port is told it is the wrong one
    app[SLOT] = slot
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/v1/status", status)
    app.router.add_get("/v1/workers", workers)
    app.router.add_get("/v1/policy", get_policy)
    app.router.add_put("/v1/policy", put_policy)
    app.router.add_patch("/v1/policy", patch_policy)
    app.router.add_post("/v1/checkpoint", post_checkpoint)
    app.router.add_post("/v1/export", post_export)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/openapi.json", openapi)
    return app
