"""Factories for integration tests: a real daemon on loopback, real ``hetd-worker`` processes.

Every factory closes what it built, even when the test fails.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest

from hetd import config as config_mod
from hetd.local.demo import stop_processes, worker_env
from hetd.server.daemon import Daemon

WORKER_TOKEN = "worker-secret-for-tests"
ADMIN_TOKEN = "admin-secret-for-tests"


def make_config(
    policy: str,
    params: dict[str, Any] | None = None,
    server: dict[str, Any] | None = None,
    **train: Any,
) -> config_mod.Config:
    """A config for digits on loopback with test tokens."""
    cfg = config_mod.Config()
    cfg = config_mod.replace(
        cfg,
        "server",
        port=0,
        admin_port=0,
        worker_token=WORKER_TOKEN,
        admin_token=ADMIN_TOKEN,
        **{"heartbeat_s": 0.5, "heartbeat_timeout_s": 10.0, **(server or {})},
    )
    defaults: dict[str, Any] = {"dataset": "digits", "model": "mlp", "lr": 0.2}
    cfg = config_mod.replace(cfg, "train", eval_interval_s=0.5, **{**defaults, **train})
    return config_mod.replace(cfg, "policy", name=policy, params=params or {})


class Cluster:
    """A daemon plus the worker processes started for it."""

    def __init__(self, daemon: Daemon, url: str) -> None:
        self.daemon = daemon
        self.engine = daemon.engine
        self.url = url
        self.procs: list[asyncio.subprocess.Process] = []

    @property
    def admin_url(self) -> str:
        """The daemon's admin API (``admin_port = 0`` in tests: a free port)."""
        return f"http://127.0.0.1:{self.daemon.admin_port}"

    async def spawn(
        self, slowdown: float = 1.0, base_step: float = 0.02, *extra: str, token: str = WORKER_TOKEN
    ) -> asyncio.subprocess.Process:
        """Start one real worker process."""
        env = worker_env(token)
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "workers.cli",
            self.url,
            "--name",
            f"w{len(self.procs)}-x{slowdown:g}",
            "--emulate-slowdown",
            str(slowdown),
            "--emulate-base-step",
            str(base_step),
            "--max-retries",
            "3",
            *extra,
            env=env,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE,
        )
        self.procs.append(proc)
        return proc

    async def wait_for(self, predicate: Callable[[], bool], timeout: float, what: str) -> None:
        """Poll ``predicate`` until it holds; fail naming ``what`` and showing worker errors."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if predicate():
                return
            await asyncio.sleep(0.05)
        errors = []
        for p in self.procs:
            if p.returncode is not None and p.stderr is not None:
                errors.append((await p.stderr.read()).decode()[-2000:])
        pytest.fail(f"timed out after {timeout}s waiting for {what}; worker errors: {errors}")


@pytest.fixture
async def cluster() -> AsyncIterator[Callable[..., Awaitable[Cluster]]]:
    """``await cluster(policy, params, server={...}, store={...}, **train)`` starts a daemon;
    everything is stopped at the end."""
    made: list[Cluster] = []

    async def make(
        policy: str,
        params: dict[str, Any] | None = None,
        server: dict[str, Any] | None = None,
        store: dict[str, Any] | None = None,
        **train: Any,
    ) -> Cluster:
        cfg = make_config(policy, params, server, **train)
        if store:
            cfg = config_mod.replace(cfg, "store", **store)
        daemon = Daemon(cfg)
        port = await daemon.start()
        c = Cluster(daemon, f"ws://127.0.0.1:{port}")
        made.append(c)
        return c

    yield make
    for c in made:
        await stop_processes(c.procs)
        with contextlib.suppress(Exception):
            await c.daemon.stop()


os.environ.setdefault("JAX_PLATFORMS", "cpu")
