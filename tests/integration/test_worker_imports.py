"""A worker imports only what its own operator named (issue 35, item 4). A fake daemon on
loopback answers ``/v1/prepare`` and the welcome with a plug-in of its choosing: a shell command
(``subprocess:getoutput`` called with the daemon's options) or a module that leaves a marker file
when it is imported. A ``hetd-worker`` (a real process for the shell command, its ``main`` in this process for
the rest) without ``--model``/``--dataset`` imports neither, and exits 2 naming the flag to pass;
one started with another ``--model`` is refused too; one told ``--dataset`` does import it (so the
marker would show an import)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from hetd.local.procs import spawn_worker, worker_env
from hetd.protocol import wire
from hetd.protocol.plan import Plan
from tests.conftest import WORKER_TOKEN
from workers.cli import main

pytestmark = pytest.mark.slow

EVIL_MODULE = """
from pathlib import Path
Path(__file__).with_name("imported.marker").write_text("imported")


def data(seed=0):
    raise RuntimeError("never a data set")
"""


def _setup(model: dict[str, Any], dataset: dict[str, Any]) -> dict[str, Any]:
    train = {"worker_lr": 0.1, "seed": 0, "inner_optimizer": "sgd", "micro_batch": 8}
    return {"model": model, "dataset": {"seed": 0, **dataset}, "train": train}


@contextlib.asynccontextmanager
async def fake_daemon(setup: dict[str, Any]) -> AsyncIterator[str]:
    """A daemon's worker port that tells every worker to build ``setup``: at ``/v1/prepare`` and
    in the welcome to its hello. Yields its ``ws://`` URL."""

    async def prepare(request: web.Request) -> web.Response:
        return web.json_response(setup)

    async def ws(request: web.Request) -> web.WebSocketResponse:
        sock = web.WebSocketResponse()
        await sock.prepare(request)
        async for frame in sock:
            if frame.type != aiohttp.WSMsgType.BINARY:
                break
            msg = wire.decode(frame.data)
            if msg.type == "hello":
                welcome = wire.encode(
                    "welcome",
                    msg.id,
                    worker_id=1,
                    plan=Plan().to_wire(),
                    heartbeat_s=5.0,
                    shard={"index": 0, "count": 1},
                    secret="s" * 32,
                    **setup,
                )
                await sock.send_bytes(welcome)
        return sock

    app = web.Application()
    app.router.add_get("/v1/prepare", prepare)
    app.router.add_get("/v1/ws", ws)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        yield f"ws://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


async def run_process(url: str, cwd: Path, *args: str) -> tuple[int, str]:
    """A real ``hetd-worker URL ARGS`` process in ``cwd`` (its modules importable, as ``python -m``
    makes them); (exit status, stderr)."""
    proc = await spawn_worker(
        url,
        "--max-retries",
        "1",
        "--retry-max-delay",
        "0.5",
        *args,
        cwd=cwd,
        env=worker_env(WORKER_TOKEN),
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        _, err = await asyncio.wait_for(proc.communicate(), 120)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert proc.returncode is not None
    return proc.returncode, err.decode(errors="replace")


def run_main(url: str, *args: str) -> int:
    """``hetd-worker URL ARGS`` through its ``main`` in this process (no start-up to wait for)."""
    return main([url, "--max-retries", "1", "--retry-max-delay", "0.5", "-q", *args])


async def test_a_spoofed_daemon_cannot_make_a_worker_import_or_call_its_plug_ins(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    shell_marker = tmp_path / "shell.marker"
    shell = _setup(
        {"spec": "subprocess:getoutput", "kwargs": {"cmd": f"touch {shell_marker}"}},
        {"spec": "digits", "kwargs": {}},
    )
    for name in ("evil_refused", "evil_allowed"):  # each leaves <name>.marker when imported
        (tmp_path / f"{name}.py").write_text(
            EVIL_MODULE.replace("imported.marker", f"{name}.marker")
        )
    monkeypatch.syspath_prepend(str(tmp_path))  # importable here, as from a worker's directory
    refused = _setup({"spec": "mlp", "kwargs": {}}, {"spec": "evil_refused:data", "kwargs": {}})
    allowed = _setup({"spec": "mlp", "kwargs": {}}, {"spec": "evil_allowed:data", "kwargs": {}})
    async with (
        fake_daemon(shell) as shell_url,
        fake_daemon(refused) as refused_url,
        fake_daemon(allowed) as allowed_url,
    ):
        # the attack of the issue on a real worker process, while the rest runs in this one
        process = asyncio.create_task(run_process(shell_url, tmp_path))

        assert await asyncio.to_thread(run_main, refused_url) == 2
        err = capsys.readouterr().err
        assert "the daemon trains the plug-in data set 'evil_refused:data'" in err, err
        assert "start it with --dataset evil_refused:data if you trust that code" in err, err
        assert not (tmp_path / "evil_refused.marker").exists()

        # Named, but not what the daemon trains: compared, refused, nothing imported.
        assert await asyncio.to_thread(run_main, shell_url, "--model", "mlp") == 2
        err = capsys.readouterr().err
        assert "the daemon trains the model 'subprocess:getoutput' but this worker was " in err
        assert "started with --model mlp" in err, err

        # The operator's word: now it is imported (so the marker shows an import when one does).
        code = await asyncio.to_thread(run_main, allowed_url, "--dataset", "evil_allowed:data")
        err = capsys.readouterr().err
        assert (tmp_path / "evil_allowed.marker").exists(), err
        assert code == 2 and "never a data set" in err, err

        code, err = await process
        assert code == 2, err
        assert "the daemon trains the plug-in model 'subprocess:getoutput'" in err, err
        assert "start it with --model subprocess:getoutput if you trust that code" in err
        assert not shell_marker.exists()
