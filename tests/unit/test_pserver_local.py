"""The local process backend for pservers (``[pservers] backend = "local"``): the daemon spawns its
pserver processes, restarts one that is killed (it reconnects, catches up and saves the next
checkpoint with the other), reports one that keeps failing instead of restarting it in a loop,
and stops them when it stops (SIGTERM, then SIGKILL past the timeout)."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path

import pytest

from hetd import config as config_mod
from hetd.pserver import disk
from hetd.server.pserver_sup import LocalPservers, RestartPolicy, Slot
from tests.conftest import make_config, until

WAIT = 240.0  # s: generous, each process imports JAX on a shared 2-core machine


def test_the_backend_key_is_checked() -> None:
    base = make_config("asp")
    with pytest.raises(
        config_mod.ConfigError, match=r"backend = 'k8s'.*one of 'none', 'local', 'ray'"
    ):
        config_mod.replace(base, "pservers", log=True, servers=2, backend="k8s")
    with pytest.raises(config_mod.ConfigError, match="needs servers >= 1"):
        config_mod.replace(base, "pservers", backend="local")
    cfg = config_mod.replace(base, "pservers", log=True, servers=2, backend="local")
    assert cfg.pservers.backend == "local"
    assert config_mod.replace(cfg, "pservers", backend="ray").pservers.backend == "ray"
    assert config_mod.Config().pservers.backend == "none"  # today's: the operator starts them


@pytest.mark.slow
async def test_the_daemon_restarts_a_killed_pserver_which_saves_the_next_checkpoint(
    tmp_path: Path,
) -> None:
    from hetd.server.daemon import Daemon

    cfg = make_config("asp", optimizer="adam", lr=0.01)
    cfg = config_mod.replace(cfg, "server", admin_port=-1, stop_timeout_s=60.0)
    cfg = config_mod.replace(cfg, "store", dir=str(tmp_path / "state"), interval_s=0.0)
    cfg = config_mod.replace(cfg, "pservers", log=True, servers=2, port=0, backend="local")
    daemon = Daemon(cfg)
    await daemon.start()
    stopped = False
    try:
        link = daemon.pservers
        procs = daemon.pserver_procs
        assert link is not None and procs is not None
        dirs = [tmp_path / "state" / "pservers" / f"slice{s}" for s in range(2)]
        assert [slot.directory for slot in procs.slots] == dirs
        await until(lambda: sorted(link.connected) == [0, 1], "both pservers connected")
        first = await daemon.checkpoint()
        p1 = daemon.engine.store.decisions.position  # type: ignore[union-attr]
        await until(lambda: link.durable == [p1, p1], "both saved the first checkpoint")

        before = daemon.describe()["decisions"]["processes"]
        assert [p["restarts"] for p in before] == [0, 0]
        assert all(p["state"] == "running" and p["pid"] for p in before)
        old = before[1]["pid"]
        os.kill(old, signal.SIGKILL)
        slot = procs.slots[1]
        await until(lambda: slot.restarts == 1 and slot.state == "running", "restarted")
        new = daemon.describe()["decisions"]["processes"][1]
        assert new["pid"] not in (None, old) and new["last_exit"] == -signal.SIGKILL
        await until(lambda: 1 in link.connected, "the restarted pserver reconnected")

        second = await daemon.checkpoint()
        p2 = daemon.engine.store.decisions.position  # type: ignore[union-attr]
        assert p2 > p1 and second.seq > first.seq
        await until(lambda: link.durable == [p2, p2], "both saved the second checkpoint")
        for d in dirs:  # each slice saved at both checkpoints, the restarted one too
            assert {disk.load(path).slice.position for path in disk.listing(d)} >= {p1, p2}
        status = daemon.describe()["decisions"]
        assert [p["restarts"] for p in status["processes"]] == [0, 1]
        assert status["saved"] == [p2, p2] and status["connected"] == [0, 1]
        assert procs.slots[0].proc is not None and procs.slots[0].proc.pid == before[0]["pid"]

        running = [s.proc for s in procs.slots]
        await daemon.stop()  # the final checkpoint: both save it, then stop on SIGTERM
        stopped = True
        end = max(max(disk.load(p).slice.position for p in disk.listing(d)) for d in dirs)
        assert end > p2
        assert all(max(disk.load(p).slice.position for p in disk.listing(d)) == end for d in dirs)
        assert all(p is not None and p.returncode == 0 for p in running)  # stopped, not killed
        assert daemon.pserver_procs is None
    finally:
        if not stopped:
            await daemon.stop(final_checkpoint=False)


class _Scripted(LocalPservers):
    """The supervisor, running a small Python script in place of ``hetd pserver``."""

    def __init__(self, root: Path, script: str, policy: RestartPolicy) -> None:
        super().__init__(("127.0.0.1", 1), root, 2, policy)
        self.script = script

    def command(self, slot: Slot) -> list[str]:
        return [sys.executable, "-c", self.script, str(slot.directory)]


async def test_a_pserver_that_keeps_failing_is_reported_not_restarted(tmp_path: Path) -> None:
    quick = RestartPolicy(backoff_s=0.01, max_backoff_s=0.05, stable_s=60.0, max_fails=3)
    sup = _Scripted(tmp_path, "import sys; sys.exit(1)", quick)
    await sup.start()
    try:
        await until(lambda: all(s.state == "failed" for s in sup.slots), "both given up", 60)
        for slot in sup.describe():
            assert slot["restarts"] == 2 and slot["last_exit"] == 1 and slot["pid"] is None
        assert all("3 times in a row" in s.reason for s in sup.slots)
    finally:
        await sup.stop(5.0)

    broken = _Scripted(tmp_path / "b", "import sys; sys.exit(3)", quick)
    await broken.start()
    try:  # status 3: the slice cannot go on, and starting it again would not change that
        await until(lambda: all(s.state == "failed" for s in broken.slots), "given up", 60)
        assert [s["restarts"] for s in broken.describe()] == [0, 0]
        assert all("status 3" in s.reason for s in broken.slots)
    finally:
        await broken.stop(5.0)


async def test_stop_kills_a_pserver_that_ignores_sigterm(tmp_path: Path) -> None:
    script = (
        "import signal, sys, time, pathlib\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "pathlib.Path(sys.argv[1], 'ready').touch()\n"
        "time.sleep(120)\n"
    )
    sup = _Scripted(tmp_path, script, RestartPolicy())
    await sup.start()
    await until(
        lambda: all((s.directory / "ready").exists() for s in sup.slots), "scripts ready", 60
    )
    procs = [s.proc for s in sup.slots]
    await sup.stop(0.5)
    assert all(p is not None and p.returncode == -signal.SIGKILL for p in procs)
    assert [s["state"] for s in sup.describe()] == ["stopped", "stopped"]
    assert all(s.restarts == 0 for s in sup.slots)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state not in ("Z", "X")  # a zombie nobody reaped yet has ended


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal")
async def test_a_pserver_given_its_parent_stops_when_the_parent_is_killed(tmp_path: Path) -> None:
    """``hetd pserver --parent PID`` (what the local backend starts): its daemon SIGKILLed, it
    stops rather than follow the next daemon on the same directory."""
    directory = tmp_path / "slice0"
    parent = (  # stands for the daemon: starts the pserver, says its pid, waits to be killed
        "import os, subprocess, sys, time\n"
        "child = subprocess.Popen([sys.executable, '-m', 'hetd', 'pserver', '--head',\n"
        "    '127.0.0.1:1', '--slice', '0', '--dir', sys.argv[1], '--parent', str(os.getpid())],\n"
        "    stdout=subprocess.DEVNULL)\n"
        "print(child.pid, flush=True)\n"
        "time.sleep(600)\n"
    )
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", parent, str(directory), stdout=asyncio.subprocess.PIPE
    )
    assert proc.stdout is not None
    child = int(await asyncio.wait_for(proc.stdout.readline(), WAIT))
    try:
        await until(lambda: (directory / "port").exists(), "the pserver listens")
        assert _alive(child)  # (its head is nowhere: it keeps trying to connect)
        proc.kill()
        await proc.wait()
        await until(lambda: not _alive(child), "the pserver stopped with its parent", 60)
    finally:
        if _alive(child):
            os.kill(child, signal.SIGKILL)


def test_hetd_serve_pservers_and_headers_flags_set_the_pservers_table() -> None:
    """``hetd serve --pservers S [--headers]``: S = 1 is the daemon alone; S >= 2 keeps the log and
    starts S local pservers (or the config's backend); --headers makes the head one of headers; a
    bad S is refused; with no state directory the config check says what is missing."""
    import argparse

    from hetd import config as config_mod
    from hetd.cli.main import parser
    from hetd.cli.serve import pservers_from_args

    base = config_mod.Config()
    cfg = pservers_from_args(base, 2, None)
    assert (cfg.pservers.log, cfg.pservers.servers, cfg.pservers.backend) == (True, 2, "local")
    assert cfg.pservers.headers is False
    ray = config_mod.replace(base, "pservers", backend="ray", log=True, servers=3)
    assert pservers_from_args(ray, 4, True).pservers.backend == "ray"
    assert pservers_from_args(ray, 4, True).pservers.headers is True
    assert pservers_from_args(ray, 1, None).pservers.servers == 0  # the daemon alone
    assert pservers_from_args(base, None, None) == base
    with pytest.raises(config_mod.ConfigError, match="--pservers must be >= 1"):
        pservers_from_args(base, 0, None)
    with pytest.raises(config_mod.ConfigError, match=r"needs \[store\] dir"):
        config_mod.check_serving(pservers_from_args(base, 2, True))
    args = parser().parse_args(["serve", "--pservers", "2", "--headers"])
    assert isinstance(args, argparse.Namespace) and (args.pservers, args.headers) == (2, True)


async def test_a_daemon_whose_engine_disagrees_with_its_headers_setting_refuses_to_start(
    tmp_path: Path,
) -> None:
    """``[pservers] headers`` and the engine's store must agree (build_engine makes them so; an
    engine built elsewhere may not): a daemon that would silently run the other mode stops at
    start-up, saying what to change."""
    import dataclasses

    from hetd import config as config_mod
    from hetd.bench.system import make_daemon, synthetic_shapes
    from hetd.server.daemon import StartupError

    daemon = make_daemon(synthetic_shapes(10_000), "int8", 2, "none", str(tmp_path), False)
    daemon.cfg = dataclasses.replace(
        daemon.cfg, pservers=dataclasses.replace(daemon.cfg.pservers, headers=True)
    )
    assert isinstance(daemon.cfg, config_mod.Config)
    with pytest.raises(StartupError, match="headers = true, but the engine's store holds"):
        await daemon.start()
    await daemon.stop(final_checkpoint=False)
