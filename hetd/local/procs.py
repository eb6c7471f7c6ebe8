"""The daemon and worker processes on this host: their command lines, their environment, starting
them, waiting until they are ready, and stopping them.

The demo, the benchmarks and the tests start ``hetd serve`` and ``hetd-worker`` through here, so a
change to how a local process is launched (an interpreter flag, an environment variable, the way
it is stopped) is made once. Both run under this interpreter (``python -m``), as the checkout or
virtual environment that started them. Nothing here imports JAX: a parent that only launches
processes stays light.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import time
from asyncio.subprocess import DEVNULL, Process
from collections.abc import Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import IO, Any

Stdio = int | IO[Any] | None
"""A child's standard stream: ``asyncio.subprocess.PIPE`` or ``DEVNULL``, an open file, or None
(inherited)."""

STOP_TIMEOUT_S = 15.0  # SIGTERM to SIGKILL: past a worker's grace to finish its step and say bye


def worker_env(token: str, admin_token: str | None = None) -> dict[str, str]:
    """This process's environment for a local daemon or worker: the worker token (and the admin
    token when given), one XLA thread, and malloc settings for big frames. Settings the caller's
    environment already has are kept."""
    env = dict(os.environ)
    env["HETD_WORKER_TOKEN"] = token
    if admin_token is not None:
        env["HETD_ADMIN_TOKEN"] = admin_token
    env.setdefault("XLA_FLAGS", "--xla_cpu_multi_thread_eigen=false")
    env.setdefault("MALLOC_MMAP_THRESHOLD_", "1073741824")
    env.setdefault("MALLOC_TRIM_THRESHOLD_", "4294967296")
    env.setdefault("JAX_PLATFORMS", "cpu")
    return env


def daemon_command(*args: str, hetd_flags: Sequence[str] = ()) -> list[str]:
    """``hetd [hetd_flags] serve ARGS`` under this interpreter."""
    return [sys.executable, "-m", "hetd", *hetd_flags, "serve", *args]


def worker_command(url: str, *args: str) -> list[str]:
    """``hetd-worker URL ARGS`` under this interpreter."""
    return [sys.executable, "-m", "workers.cli", url, *args]


async def spawn(
    argv: Sequence[str],
    env: Mapping[str, str] | None,
    *,
    stdin: Stdio = None,
    stdout: Stdio = DEVNULL,
    stderr: Stdio = DEVNULL,
    cwd: str | Path | None = None,
) -> Process:
    """Start ``argv``; output is discarded unless ``stdout``/``stderr`` say otherwise."""
    return await asyncio.create_subprocess_exec(
        *argv, env=env, stdin=stdin, stdout=stdout, stderr=stderr, cwd=cwd
    )


async def spawn_daemon(
    *args: str,
    env: Mapping[str, str] | None,
    hetd_flags: Sequence[str] = (),
    stdout: Stdio = DEVNULL,
    stderr: Stdio = DEVNULL,
    cwd: str | Path | None = None,
) -> Process:
    """Start ``hetd serve ARGS`` (:func:`daemon_command`)."""
    argv = daemon_command(*args, hetd_flags=hetd_flags)
    return await spawn(argv, env, stdout=stdout, stderr=stderr, cwd=cwd)


async def spawn_worker(
    url: str,
    *args: str,
    env: Mapping[str, str] | None,
    stdin: Stdio = None,
    stdout: Stdio = DEVNULL,
    stderr: Stdio = DEVNULL,
    cwd: str | Path | None = None,
    wrap: Callable[[list[str]], list[str]] | None = None,
) -> Process:
    """Start ``hetd-worker URL ARGS`` (:func:`worker_command`); ``wrap`` turns its command line
    into the one to run (inside a network namespace, say)."""
    argv = worker_command(url, *args)
    if wrap is not None:
        argv = wrap(argv)
    return await spawn(argv, env, stdin=stdin, stdout=stdout, stderr=stderr, cwd=cwd)


async def wait_ready(
    ready: Callable[[], Awaitable[bool]],
    proc: Process,
    *,
    timeout: float | None,
    interval: float,
    name: str = "the daemon",
    late: str = "",
) -> None:
    """Call ``ready`` every ``interval`` s until it says yes. RuntimeError as soon as ``proc``
    (called ``name`` in the message) has exited; TimeoutError after ``timeout`` s (None: never),
    saying ``late`` (by default, that ``name`` was not ready)."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while deadline is None or time.monotonic() < deadline:
        if await ready():
            return
        if proc.returncode is not None:
            raise RuntimeError(f"{name} exited with code {proc.returncode}")
        await asyncio.sleep(interval)
    raise TimeoutError(late or f"{name} was not ready within {timeout:g} s")


async def stop_processes(procs: Sequence[Process], timeout: float = STOP_TIMEOUT_S) -> None:
    """SIGTERM every process still running, wait up to ``timeout`` s for each, then SIGKILL
    what is left."""
    for p in procs:
        if p.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                p.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            await asyncio.wait_for(p.wait(), timeout)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                p.kill()
            await p.wait()
