"""Real links (``hetd.bench.links``): namespaces, veth pairs and tbf, with a real daemon and real
``hetd-worker`` processes inside the namespaces.

They need root (network namespaces, veth, tc) and the ``ip``/``tc`` commands; elsewhere they skip
with that reason. Each run's names are unique, and every test checks nothing of its run is left.
"""

from __future__ import annotations

import asyncio
import functools
import json
import os
import signal
import subprocess
import sys
import time
from asyncio.subprocess import Process
from collections.abc import Callable
from pathlib import Path

import pytest

from hetd.bench import links
from hetd.local.procs import spawn_worker, stop_processes, worker_env
from hetd.protocol.messages import Ack, Reply
from hetd.server.daemon import Daemon
from tests.conftest import WORKER_TOKEN, make_config

WHY = links.unavailable()
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(WHY is not None, reason=f"{WHY} (run the suite as root to test real links)"),
]

RATE = 10e6  # bytes/s
MLP = {"hidden": [512, 512]}  # ~0.3 M parameters: a 1.2 MB push, 0.12 s at 10 MB/s
HEARTBEAT_S = 0.2
TIMEOUT_S = 1.5
CUT_S = 3.0  # > the timeout: the daemon must evict the worker before the link comes back


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


# A holder's exit removes six links and two namespaces with `ip`: a second on a quiet machine,
# tens of seconds on a loaded one.
EXIT_S = 120


def _reap(proc: subprocess.Popen[str]) -> None:
    """Kill ``proc`` if it is still running (a failed wait), so that no test after leaks it."""
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def _hold_links() -> tuple[subprocess.Popen[str], str]:
    """A process holding a run's links; returns it and the run's name once they exist."""
    proc = subprocess.Popen(
        [sys.executable, "-c", _HOLDER],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,  # Ctrl-C's traceback
        text=True,
    )
    assert proc.stdout is not None
    name = proc.stdout.readline().strip()
    proc.stdout.close()  # it prints nothing more
    assert links.NAME_RE.fullmatch(name), name
    assert links.leftovers(name)
    return proc, name


def test_sigterm_and_ctrl_c_clean_up_and_a_sigkilled_run_is_swept_by_the_next() -> None:
    # SIGTERM and Ctrl-C: the run removes its own links on the way out.
    # (Python exits from an uncaught Ctrl-C by re-raising SIGINT: status -SIGINT.)
    for sig, code in ((signal.SIGTERM, 128 + signal.SIGTERM), (signal.SIGINT, -signal.SIGINT)):
        proc, name = _hold_links()
        try:
            proc.send_signal(sig)
            assert proc.wait(EXIT_S) == code
        finally:
            _reap(proc)
        assert links.leftovers(name) == []

    # SIGKILL: nothing runs; the record stays and the next run removes exactly that run's objects.
    proc, name = _hold_links()
    live, live_name = _hold_links()  # another run, still alive: the sweep must leave it alone
    try:
        proc.kill()
        proc.wait(EXIT_S)
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
        try:
            live.wait(EXIT_S)
        finally:
            _reap(live)
    assert links.leftovers(live_name) == []


def test_sweep_refuses_a_broad_name() -> None:
    for bad in ("hetd", "", "hetd12345", "hetd123456x", "veth"):
        with pytest.raises(ValueError, match="not a run name"):
            links.remove_run(bad)


def _bytes_in(daemon: Daemon, wid: int) -> int:
    return daemon.engine.members.stats[wid].bytes_in


async def _wait(what: str, ok: Callable[[], bool], procs: list[Process], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not ok():
        for p in procs:
            if p.returncode is not None:
                err = await p.stderr.read() if p.stderr is not None else b""
                pytest.fail(f"a worker exited while waiting for {what}: {err.decode()[-1500:]}")
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout} s waiting for {what}")
        await asyncio.sleep(0.05)


