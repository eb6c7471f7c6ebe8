"""The admin API's pipeline-replica routes, ``GET|POST /v1/replicas`` (docs/policies.md §11):
show the replica run beside the data-parallel workers, or form it from connected workers."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from aiohttp import web

from hetd.server.admin_context import AdminContext, ApiError, ReplicaControl, context, json_object


def _replicas(ctx: AdminContext) -> ReplicaControl:
    if ctx.replicas is None:  # a head whose pservers hold the parameters ([pservers] headers)
        raise ApiError(
            409,
            "no_replicas",
            "this daemon runs no pipeline replicas: its pservers hold the parameters "
            "([pservers] headers = true), and a replica's stages take them from the head",
        )
    return ctx.replicas


async def get_replicas(request: web.Request) -> web.Response:
    """The pipeline replica: members, generation, steps assembled and aborted."""
    return web.json_response(_replicas(context(request)).describe())


async def post_replicas(request: web.Request) -> web.Response:
    """Form the pipeline replica from connected workers (stage order) and block cuts."""
    ctx = context(request)
    body = await json_object(
        request,
        {"members", "cuts", "micro", "micro_batches", "inflight"},
        {"members", "cuts", "micro", "micro_batches"},
    )
    driver = _replicas(ctx)
    try:
        await driver.form(
            _ints(body, "members"),
            _ints(body, "cuts"),
            _int(body, "micro"),
            _int(body, "micro_batches"),
            _ints(body, "inflight") if "inflight" in body else (),
        )
    except ValueError as exc:
        raise ApiError(409, "bad_replica", str(exc)) from None
    return web.json_response(driver.describe())


def _int(body: Mapping[str, Any], name: str) -> int:
    value = body[name]
    if type(value) is not int or not 1 <= value <= 1 << 16:
        raise ApiError(400, "bad_request", f"{name} must be an integer in 1..65536")
    return value


def _ints(body: Mapping[str, Any], name: str) -> list[int]:
    value = body[name]
    if (
        not isinstance(value, list)
        or not 0 < len(value) <= 65
        or not all(type(v) is int and 0 <= v < 1 << 62 for v in value)
    ):
        raise ApiError(400, "bad_request", f"{name} must be a list of at most 65 integers >= 0")
    return value


def add_routes(app: web.Application) -> None:
    """Register the routes on the admin app."""
    app.router.add_get("/v1/replicas", get_replicas)
    app.router.add_post("/v1/replicas", post_replicas)
