"""The admin HTTP API: status, workers, policy hot-swap, checkpoints, Prometheus metrics, OpenAPI.

Every route but ``/healthz`` needs ``Authorization: Bearer <admin token>``; with no admin token
configured every such call is refused (401). The engine is only read or changed through
``engine.call``, so each answer is consistent and each change lands between two events. Nothing an
operator sends can stop the daemon: bad JSON, wrong types or a policy that will not build get a 400
whose message says what to fix, and the running policy stays. ``hetd/openapi.json`` documents the
routes and is served at ``/openapi.json``.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from importlib import resources
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from hetd.core.engine import Engine
from hetd.server.checkpoint import CheckpointInfo
from hetd.server.metrics import Metrics
from policies.registry import PolicyError, policy_names

log = logging.getLogger("hetd.server.admin")

MAX_BODY = 1024 * 1024  # bytes; policy parameters are small


@dataclass(frozen=True)
class AdminContext:
    """What the admin routes need from the daemon."""

    engine: Engine
    token: str  # empty: every call but /healthz is refused
    metrics: Metrics
    checkpoint: Callable[[], Awaitable[CheckpointInfo]] | None  # None: no [store] dir
    daemon_status: Callable[[], dict[str, Any]]  # ports, checkpoint state
    timeout_s: float = 10.0  # how long a call may wait for the engine


CONTEXT = web.AppKey("admin_context", AdminContext)


class ApiError(Exception):
    """An error reply: HTTP status, a short code, and a message that says how to fix it."""

    def __init__(self, status: int, code: str, message: str, **extra: Any) -> None:
        super().__init__(message)
        self.status, self.code, self.message, self.extra = status, code, message, extra


def error_response(status: int, code: str, message: str, **extra: Any) -> web.Response:
    """The JSON error body every route uses: ``{"error": code, "message": ..., ...}``."""
    headers = {"WWW-Authenticate": 'Bearer realm="hetd-admin"'} if status == 401 else None
    return web.json_response(
        {"error": code, "message": message, **extra}, status=status, headers=headers
    )


def _authorized(request: web.Request, token: str) -> bool:
    got = request.headers.get("Authorization", "").encode("utf-8", "surrogateescape")
    return hmac.compare_digest(got, f"Bearer {token}".encode())


@web.middleware
async def _guard(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    """Token check on every route but /healthz; every failure becomes a JSON error reply."""
    ctx = request.app[CONTEXT]
    if request.path != "/healthz":
        if not ctx.token:
            return error_response(
                401,
                "unauthorized",
                "the admin API is disabled: no admin token is configured "
                "(set HETD_ADMIN_TOKEN or [server] admin_token)",
            )
        if not _authorized(request, ctx.token):
            return error_response(
                401, "unauthorized", "missing or wrong admin token (Authorization: Bearer <token>)"
            )
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


async def _call(ctx: AdminContext, fn: Callable[[], Any]) -> Any:
    """Run ``fn`` on the engine task, bounded in time."""
    try:
        return await asyncio.wait_for(ctx.engine.call(fn), ctx.timeout_s)
    except TimeoutError:
        raise ApiError(
            503, "engine_busy", f"the engine did not answer within {ctx.timeout_s:g}s"
        ) from None


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not allowed")


async def _json_object(
    request: web.Request, allowed: set[str], required: set[str]
) -> dict[str, Any]:
    """The request body as a JSON object with only ``allowed`` keys and every ``required`` one."""
    raw = await request.read()
    try:
        body = json.loads(raw.decode("utf-8"), parse_constant=_reject_constant)
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise ApiError(400, "bad_json", f"the body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise ApiError(400, "bad_request", f"the body must be a JSON object, not {_kind(body)}")
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise ApiError(
            400, "bad_request", f"unknown fields {unknown}; allowed: {', '.join(sorted(allowed))}"
        )
    missing = sorted(required - set(body))
    if missing:
        raise ApiError(400, "bad_request", f"missing fields {missing}")
    return body


def _kind(value: Any) -> str:
    return {dict: "an object", list: "an array", str: "a string", bool: "a boolean"}.get(
        type(value), "a number" if isinstance(value, int | float) else "null"
    )


def _params(body: Mapping[str, Any]) -> dict[str, Any]:
    params = body.get("params", {})
    if params is None:
        return {}
    if not isinstance(params, dict):
        raise ApiError(400, "bad_request", f"params must be a JSON object, not {_kind(params)}")
    return params


# --- routes ----------------------------------------------------------------------------------------


async def healthz(request: web.Request) -> web.Response:
    """Liveness, without a token."""
    engine = request.app[CONTEXT].engine
    return web.json_response({"ok": True, "version": engine.store.version})


async def status(request: web.Request) -> web.Response:
    """Version, stage, policy, uptime, workers, updates applied, last evaluation, daemon info."""
    ctx = request.app[CONTEXT]
    engine = ctx.engine
    body: dict[str, Any] = await _call(ctx, engine.status)
    body["buffered"] = engine.buffered()
    body.update(ctx.daemon_status())
    return web.json_response(body)


async def workers(request: web.Request) -> web.Response:
    """One row per active worker."""
    ctx = request.app[CONTEXT]
    rows = await _call(ctx, ctx.engine.workers)
    return web.json_response({"workers": rows})


def _policy_body(engine: Engine) -> dict[str, Any]:
    return {**engine.policy.describe(), "known": policy_names()}


async def get_policy(request: web.Request) -> web.Response:
    """The running policy, its parameters, and every registered name."""
    ctx = request.app[CONTEXT]
    return web.json_response(await _call(ctx, lambda: _policy_body(ctx.engine)))


async def _swap(ctx: AdminContext, build: Callable[[], tuple[str, dict[str, Any]]]) -> web.Response:
    """Swap on the engine task; on any error the old policy stays and the reply says why. With a
    state directory a checkpoint is written at once (its info in the reply's ``checkpoint``)."""
    engine = ctx.engine

    def swap() -> tuple[dict[str, Any], dict[str, Any]]:
        old = engine.policy.describe()
        name, params = build()
        return old, engine.swap_policy(name, params)

    try:
        old, new = await _call(ctx, swap)
    except (PolicyError, ValueError, TypeError, KeyError) as exc:
        current = await _call(ctx, lambda: engine.policy.describe())
        raise ApiError(400, "bad_policy", str(exc), policy=current) from None
    except ApiError:
        raise
    except Exception as exc:  # the policy's own init failed: still a refusal, the old one runs
        log.exception("policy swap failed")
        current = await _call(ctx, lambda: engine.policy.describe())
        raise ApiError(
            400,
            "bad_policy",
            f"the policy failed to start: {type(exc).__name__}: {exc}",
            policy=current,
        ) from None
    log.warning("admin: policy %s -> %s", old, new)
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
    ctx = request.app[CONTEXT]
    body = await _json_object(request, {"name", "params"}, {"name"})
    name = body["name"]
    if not isinstance(name, str) or not name:
        raise ApiError(400, "bad_request", 'name must be a non-empty string, e.g. "ssp"')
    params = _params(body)
    return await _swap(ctx, lambda: (name, params))


async def patch_policy(request: web.Request) -> web.Response:
    """Change some parameters of the running policy (JSON merge patch: ``null`` removes a key)."""
    ctx = request.app[CONTEXT]
    body = await _json_object(request, {"params"}, {"params"})
    patch = _params(body)
    engine = ctx.engine

    def build() -> tuple[str, dict[str, Any]]:
        merged = dict(engine.policy.params)
        for k, v in patch.items():
            if v is None:
                merged.pop(k, None)
            else:
                merged[k] = v
        return engine.policy.name, merged

    return await _swap(ctx, build)


async def post_checkpoint(request: web.Request) -> web.Response:
    """Write a checkpoint now; 409 when no state directory is configured."""
    ctx = request.app[CONTEXT]
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
    ctx = request.app[CONTEXT]
    await _call(ctx, ctx.metrics.sample)
    return web.Response(body=ctx.metrics.render(), headers={"Content-Type": CONTENT_TYPE_LATEST})


def openapi_document() -> bytes:
    """The OpenAPI 3.1 document shipped in the package."""
    return resources.files("hetd.server").joinpath("openapi.json").read_bytes()


async def openapi(request: web.Request) -> web.Response:
    """The OpenAPI document of these routes."""
    return web.Response(body=openapi_document(), content_type="application/json")


def make_admin_app(ctx: AdminContext) -> web.Application:
    """The admin application (mounted on ``[server] admin_host:admin_port``)."""
    app = web.Application(middlewares=[_guard], client_max_size=MAX_BODY)
    app[CONTEXT] = ctx
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/v1/status", status)
    app.router.add_get("/v1/workers", workers)
    app.router.add_get("/v1/policy", get_policy)
    app.router.add_put("/v1/policy", put_policy)
    app.router.add_patch("/v1/policy", patch_policy)
    app.router.add_post("/v1/checkpoint", post_checkpoint)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/openapi.json", openapi)
    return app
