"""The process layer with real child processes: a stop that SIGTERM does not end is finished with
SIGKILL, a wait for readiness fails at once when the process dies and on time when it is late, and
the daemon's command line puts ``hetd``'s own flags before ``serve``."""

from __future__ import annotations

import asyncio
import signal
import sys
import time

import pytest

from hetd.local import procs

IGNORES_TERM = (
    "import signal, sys, time\n"
    "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
    "print('up', flush=True)\n"
    "time.sleep(60)\n"
)


async def _python(code: str) -> asyncio.subprocess.Process:
    proc = await procs.spawn([sys.executable, "-c", code], None, stdout=asyncio.subprocess.PIPE)
    assert proc.stdout is not None
    assert await asyncio.wait_for(proc.stdout.readline(), 30) == b"up\n"  # its handler is set
    return proc


async def test_stop_ends_a_process_with_sigterm_and_one_that_ignores_it_with_sigkill() -> None:
    polite = await _python("import time\nprint('up', flush=True)\ntime.sleep(60)\n")
    stubborn = await _python(IGNORES_TERM)
    began = time.monotonic()
    await procs.stop_processes([polite, stubborn], timeout=1.0)
    assert polite.returncode == -signal.SIGTERM
    assert stubborn.returncode == -signal.SIGKILL
    assert time.monotonic() - began < 10
    await procs.stop_processes([polite, stubborn])  # both gone: nothing to do, no error


async def test_wait_ready_returns_fails_on_exit_and_times_out() -> None:
    alive = await _python("import time\nprint('up', flush=True)\ntime.sleep(60)\n")
    try:
        calls = 0

        async def third_time() -> bool:
            nonlocal calls
            calls += 1
            return calls == 3

        await procs.wait_ready(third_time, alive, timeout=10, interval=0.01)
        assert calls == 3

        async def never() -> bool:
            return False

        with pytest.raises(TimeoutError, match=r"the worker was not ready within 0\.2 s"):
            await procs.wait_ready(never, alive, timeout=0.2, interval=0.01, name="the worker")
        with pytest.raises(TimeoutError, match=r"^no update$"):
            await procs.wait_ready(never, alive, timeout=0.1, interval=0.01, late="no update")
    finally:
        await procs.stop_processes([alive])
    dead = await procs.spawn([sys.executable, "-c", "raise SystemExit(3)"], None)
    await dead.wait()
    with pytest.raises(RuntimeError, match="the daemon exited with code 3"):
        await procs.wait_ready(never, dead, timeout=None, interval=0.01)


async def test_the_daemon_command_runs_hetd_serve_with_hetd_flags_first() -> None:
    argv = procs.daemon_command("--port", "0", hetd_flags=("-v",))
    assert argv[:3] == [sys.executable, "-m", "hetd"] and argv[3:] == ["-v", "serve", "--port", "0"]
    proc = await procs.spawn_daemon(
        "--help", hetd_flags=("-v",), env=None, stdout=asyncio.subprocess.PIPE
    )
    out, _ = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 0 and b"--state-dir" in out  # serve's own help, not hetd's


def test_worker_env_sets_the_tokens_and_keeps_the_callers_settings(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("XLA_FLAGS", "--mine")
    monkeypatch.delenv("HETD_ADMIN_TOKEN", raising=False)
    env = procs.worker_env("w-token")
    assert env["HETD_WORKER_TOKEN"] == "w-token" and "HETD_ADMIN_TOKEN" not in env
    assert env["XLA_FLAGS"] == "--mine" and env["JAX_PLATFORMS"]
    assert procs.worker_env("w", "a")["HETD_ADMIN_TOKEN"] == "a"
