"""The daemon: builds the engine from a config, serves websockets, handles signals and systemd.

``Daemon`` owns every task it starts (the engine, the HTTP runners) and cancels and awaits them on
``stop``. ``serve`` is what ``hetd serve`` runs: start, tell systemd READY=1, wait for SIGTERM or
SIGINT, stop taking work, say bye to workers, stop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from aiohttp import web

from hetd import config as config_mod
from hetd import sessions
from hetd.data import Dataset, load_dataset
from hetd.engine import Clock, Engine, EngineConfig
from hetd.models import Model, get_model
from hetd.store import Snapshot, Store, make_optimizer
from policies import make_policy

log = logging.getLogger("hetd.daemon")

ENGINE_KEY = web.AppKey("engine", Engine)


def make_evaluator(model: Model, data: Dataset) -> Callable[[Snapshot], tuple[float, float]]:
    """(loss, accuracy) of a parameter snapshot on the test set, jitted once."""
    x = jnp.asarray(data.x_test)
    y = jnp.asarray(data.y_test)

    @jax.jit
    def metrics(params: dict[str, jax.Array]) -> tuple[jax.Array, jax.Array]:
        return model.loss(params, x, y), model.accuracy(params, x, y)

    def evaluate(snap: Snapshot) -> tuple[float, float]:
        loss, acc = metrics({k: jnp.asarray(v) for k, v in snap.tensors.items()})
        return float(loss), float(acc)

    return evaluate


def build_engine(cfg: config_mod.Config, clock: Clock | None = None) -> Engine:
    """Model, data, store, policy and engine from a config."""
    t = cfg.train
    data = load_dataset(t.dataset, seed=t.seed, **dict(t.dataset_kwargs))
    model = get_model(t.model, data.num_classes, **dict(t.model_kwargs))
    params = model.init(jax.random.PRNGKey(t.seed), data.input_shape)
    store = Store(params, make_optimizer(t.optimizer, t.lr))
    policy = make_policy(cfg.policy.name, cfg.policy.params)
    econf = EngineConfig(
        global_batch=t.global_batch,
        batch_size=t.batch_size,
        codec=t.codec,
        heartbeat_s=cfg.server.heartbeat_s,
        heartbeat_timeout_s=cfg.server.heartbeat_timeout_s,
        eval_interval_s=t.eval_interval_s,
        max_staleness=t.max_staleness_drop,
        shards=t.shards,
        welcome={
            "model": {"spec": t.model, "kwargs": dict(t.model_kwargs)},
            "dataset": {"spec": t.dataset, "kwargs": dict(t.dataset_kwargs), "seed": t.seed},
            "train": {"worker_lr": t.worker_lr, "seed": t.seed},
        },
    )
    return Engine(store, policy, econf, clock=clock, evaluator=make_evaluator(model, data))


def make_worker_app(engine: Engine, cfg: config_mod.Config) -> web.Application:
    """The workers' HTTP app: ``/v1/ws`` and ``/healthz``."""
    app = web.Application(client_max_size=cfg.server.max_frame_bytes)
    app[ENGINE_KEY] = engine
    server = cfg.server

    async def ws(request: web.Request) -> web.StreamResponse:
        return await sessions.handle(
            request, engine, server.worker_token, server.max_frame_bytes, server.outbox_frames
        )

    async def healthz(request: web.Request) -> web.Response:
        return web.json_response({"ok": True, "version": engine.store.version})

    app.router.add_get("/v1/ws", ws)
    app.router.add_get("/healthz", healthz)
    return app


class Daemon:
    """A running daemon: the engine task plus the worker endpoint."""

    def __init__(self, cfg: config_mod.Config, engine: Engine | None = None) -> None:
        self.cfg = cfg
        self.engine = engine or build_engine(cfg)
        self._runners: list[web.AppRunner] = []
        self._engine_task: asyncio.Task[None] | None = None
        self.port = 0

    async def start(self) -> int:
        """Start serving; returns the bound worker port (useful with port 0)."""
        self._engine_task = asyncio.create_task(self.engine.run(), name="hetd-engine")
        runner = web.AppRunner(make_worker_app(self.engine, self.cfg), handle_signals=False)
        await runner.setup()
        site = web.TCPSite(runner, self.cfg.server.host, self.cfg.server.port)
        await site.start()
        self._runners.append(runner)
        sockets = getattr(site._server, "sockets", None) or []
        self.port = sockets[0].getsockname()[1] if sockets else self.cfg.server.port
        log.info("hetd listening for workers on %s:%d", self.cfg.server.host, self.port)
        return self.port

    async def stop(self, timeout: float = 5.0) -> None:
        """Say bye to workers, close sockets, stop the engine."""
        engine = self.engine
        with contextlib.suppress(Exception):
            await asyncio.wait_for(engine.call(lambda: _say_bye(engine)), timeout)
        for runner in self._runners:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(runner.cleanup(), timeout)
        self._runners.clear()
        if self._engine_task is not None:
            self._engine_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._engine_task
            self._engine_task = None


def _say_bye(engine: Engine) -> None:
    for wid in list(engine.facts):
        engine.leave(wid, "daemon stopping")


def sd_notify(state: str) -> bool:
    """Tell systemd about our state (``READY=1``, ``STOPPING=1``) when run as a notify service."""
    addr = os.environ.get("NOTIFY_SOCKET")
    if not addr:
        return False
    if addr.startswith("@"):
        addr = "\0" + addr[1:]
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.connect(addr)
        sock.sendall(state.encode())
    return True


async def serve(cfg: config_mod.Config, extra: Callable[[Daemon], Any] | None = None) -> None:
    """Run until SIGTERM/SIGINT, then drain and stop (what ``hetd serve`` does)."""
    daemon = Daemon(cfg)
    await daemon.start()
    if extra is not None:
        await extra(daemon)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    sd_notify("READY=1")
    await stop.wait()
    sd_notify("STOPPING=1")
    log.info("stopping: saying bye to %d workers", len(daemon.engine.facts))
    await daemon.stop()


def to_host(params: dict[str, Any]) -> dict[str, np.ndarray]:
    """Host copies of a flat parameter map."""
    return {k: np.asarray(v) for k, v in params.items()}