async def test_shaped_link_measured_and_a_cut_is_seen_by_heartbeats_only() -> None:
    """Two BSP workers, each in its namespace: w0 behind 10 MB/s, w1 on an unshaped veth.

    * w0 never pushes faster than its link, and the daemon's ``link_bps`` for it (from the worker's
      send stamp and the daemon's receipt) is the link's rate within 20 % (TCP/IP headers take ~4 %);
    * w1's link is cut (set down: no FIN, no RST): the daemon evicts it by the heartbeat timeout,
      w0 goes on alone (BSP), and once the link is back w1 rejoins under its id; every push w1
      made is answered once (no request id missing or applied twice) and no update is applied
      twice (``updates_applied == version``).
    """
    with links.open_links([RATE, float("inf")]) as run:
        server = {"host": run.head, "heartbeat_s": HEARTBEAT_S, "heartbeat_timeout_s": TIMEOUT_S}
        daemon = Daemon(make_config("bsp", None, server, model_kwargs=MLP))
        port = await daemon.start()  # the engine exists from here; no worker has started yet
        engine = daemon.engine
        acks: list[tuple[int, int, str]] = []
        send = engine.members.send

        def spy(wid: int, reply: Reply) -> None:
            if isinstance(reply, Ack):  # every answer the engine gives a push, in order
                acks.append((wid, reply.id, reply.status))
            send(wid, reply)

        engine.members.send = spy  # type: ignore[method-assign]
        procs = [
            await spawn_worker(
                f"ws://{run.head}:{port}",
                "--name",
                f"w{i}",
                env=worker_env(WORKER_TOKEN),
                stderr=asyncio.subprocess.PIPE,
                wrap=functools.partial(run.command, i),
            )
            for i in range(2)
        ]
        try:

            def wid(name: str) -> int:
                return next(w for w, f in engine.members.facts.items() if f.name == name)

            def rounds(n: int) -> Callable[[], bool]:
                return lambda: (
                    len(engine.members.facts) == 2
                    and min(f.clock for f in engine.members.facts.values()) >= n
                )

            await _wait("2 workers, 2 rounds", rounds(2), procs, 120)
            w0, w1 = wid("w0"), wid("w1")
            t0, b0, clock0 = time.monotonic(), _bytes_in(daemon, w0), engine.members.facts[w0].clock
            await _wait("4 more rounds", rounds(clock0 + 4), procs, 60)
            took, moved = time.monotonic() - t0, _bytes_in(daemon, w0) - b0
            facts = engine.members.facts[w0]
            assert facts.push_bytes is not None and facts.push_bytes > 1e6
            # Four pushes arrived in the window; at most the first was on the wire before it.
            assert moved <= RATE * took + facts.push_bytes, (moved, took)
            assert facts.link_bps is not None and 0.8 * RATE <= facts.link_bps <= 1.2 * RATE, (
                facts.link_bps
            )

            since = len(engine.members.departures)
            run.down(1)
            cut_at = time.monotonic()
            await _wait("w1 evicted", lambda: w1 not in engine.members.facts, procs, TIMEOUT_S + 10)
            reasons = [r for _, w, r in list(engine.members.departures)[since:] if w == w1]
            assert len(reasons) == 1 and "heartbeat" in reasons[0], reasons  # heartbeats alone
            version = engine.store.version
            await _wait(
                "BSP goes on with w0", lambda: engine.store.version >= version + 2, procs, 30
            )
            await asyncio.sleep(max(0.0, CUT_S - (time.monotonic() - cut_at)))
            assert w1 not in engine.members.facts  # nothing gets through a cut link
            run.up(1)
            await _wait("w1 back under its id", lambda: w1 in engine.members.facts, procs, 60)
            assert engine.members.facts[w1].name == "w1"
            version = engine.store.version
            await _wait(
                "3 rounds with both", lambda: engine.store.version >= version + 3, procs, 60
            )
            assert sorted(engine.members.facts) == sorted([w0, w1])
            assert engine.applier.updates_applied == engine.store.version
            answered = sorted(i for w, i, st in acks if w == w1 and st != "duplicate")
            assert answered == list(range(answered[0], answered[-1] + 1)), answered
        finally:
            await stop_processes(procs)
            await daemon.stop()
    assert links.leftovers(run.name) == []


TINY = """
name = "tiny-links"
dataset = "digits"
model = "mlp"
model_kwargs = { hidden = [32] }
global_batch = 64
base_batch = 32
base_step_s = 0.01
target_accuracy = 0.8
budget_s = 3.0
eval_interval_s = 0.25
lr = 0.2

[[workers]]
slowdown = 1.0
bandwidth = 5e6
latency_s = 0.001
"""


def test_bench_real_mode_with_netns_links(tmp_path: Path) -> None:
    """``hetd bench --mode real --links netns``: the workers train through their links and
    ``results.json`` says which links the run had; nothing is left afterwards."""
    from hetd.cli.bench import main

    (tmp_path / "tiny.toml").write_text(TINY)
    out = tmp_path / "out"
    args = [
        "bench",
        "--mode",
        "real",
        "--links",
        "netns",
        "--scenario",
        str(tmp_path / "tiny.toml"),
    ]
    assert main([*args, "--out", str(out), "--policies", "asp", "--seeds", "1", "--quiet"]) == 0
    (run,) = json.loads((out / "results.json").read_text())["runs"]
    links_ = run["links"]
    assert links_["kind"] == "netns" and links_["rates"] == [5e6], links_
    assert links_["head"].startswith("198.51.100.")
    assert run["bytes_up"] > 0 and run["final_accuracy"] > run["curve"][0][1]
    assert links.orphans() == []


def test_no_run_is_left_behind() -> None:
    """After the sweep, every namespace or link named like a run belongs to a running run, and no
    run of this process (every test above) is still recorded: each removed its own."""
    links.sweep()
    assert links.orphans() == []
    records = sorted(links.REGISTRY.glob("hetd*.json")) if links.REGISTRY.is_dir() else []
    mine = [r.name for r in records if json.loads(r.read_text()).get("pid") == os.getpid()]
    assert mine == []
