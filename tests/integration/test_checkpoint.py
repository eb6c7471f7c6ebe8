"""``hetd serve`` as systemd runs it: READY=1 on a real NOTIFY_SOCKET, SIGTERM mid-run, a final
checkpoint, a restart that resumes the version, policy and clocks while real workers reconnect."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from hetd.local.procs import spawn_daemon, stop_processes
from hetd.server import checkpoint
from tests.conftest import ADMIN_TOKEN, WORKER_TOKEN, spawn_worker

pytestmark = pytest.mark.slow

AUTH = {"Authorization": f"Bearer {ADMIN_TOKEN}"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class Served:
    """One ``hetd serve`` process and the datagram socket it notifies."""

    def __init__(self, proc: asyncio.subprocess.Process, notify: socket.socket, log: Path) -> None:
        self.proc, self.notify, self.log = proc, notify, log
        self.admin = ""

    async def message(self, timeout: float = 60.0) -> str:
        """The next sd_notify datagram."""
        loop = asyncio.get_running_loop()
        try:
            data = await asyncio.wait_for(loop.sock_recv(self.notify, 4096), timeout)
        except TimeoutError:
            pytest.fail(f"no sd_notify message in {timeout}s; log:\n{self.log.read_text()[-3000:]}")
        return data.decode()


@pytest.fixture
async def serve(tmp_path: Path) -> AsyncIterator[Any]:
    """``await serve()`` starts ``hetd serve`` with a config file and a state directory."""
    port = free_port()
    state = tmp_path / "state"
    cfg = tmp_path / "hetd.toml"
    cfg.write_text(
        f"""
[server]
port = {port}
admin_port = 0
heartbeat_s = 0.5
heartbeat_timeout_s = 5.0
stop_timeout_s = 5.0

[train]
dataset = "digits"
lr = 0.2
eval_interval_s = 0.5

[policy]
name = "ssp"
params = {{ staleness = 3 }}

[store]
interval_s = 1.0
keep = 2
"""
    )
    short = Path(tempfile.mkdtemp(prefix="hetd-", dir="/tmp"))  # AF_UNIX paths are short
    started: list[Served] = []

    async def start() -> Served:
        path = short / f"notify{len(started)}"
        notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        notify.bind(str(path))
        notify.setblocking(False)
        env = {
            **os.environ,
            "NOTIFY_SOCKET": str(path),
            "HETD_WORKER_TOKEN": WORKER_TOKEN,
            "HETD_ADMIN_TOKEN": ADMIN_TOKEN,
            "JAX_PLATFORMS": "cpu",
        }
        log = tmp_path / f"serve{len(started)}.log"
        with open(log, "wb") as fh:
            proc = await spawn_daemon(
                "--config",
                str(cfg),
                "--state-dir",
                str(state),
                hetd_flags=("-v",),
                env=env,
                stdout=fh,
                stderr=fh,
            )
        s = Served(proc, notify, log)
        started.append(s)
        return s

    start.port = port  # type: ignore[attr-defined]
    start.state = state  # type: ignore[attr-defined]
    yield start
    for s in started:
        if s.proc.returncode is None:
            s.proc.kill()
            await s.proc.wait()
        s.notify.close()
    for p in short.iterdir():
        p.unlink()
    short.rmdir()


async def get(http: aiohttp.ClientSession, served: Served, path: str) -> Any:
    async with http.get(served.admin + path, headers=AUTH) as resp:
        assert resp.status == 200, await resp.text()
        return await resp.json()


async def until(what: str, check: Any, timeout: float = 60.0) -> Any:
    """Poll the async ``check`` until it returns something truthy."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(aiohttp.ClientError):
            value = await check()
            if value:
                return value
        await asyncio.sleep(0.2)
    pytest.fail(f"timed out after {timeout}s waiting for {what}")


async def ready(served: Served) -> str:
    msg = await served.message()
    assert msg.startswith("READY=1\n"), msg
    m = re.search(r"admin on [^ ]+:(\d+)", msg)
    assert m, msg
    served.admin = f"http://127.0.0.1:{m.group(1)}"
    return msg


