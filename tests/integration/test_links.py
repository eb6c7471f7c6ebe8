"""Real links (``hetd.bench.links``): namespaces, veth pairs and tbf, with a real daemon and real
``hetd-worker`` processes inside the namespaces.

They need root (network namespaces, veth, tc) and the ``ip``/``tc`` commands; elsewhere they skip
with that reason. Each run's names are unique, and every test checks nothing of its run is left.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from hetd.bench import links
from hetd.local.demo import stop_processes, worker_env
from hetd.server.daemon import Daemon
from tests.conftest import WORKER_TOKEN, make_config

WHY = links.unavailable()
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(WHY is not None, reason=f"{WHY} (run the suite as root to test real links)"),
]

RATE = 10e6  # bytes/s
BIG_MLP = {"hidden": [1024, 1024]}  # ~1.1 M parameters: a 4.4 MB push, 0.44 s at 10 MB/s


def test_links_are_made_and_removed() -> None:
    with links.open_links([RATE, float("inf")]) as run:
        name = run.name
        assert links.NAME_RE.fullmatch(name)
        for link in run.links:
            assert link.netns.startswith(name) and link.head_if.startswith(name)
            for ip in (link.head_ip, link.worker_ip, run.head):
                assert ip.startswith("198.51.100."), ip
        head_q, worker_q = run.qdiscs(0)
        assert "tbf" in head_q and "80Mbit" in head_q, head_q  # 10 MB/s = 80 Mbit/s
        assert "tbf" in worker_q and "80Mbit" in worker_q, worker_q
        assert "tbf" not in run.qdiscs(1)[0]  # an infinite rate is not shaped
        assert sorted(links.leftovers(name)) == sorted(
            [f"{name}hd", f"{name}hx"]
            + [x for link in run.links for x in (link.head_if, link.netns)]
        )
    assert links.leftovers(name) == []
    assert not (links.REGISTRY / f"{name}.json").exists()


def test_an_error_inside_removes_everything() -> None:
    with pytest.raises(RuntimeError, match="boom"), links.open_links([RATE]) as run:
        name = run.name
        raise RuntimeError("boom")
    assert links.leftovers(name) == []


_HOLDER = """
import sys, time
from hetd.bench import links
with links.open_links([1e7, 1e7]) as run:
    print(run.name, flush=True)
    time.sleep(600)
"""


def _hold_links() -> tuple[subprocess.Popen[str], str]:
    """A process holding a run's links; returns it and the run's name once they exist."""
    proc = subprocess.Popen([sys.executable, "-c", _HOLDER], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    name = proc.stdout.readline().strip()
    proc.stdout.close()  # it prints nothing more
    assert links.NAME_RE.fullmatch(name), name
    assert links.leftovers(name)
    return proc, name


def test_sigkilled_run_is_swept_by_the_next_and_sigterm_cleans_up() -> None:
    # SIGTERM: the run removes its own links on the way out.
    proc, name = _hold_links()
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 128 + signal.SIGTERM
    assert links.leftovers(name) == []

    # SIGKILL: nothing runs; the record stays and the next run removes exactly that run's objects.
    proc, name = _hold_links()
    live, live_name = _hold_links()  # another run, still alive: the sweep must leave it alone
    try:
        proc.kill()
        proc.wait(30)
        assert links.leftovers(name), "SIGKILL cannot clean up"
        assert (links.REGISTRY / f"{name}.json").exists()
        with links.open_links([RATE]) as run:
            assert links.leftovers(name) == []
            assert not (links.REGISTRY / f"{name}.json").exists()
            assert len(links.leftovers(live_name)) == 6, links.leftovers(live_name)
            mine = run.name
        assert links.leftovers(mine) == []
    finally:
        live.send_signal(signal.SIGTERM)
        live.wait(30)
    assert links.leftovers(live_name) == []


def test_sweep_refuses_a_broad_name() -> None:
    for bad in ("hetd", "", "hetd12345", "hetd123456x", "veth"):
        with pytest.raises(ValueError, match="not a run name"):
            links.remove_run(bad)


def _bytes_in(daemon: Daemon) -> int:
    return sum(s.bytes_in for s in daemon.engine.stats.values())


async def test_a_worker_behind_10_mb_s_pushes_no_faster_and_the_daemon_measures_it() -> None:
    """The daemon's ``link_bps`` comes from the worker's send stamp and its receipt of the push; on
    a tbf-shaped link it is the link's rate (TCP/IP headers take ~4 %; the target is 20 %)."""
    with links.open_links([RATE]) as run:
        cfg = make_config("asp", None, {"host": run.head}, model_kwargs=BIG_MLP)
        daemon = Daemon(cfg)
        port = await daemon.start()
        argv = [sys.executable, "-m", "workers.cli", f"ws://{run.head}:{port}", "--name", "w0"]
        procs = [
            await asyncio.create_subprocess_exec(
                *run.command(0, argv),
                env=worker_env(WORKER_TOKEN),
                stdout=asyncio.subprocess.DEVNULL,
                stderr=asyncio.subprocess.PIPE,
            )
        ]
        try:
            deadline = time.monotonic() + 120
            while not any(s.pushes >= 2 for s in daemon.engine.stats.values()):
                assert procs[0].returncode is None, await procs[0].stderr.read()  # type: ignore[union-attr]
                assert time.monotonic() < deadline, "no pushes within 120 s"
                await asyncio.sleep(0.05)
            t0, b0 = time.monotonic(), _bytes_in(daemon)
            pushes0 = sum(s.pushes for s in daemon.engine.stats.values())
            while sum(s.pushes for s in daemon.engine.stats.values()) < pushes0 + 4:
                assert procs[0].returncode is None
                await asyncio.sleep(0.05)
            took, moved = time.monotonic() - t0, _bytes_in(daemon) - b0
            (facts,) = daemon.engine.facts.values()
            push = facts.push_bytes
            assert push is not None and push > 4e6
            # Four pushes arrived in the window; at most the first was partly on the wire before it.
            assert moved <= RATE * took + push, (moved, took)
            assert facts.link_bps is not None
            assert 0.8 * RATE <= facts.link_bps <= 1.2 * RATE, facts.link_bps
            print(json.dumps({"link_bps": facts.link_bps, "window_bps": moved / took}))
        finally:
            await stop_processes(procs)
            await daemon.stop()
    assert links.leftovers(run.name) == []


def test_no_run_is_left_behind() -> None:
    """Runs of this process (and killed ones) leave nothing: every record left belongs to a live
    process."""
    links.sweep()
    for rec in links.REGISTRY.glob("hetd*.json") if links.REGISTRY.is_dir() else []:
        info = json.loads(rec.read_text())
        assert links._pid_start(int(info["pid"])) == info["start"], rec
        assert int(info["pid"]) != os.getpid(), rec
