"""Shared test doubles and factories.

* :class:`FakeClock` and :class:`FakePeer` drive an :class:`hetd.core.engine.Engine` directly in unit
  tests: time is whatever the test sets, frames are collected instead of sent.
* :func:`cluster` (a fixture) starts a real daemon on loopback, and :class:`Cluster` real
  ``hetd-worker`` processes for it; :func:`make_config` is its config, with the test tokens.

Every factory closes what it built, even when the test fails. Heavy modules (JAX through the
daemon) are imported where they are used, so pure policy tests do not pay for them.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import os
import shutil
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import TYPE_CHECKING, Any

import pytest
import pytest_asyncio

if TYPE_CHECKING:
    from hetd import config as config_mod
    from hetd.server.daemon import Daemon

os.environ.setdefault("JAX_PLATFORMS", "cpu")


def _compile_cache() -> None:
    """One JAX persistent compilation cache for this test session, as every ``hetd`` process
    keeps one (:mod:`hetd.launch`): the session's own process and every daemon and worker process
    it starts (they inherit the environment) compile a computation once and load it afterwards,
    instead of each worker compiling the same step again. A fresh directory per session (a clean
    clone compiles everything once), removed at the end; a directory the user set is kept. The
    executables are XLA's, the same whether compiled or loaded."""
    if "JAX_COMPILATION_CACHE_DIR" in os.environ or os.environ.get("HETD_JAX_CACHE") == "0":
        return
    path = tempfile.mkdtemp(prefix="hetd-tests-jax-cache-")
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    os.environ["JAX_COMPILATION_CACHE_DIR"] = path
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"


_compile_cache()


@contextlib.contextmanager
def no_compile_cache() -> Iterator[None]:
    """Processes started inside compile everything themselves (a test that needs a worker's
    first build to take its full time)."""
    saved = os.environ.pop("JAX_COMPILATION_CACHE_DIR", None)
    try:
        yield
    finally:
        if saved is not None:
            os.environ["JAX_COMPILATION_CACHE_DIR"] = saved


WORKER_TOKEN = "worker-secret-for-tests"
ADMIN_TOKEN = "admin-secret-for-tests"


# --- unit tests: an engine without sockets ---------------------------------------------------------


class FakeClock:
    """The engine's clock, set by the test (``clock.t = ...``)."""

    def __init__(self) -> None:
        self.t = 100.0

    def now(self) -> float:
        return self.t


class FakePeer:
    """A session's outbox that keeps what the engine sends it: its typed replies (``replies``,
    :mod:`hetd.protocol.messages`) and its encoded ``params`` frames (``frames``)."""

    def __init__(self) -> None:
        self.replies: list[Any] = []
        self.frames: list[bytes] = []
        self.closed: str | None = None  # the reason the engine closed the session

    def send(self, reply: Any) -> None:
        self.replies.append(reply)

    def send_params(self, frame: bytes, *, full: bool) -> None:
        self.frames.append(frame)

    def close(self, reason: str) -> None:
        self.closed = reason


# --- integration tests: a real daemon on loopback, real worker processes ---------------------------


def make_config(
    policy: str,
    params: dict[str, Any] | None = None,
    server: dict[str, Any] | None = None,
    **train: Any,
) -> config_mod.Config:
    """A config for digits on loopback with test tokens."""
    from hetd import config as config_mod

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
    # evaluations every 0.5 s (the daemon's default is 1 s): a target is seen soon after it
    defaults: dict[str, Any] = {
        "dataset": "digits",
        "model": "mlp",
        "lr": 0.2,
        "eval_interval_s": 0.5,
    }
    cfg = config_mod.replace(cfg, "train", **{**defaults, **train})
    return config_mod.replace(cfg, "policy", name=policy, params=params or {})


async def spawn_worker(
    url: str, *args: str, stdin: bool = False, log: bool = True
) -> asyncio.subprocess.Process:
    """One real ``hetd-worker`` process joining ``url`` with the worker token, ``args`` after the
    url; its ``stderr`` a pipe (``log``) or discarded, ``stdin`` a pipe when asked."""
    from hetd.local import procs

    return await procs.spawn_worker(
        url,
        *args,
        env=procs.worker_env(WORKER_TOKEN),
        stdin=asyncio.subprocess.PIPE if stdin else None,
        stderr=asyncio.subprocess.PIPE if log else asyncio.subprocess.DEVNULL,
    )


async def start_worker(port: int, steps: int) -> asyncio.subprocess.Process:
    """One real ``hetd-worker`` process (verbose: its log on ``stderr``, a pipe) that makes
    ``steps`` pushes to the daemon on ``port`` and exits."""
    return await spawn_worker(
        f"ws://127.0.0.1:{port}", "--steps", str(steps), "--max-retries", "3", "-v"
    )


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
        from hetd.local import procs

        proc = await procs.spawn_worker(
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
            env=procs.worker_env(token),
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


@contextlib.asynccontextmanager
async def clusters() -> AsyncIterator[Callable[..., Awaitable[Cluster]]]:
    """``make(policy, params, server={...}, store={...}, **train)`` starts a daemon; everything
    made is stopped on the way out. Behind :func:`cluster` and the module-scoped clusters that
    several tests of one module share (one daemon and worker start-up for all their asserts)."""
    from hetd import config as config_mod
    from hetd.local.procs import stop_processes
    from hetd.server.daemon import Daemon

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

    try:
        yield make
    finally:
        for c in made:
            await stop_processes(c.procs)
            with contextlib.suppress(Exception):
                await c.daemon.stop()


@pytest.fixture
async def cluster() -> AsyncIterator[Callable[..., Awaitable[Cluster]]]:
    """``await cluster(policy, params, server={...}, store={...}, **train)`` starts a daemon;
    everything is stopped at the end."""
    async with clusters() as make:
        yield make


# The mark of a test on a module-scoped cluster: it runs in the module's event loop, where that
# cluster's daemon lives.
SHARED_LOOP = pytest.mark.asyncio(loop_scope="module")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def raw_asp() -> AsyncIterator[Cluster]:
    """An asp daemon without workers, shared by a module's raw-client tests (mark them
    :data:`SHARED_LOOP`): each opens and closes its own sessions, and none changes the policy."""
    async with clusters() as make:
        yield await make("asp")


# --- a raw protocol-v1 client (tests that speak to the daemon without a worker process) ----------

WORKER_AUTH = {"Authorization": f"Bearer {WORKER_TOKEN}"}


async def until(what: Callable[[], bool], why: str, timeout: float = 240.0) -> None:
    """Wait until ``what()`` holds, looking every 0.02 s; AssertionError naming ``why`` past
    ``timeout`` s (generous by default: every process imports JAX on a shared 2-core machine)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not what():
        assert loop.time() < deadline, f"timed out waiting: {why}"
        await asyncio.sleep(0.02)


async def recv_type(ws: Any, type_: str) -> Any:
    """The next message of ``type_`` on a raw client websocket, skipping the others."""
    import aiohttp

    from hetd.protocol import wire

    while True:
        frame = await ws.receive(timeout=20)
        assert frame.type == aiohttp.WSMsgType.BINARY, frame
        msg = wire.decode(frame.data)
        if msg.type == type_:
            return msg


def raw_hello(resume: dict[str, Any] | None = None) -> bytes:
    """A raw client's hello (``resume``: the worker id and secret to resume, when given)."""
    from hetd.protocol import wire

    extra = {} if resume is None else {"resume": resume}
    return wire.encode("hello", 1, name="raw", device={"platform": "cpu"}, codecs=["none"], **extra)