async def test_sigterm_checkpoints_and_a_restart_resumes(serve) -> None:  # type: ignore[no-untyped-def]
    first = await serve()
    assert "fresh start" in await ready(first)
    workers = []
    for i, slowdown in enumerate((1, 2)):
        workers.append(
            await spawn_worker(
                f"ws://127.0.0.1:{serve.port}",
                "--name",
                f"w{i}",
                "--emulate-slowdown",
                str(slowdown),
                "--emulate-base-step",
                "0.02",
                "--max-retries",
                "40",
                log=False,
            )
        )
    try:
        async with aiohttp.ClientSession() as http:

            async def trained() -> Any:
                st = await get(http, first, "/v1/status")
                ok = st["workers"] == 2 and st["version"] >= 60 and (st["accuracy"] or 0) > 0.5
                return st if ok else None

            await until("2 workers, 60 updates and accuracy > 0.5", trained)
            # The operator tunes the policy; the restart must keep it, not the file's.
            async with http.patch(
                first.admin + "/v1/policy", json={"params": {"staleness": 2}}, headers=AUTH
            ) as resp:
                assert resp.status == 200
            async with http.post(first.admin + "/v1/checkpoint", headers=AUTH) as resp:
                assert resp.status == 200
                ck = await resp.json()
            assert Path(ck["path"]).exists() and ck["version"] >= 60
            before = {
                r["worker"]: r["clock"] for r in (await get(http, first, "/v1/workers"))["workers"]
            }
            last = await get(http, first, "/v1/status")

            first.proc.send_signal(signal.SIGTERM)
            assert (await first.message()).startswith("STOPPING=1")
            t0 = time.monotonic()
            assert await asyncio.wait_for(first.proc.wait(), 20) == 0
            assert time.monotonic() - t0 < 15
            found = checkpoint.load_newest(serve.state)
            assert found is not None
            info, state = found
            saved_version = info.version
            assert saved_version >= last["version"]
            assert len(checkpoint.list_checkpoints(serve.state)) == 2  # keep = 2
            saved_clocks = {int(w): v["clock"] for w, v in state["workers"].items()}
            assert all(saved_clocks[w] >= c for w, c in before.items())
            assert all(p.returncode is None for p in workers), "a worker quit on daemon stop"

            second = await serve()
            assert f"resumed at version {saved_version}" in await ready(second)
            st = await get(http, second, "/v1/status")
            assert st["version"] >= saved_version
            assert st["checkpoint"]["resumed_from"]["version"] == saved_version
            assert st["policy"] == {
                "name": "ssp",
                "params": {"staleness": 2, "weight": None, "patience": 10.0},
            }

            async def carried_on() -> Any:
                s = await get(http, second, "/v1/status")
                rows = (await get(http, second, "/v1/workers"))["workers"]
                ok = len(rows) == 2 and s["version"] >= saved_version + 40 and s["accuracy"]
                return (s, rows) if ok else None

            st, rows = await until("the workers to reconnect and train on", carried_on)
            # Same workers (same ids), clocks carried on from the checkpoint, model kept learning
            # from where it was (a fresh model scores about 0.1 on digits).
            assert {r["worker"] for r in rows} == set(before)
            assert all(r["clock"] >= saved_clocks[r["worker"]] for r in rows)
            assert st["accuracy"] >= min(last["accuracy"], 0.9) - 0.05
            second.proc.send_signal(signal.SIGTERM)
            assert await asyncio.wait_for(second.proc.wait(), 20) == 0
    finally:
        await stop_processes(workers)


ROOT = Path(__file__).resolve().parents[2]


def test_the_example_config_loads_and_documents_every_key(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import dataclasses
    import tomllib

    from hetd import config

    text = (ROOT / "systemd" / "hetd.toml").read_text()
    raw = tomllib.loads(text)
    # The example listens on every interface, so it needs the worker token that
    # systemd reads from /etc/hetd/tokens.env; without it start-up stops.
    monkeypatch.delenv("HETD_WORKER_TOKEN", raising=False)
    monkeypatch.delenv("HETD_ADMIN_TOKEN", raising=False)
    with pytest.raises(config.ConfigError, match="HETD_WORKER_TOKEN"):
        config.check_serving(config.from_mapping(raw))
    monkeypatch.setenv("HETD_WORKER_TOKEN", "w-secret")
    monkeypatch.setenv("HETD_ADMIN_TOKEN", "a-secret")
    loaded = config.from_mapping(raw)
    assert loaded.server.host == "0.0.0.0"
    for name, cls in config._SECTIONS.items():
        defaults = cls()
        for f in dataclasses.fields(cls):
            assert re.search(rf"^#? ?{f.name} = ", text, re.M), f"[{name}] {f.name} undocumented"
            if f.name in raw.get(name, {}) and (name, f.name) != ("server", "host"):
                assert raw[name][f.name] == getattr(defaults, f.name), f"[{name}] {f.name}"


@pytest.mark.skipif(not shutil.which("systemd-analyze"), reason="systemd-analyze is not installed")
def test_systemd_units_verify(tmp_path: Path) -> None:
    """``systemd-analyze verify`` on both units, pointed at this checkout's venv."""
    units = {}
    for name in ("hetd.service", "hetd-worker@.service"):
        text = (ROOT / "systemd" / name).read_text()
        assert "/opt/hetd/.venv/bin/" in text
        units[name] = text
        (tmp_path / name).write_text(text.replace("/opt/hetd/.venv", sys.prefix))
    head = units["hetd.service"]
    for line in (
        "Type=notify",
        "Restart=on-failure",
        "StateDirectory=hetd",
        "--state-dir /var/lib/hetd",
        "PrivateDevices=yes",
    ):
        assert line in head, line
    worker = units["hetd-worker@.service"]
    assert "--device %i" in worker and "PrivateDevices" not in worker.replace(
        "No PrivateDevices", ""
    )
    result = subprocess.run(
        ["systemd-analyze", "verify", *(str(tmp_path / n) for n in units)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0 and not result.stderr.strip(), result.stderr
