"""Build the worker's :class:`~workers.loop.Core` (data, model, compiled steps) while the daemon
still builds its own: ``GET /v1/prepare`` on the worker port answers with what every worker is
told to build (the config's model, dataset and train settings) before the daemon is ready, so the
two compile at the same time instead of one after the other. A daemon without the route (an older
one: 404), or any failure here, only means the core is built at the welcome, as before."""

from __future__ import annotations

import asyncio
import logging
import ssl
import time
from collections.abc import Mapping
from typing import Any

import aiohttp
import jax

from hetd.zoo.task import Bound
from workers.imports import Allowed
from workers.loop import Core, check_setup

log = logging.getLogger("hetd.worker")

PREPARE_TIMEOUT_S = 5.0  # the route answers from the config at once; a slow answer is not worth it


def prepare_url(url: str) -> str:
    """The ``/v1/prepare`` address of the daemon at websocket base ``url`` (ws → http, wss → https)."""
    base = url.rstrip("/")
    for ws, http in (("wss://", "https://"), ("ws://", "http://")):
        if base.startswith(ws):
            return http + base[len(ws) :] + "/v1/prepare"
    return base + "/v1/prepare"


def _is_setup(body: Any) -> bool:
    return isinstance(body, dict) and all(
        isinstance(body.get(k), dict) for k in ("model", "dataset", "train")
    )


async def fetch_setup(
    http: aiohttp.ClientSession,
    url: str,
    token: str,
    ssl_context: ssl.SSLContext | None,
) -> dict[str, Any] | None:
    """The daemon's worker setup, or None (no such route, refused, unreachable, malformed)."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        async with http.get(
            prepare_url(url),
            headers=headers,
            ssl=ssl_context if ssl_context is not None else True,
            timeout=aiohttp.ClientTimeout(total=PREPARE_TIMEOUT_S),
        ) as resp:
            if resp.status != 200:
                log.debug("no early setup from the daemon (HTTP %d)", resp.status)
                return None
            body = await resp.json()
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
        log.debug("no early setup from the daemon: %s", exc)
        return None
    if not _is_setup(body):
        log.debug("ignored a malformed early setup from the daemon")
        return None
    return dict(body)


def _build(
    setup: Mapping[str, Any],
    device: jax.Device | None,
    task: Bound | None = None,
    allowed: Allowed | None = None,
) -> Core | None:
    began = time.perf_counter()
    try:
        # never import a task, model or data set only the daemon names (workers.imports)
        check_setup(setup, task, full=False, allowed=allowed)
        core = Core(setup, device or jax.devices()[0], task, allowed)
    except Exception as exc:  # an unknown model here: the welcome will say so again, clearly
        log.warning("could not prepare the model early (%s); building it at the welcome", exc)
        return None
    log.info(
        "prepared the model in %.1f s (data loaded, step compiled)", time.perf_counter() - began
    )
    return core


async def start_preparing(
    http: aiohttp.ClientSession,
    url: str,
    token: str,
    ssl_context: ssl.SSLContext | None,
    device: jax.Device | None,
    task: Bound | None = None,
    allowed: Allowed | None = None,
) -> asyncio.Task[Core | None] | None:
    """Ask for the setup and, when the daemon gives one, build the core in a thread; the task's
    result is the core (None when building it failed)."""
    setup = await fetch_setup(http, url, token, ssl_context)
    if setup is None:
        return None
    log.info(
        "preparing %s on %s while the daemon starts",
        setup["model"].get("spec"),
        setup["dataset"].get("spec"),
    )
    return asyncio.create_task(
        asyncio.to_thread(_build, setup, device, task, allowed), name="hetd-prepare"
    )


async def prepared(task: asyncio.Task[Core | None] | None) -> Core | None:
    """The prepared core once it is built (None: nothing was prepared, or it failed)."""
    if task is None:
        return None
    try:
        return await task
    except Exception as exc:
        log.warning("preparing the model failed (%s); building it at the welcome", exc)
        return None
