"""A new user's first steps with workers and the admin command, and their first mistakes, as they
make them (real ``hetd-worker`` processes and the installed
``hetd`` command against a real daemon on loopback), each answered at once, with exit status 2
for the worker, and a message that says what to do:

* a worker URL without ``ws://`` (or with another scheme);
* a worker pointed at the admin port: told it is the admin API, not a wrong token;
* a worker with no token and one with a wrong token: told apart; the daemon logs each refused
  address once per reason and minute, not once per attempt;
* a worker that cannot import the daemon's model plug-in: its ``bye`` carries the error, and the
  daemon's log says why it left (not "connection closed");
* ``hetd status`` and ``hetd workers --json`` into a pipe that closed early: no traceback.

And a worker that works says so at the default log level: its join (id, shard, path, plan), a
progress line, and how it ended, without the connection details that ``-v`` adds.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import sys
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.conftest import ADMIN_TOKEN, SHARED_LOOP, WORKER_TOKEN, Cluster

pytestmark = pytest.mark.slow

HETD = Path(sys.executable).with_name("hetd")


async def worker(
    url: str, *args: str, token: str | None = WORKER_TOKEN, cwd: Path | None = None
) -> tuple[int, str]:
    """A real ``hetd-worker URL ARGS`` (token in HETD_WORKER_TOKEN; None: unset) that gives up
    after 2 failed reconnects; (exit status, stderr)."""
    from hetd.local.procs import spawn_worker, worker_env

    env = worker_env("")
    env.pop("HETD_WORKER_TOKEN")
    env.pop("PYTHONPATH", None)
    if token is not None:
        env["HETD_WORKER_TOKEN"] = token
    proc = await spawn_worker(
        url,
        "--max-retries",
        "2",
        "--retry-max-delay",
        "0.5",
        *args,
        env=env,
        cwd=cwd,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        _, err = await asyncio.wait_for(proc.communicate(), 120)
    except TimeoutError:
        proc.kill()
        _, err = await proc.communicate()
        pytest.fail(f"hetd-worker {url} {' '.join(args)} did not give up:\n{err.decode()}")
    assert proc.returncode is not None
    return proc.returncode, err.decode()


# Without a scheme (the common slip): the same check refuses another scheme (ftp://...), a
# process start each.
@pytest.mark.parametrize("url", ["127.0.0.1:7070"])
async def test_a_url_that_is_not_ws_is_refused_at_once(url: str) -> None:
    code, err = await worker(url)
    assert code == 2, err
    assert f"hetd-worker: {url!r} is not a worker URL" in err, err
    assert "ws://HOST:PORT" in err and "wss://HOST:PORT" in err, err
    assert "retrying" not in err and "connection lost" not in err, err


@SHARED_LOOP
@pytest.mark.parametrize("token", [WORKER_TOKEN, ADMIN_TOKEN])
async def test_a_worker_at_the_admin_port_is_told_it_is_the_admin_api(
    raw_asp: Cluster, token: str
) -> None:
    url = f"ws://127.0.0.1:{raw_asp.daemon.admin_port}"
    code, err = await worker(url, token=token)
    assert code == 2, err
    assert f"hetd-worker: {url} is the daemon's admin API (and dashboard), not its worker " in err
    assert "[server] port" in err, err
    assert "token" not in err, err  # the token was not the problem
    assert "retrying" not in err, err


@SHARED_LOOP
async def test_no_token_and_a_wrong_token_are_told_apart_and_logged_once_per_minute(
    raw_asp: Cluster, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, "hetd.server.sessions")
    code, err = await worker(raw_asp.url, token=None)
    assert code == 2, err
    assert "the daemon requires a worker token and this worker has none (401)" in err, err
    assert "set HETD_WORKER_TOKEN" in err, err

    code, err = await worker(raw_asp.url, token="not-the-token")
    assert code == 2, err
    assert "the daemon refused our worker token (401)" in err, err
    assert "is not the daemon's [server] worker_token" in err, err
    assert "not-the-token" not in err  # never echoed

    # A worker retrying with a wrong token many times: still one line for it.
    async with aiohttp.ClientSession() as http:
        for _ in range(5):
            with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
                await http.ws_connect(
                    raw_asp.url + "/v1/ws", headers={"Authorization": "Bearer wrong"}
                )
            assert refused.value.status == 401
    lines = [r.getMessage() for r in caplog.records if "refused a worker" in r.getMessage()]
    assert len(lines) == 2, lines
    assert lines[0].startswith("refused a worker from 127.0.0.1: no worker token"), lines
    assert lines[1].startswith("refused a worker from 127.0.0.1: a wrong worker token"), lines
    assert all(r.levelno == logging.WARNING for r in caplog.records if "refused" in r.getMessage())


async def test_a_worker_that_cannot_import_the_model_plug_in_says_why_when_it_leaves(
    cluster: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, "hetd.core.engine")
    # The daemon imports the plug-in from this checkout; a worker started elsewhere cannot.
    c = await cluster("asp", model="tests.unit.test_models:tiny_linear")
    code, err = await worker(c.url, "--model", "tests.unit.test_models:tiny_linear", cwd=tmp_path)
    assert code == 2, err
    why = "cannot import module 'tests.unit.test_models'"
    assert why in err, err

    def left() -> list[str]:
        return [r.getMessage() for r in caplog.records if " left: " in r.getMessage()]

    await c.wait_for(lambda: bool(left()), 10, "the daemon to log the worker's leave")
    assert why in left()[0] and "worker error: ValueError" in left()[0], left()
    assert "connection closed" not in left()[0], left()


async def hetd_into_closed_pipe(*args: str) -> tuple[int, str]:
    """``hetd ARGS`` with stdout a pipe whose reader is gone (``| head`` that already exited)."""
    read, write = os.pipe()
    os.close(read)
    env = {k: v for k, v in os.environ.items() if not k.startswith("HETD_")}
    env["HETD_ADMIN_TOKEN"] = ADMIN_TOKEN
    try:
        proc = await asyncio.create_subprocess_exec(
            str(HETD), *args, env=env, stdout=write, stderr=asyncio.subprocess.PIPE
        )
    finally:
        os.close(write)
    _, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode is not None
    return proc.returncode, err.decode()


@SHARED_LOOP
@pytest.mark.parametrize("command", [["status"], ["workers", "--json"]])
async def test_the_admin_cli_into_a_closed_pipe_exits_quietly(
    raw_asp: Cluster, command: list[str]
) -> None:
    code, err = await hetd_into_closed_pipe(*command, "--admin-url", raw_asp.admin_url)
    assert err == "", err  # no traceback, no "Exception ignored"
    assert code == 141, (code, err)  # 128 + SIGPIPE, what a shell shows for a Unix tool


@SHARED_LOOP
async def test_a_working_worker_says_what_it_does_at_the_default_level(raw_asp: Cluster) -> None:
    steps = 40  # at least 0.8 s of emulated steps: more than one progress period
    code, err = await worker(
        raw_asp.url,
        "--name",
        "talker",
        "--steps",
        str(steps),
        "--emulate-base-step",
        "0.02",
        "--progress-every",
        "0.5",
    )
    assert code == 0, err
    lines = err.splitlines()
    joins = [line for line in lines if f"joined {raw_asp.url} as worker " in line]
    assert len(joins) == 1, err
    # the module's daemon is shared: an earlier test's worker may still hold slot 0
    assert re.search(r"\(talker\), shard \d+ of \d+", joins[0]), joins
    assert "plan: batch 32" in joins[0], joins
    assert " over websocket; " in joins[0] or " over shared memory; " in joins[0], joins
    progress = [line for line in lines if " pushes (+" in line and "samples/s" in line]
    assert progress, err
    assert "staleness" in progress[0] and "version " in progress[0], progress
    assert lines[-1] == f"hetd-worker: done after {steps} pushes", err
    # The connection-level lines stay behind -v.
    assert not [line for line in lines if " hetd.worker INFO " in line], err
