"""``hetd serve`` refuses to start where restarting would not help, at once and with exit status
2 (the unit's ``RestartPreventExitStatus=2``), saying why: a state directory another running
daemon holds (naming it: pid, ports), a port in use. The refused process is the installed console
script; the daemon already there runs in this test's process, listening but not built (the lock
and the ports are taken before the model is), so each case takes a second or two."""

from __future__ import annotations

import asyncio
import os
import socket
import sys
from pathlib import Path

import pytest

from hetd import config as config_mod
from hetd.server.daemon import Daemon, StartupError
from hetd.server.statedir import LOCK_NAME, StateDirLock
from tests.conftest import make_config

# The console script installed next to this interpreter (.venv/bin/hetd), not ``python -m hetd``.
HETD = Path(sys.executable).with_name("hetd")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


async def hetd_serve(*args: str) -> tuple[int, str]:
    """``hetd serve ARGS`` on loopback, no admin API unless asked; (exit status, stderr). A
    daemon that starts instead of refusing is killed after 60 s (the test then fails)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("HETD_")}
    proc = await asyncio.create_subprocess_exec(
        str(HETD),
        "serve",
        "--host",
        "127.0.0.1",
        "--dataset",
        "digits",
        "--open-workers",  # (no token in this environment)
        *args,
        env=env,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        _, err = await asyncio.wait_for(proc.communicate(), 60)
    except TimeoutError:
        proc.kill()
        _, err = await proc.communicate()
        pytest.fail(f"hetd serve {' '.join(args)} started instead of refusing:\n{err.decode()}")
    assert proc.returncode is not None
    return proc.returncode, err.decode()


async def test_a_second_daemon_on_a_held_state_dir_exits_2_naming_the_holder(
    tmp_path: Path,
) -> None:
    state = tmp_path / "state"
    cfg = config_mod.replace(make_config("asp"), "store", dir=str(state))
    first = Daemon(cfg)
    await first.listen()  # locks the directory, then binds; nothing built
    try:
        assert first.admin_port is not None
        code, err = await hetd_serve("--state-dir", str(state), "--port", str(free_port()))
        assert code == 2, err
        assert "Traceback" not in err, err
        assert f"the state directory {state} is in use by another hetd daemon" in err, err
        assert f"pid {os.getpid()}" in err, err
        assert f"workers on port {first.port}" in err, err
        assert f"admin API on port {first.admin_port}" in err, err
        assert "--state-dir" in err, err  # what to do about it

        # The same in one process (a second Daemon object): refused before it binds anything.
        port = free_port()
        second = Daemon(config_mod.replace(cfg, "server", port=port, admin_port=-1))
        with pytest.raises(StartupError, match=f"pid {os.getpid()}"):
            await second.listen()
        with socket.socket() as s:  # the refused one left its port free
            s.bind(("127.0.0.1", port))
    finally:
        await first.stop()
    # Stopped, the first daemon let go: the next one takes the directory (the file stays).
    assert (state / LOCK_NAME).exists()
    StateDirLock.acquire(state).release()


async def test_a_state_dir_that_cannot_be_made_exits_2(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    code, err = await hetd_serve("--state-dir", str(blocker / "state"), "--port", "0")
    assert code == 2, err
    assert f"the state directory {blocker / 'state'} cannot be used" in err, err
    assert "Traceback" not in err, err


@pytest.mark.parametrize("which", ["worker", "admin"])
async def test_a_port_in_use_exits_2_naming_it(which: str) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        if which == "worker":
            args = ["--port", str(port), "--admin-port", "-1"]
            what = "the worker endpoint, [server] port"
        else:
            args = ["--port", "0", "--admin-port", str(port)]
            what = "the admin API, [server] admin_port"
        code, err = await hetd_serve(*args)
    assert code == 2, err
    assert f"hetd: cannot listen on 127.0.0.1:{port} ({what}): " in err, err
    assert "Traceback" not in err, err
