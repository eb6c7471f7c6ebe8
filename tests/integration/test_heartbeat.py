"""A worker that stops answering is evicted after the heartbeat timeout, stops holding back BSP,
and rejoins as the same worker once it runs again.

Real daemon on loopback, real ``hetd-worker`` processes. The silent worker is frozen with SIGSTOP:
its TCP connection stays open but it sends nothing (no heartbeats, no pushes), so only the
daemon's heartbeat timeout (``Engine.tick``) can notice it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time

import pytest

from hetd import config as config_mod
from hetd.local.procs import stop_processes
from hetd.server.daemon import Daemon
from tests.conftest import Cluster, make_config, no_compile_cache

pytestmark = pytest.mark.slow

HEARTBEAT_S = 0.2
TIMEOUT_S = 1.5


def wid_named(c: Cluster, name: str) -> int:
    """The engine's id for the active worker called ``name``."""
    return next(wid for wid, f in c.engine.members.facts.items() if f.name == name)


def departures_of(c: Cluster, wid: int, since: int = 0) -> list[str]:
    """The reasons recorded for each departure of worker ``wid`` after the first ``since``
    departures of all workers, oldest first."""
    return [reason for _, w, reason in list(c.engine.members.departures)[since:] if w == wid]


def in_lockstep_from(c: Cluster, rounds: int) -> bool:
    """Both workers are in and the slower one has pushed ``rounds`` times."""
    clocks = [f.clock for f in c.engine.members.facts.values()]
    return len(clocks) == 2 and min(clocks) >= rounds


def heartbeat_config(policy: str, heartbeat_s: float, timeout_s: float) -> config_mod.Config:
    """Digits with a short heartbeat. Built here, not with ``cluster(server=...)``:
    ``make_config`` passes its own ``heartbeat_s`` / ``heartbeat_timeout_s`` next to
    ``**server``, so overriding them there raises TypeError (multiple values for a keyword)."""
    return config_mod.replace(
        make_config(policy), "server", heartbeat_s=heartbeat_s, heartbeat_timeout_s=timeout_s
    )


async def test_silent_worker_is_evicted_and_rejoins() -> None:
    daemon = Daemon(heartbeat_config("bsp", HEARTBEAT_S, TIMEOUT_S))
    port = await daemon.start()
    c = Cluster(daemon, f"ws://127.0.0.1:{port}")
    try:
        await c.spawn(1)
        frozen = await c.spawn(1)
        frozen_name = "w1-x1"  # Cluster.spawn names workers w<index>-x<slowdown>
        # Start-up may already cost each worker one heartbeat eviction (and a rejoin): it sends
        # no heartbeat while it builds its trainer from the welcome (see the test below). Only
        # departures after the freeze count.
        await c.wait_for(lambda: in_lockstep_from(c, 5), 60, "2 workers and 5 BSP rounds")
        wid = wid_named(c, frozen_name)
        healthy = wid_named(c, "w0-x1")
        since = len(c.engine.members.departures)

        os.kill(frozen.pid, signal.SIGSTOP)
        frozen_at = time.monotonic()
        versions: list[int] = []  # the store's version while the frozen worker still counts

        def evicted() -> bool:
            if wid in c.engine.members.facts:
                versions.append(c.engine.store.version)
                return False
            return True

        await c.wait_for(evicted, TIMEOUT_S + 5, "the frozen worker to be evicted")
        took = time.monotonic() - frozen_at
        # Evicted by the timeout, not sooner (its last sign of life was at most one heartbeat
        # before the freeze) and not much later (ticks every 0.25 s).
        assert TIMEOUT_S - HEARTBEAT_S - 0.1 <= took <= TIMEOUT_S + 3, took
        reasons = departures_of(c, wid, since)
        assert len(reasons) == 1, reasons
        assert "heartbeat" in reasons[0] and "timeout" in reasons[0], reasons
        assert healthy in c.engine.members.facts and not departures_of(c, healthy, since)
        assert list(c.engine.members.facts) == [healthy]
        # While it was in, the frozen worker held the barrier: at most the round in flight closed.
        assert versions and max(versions) - min(versions) <= 1, versions

        # Without it BSP moves on with the remaining worker alone.
        version = c.engine.store.version
        clock = c.engine.members.facts[healthy].clock
        await c.wait_for(
            lambda: c.engine.store.version >= version + 10, 10, "10 versions without it"
        )
        assert c.engine.members.facts[healthy].clock >= clock + 10
        assert wid not in c.engine.members.facts

        # Thawed, it finds its connection closed, reconnects with backoff and resumes its id.
        os.kill(frozen.pid, signal.SIGCONT)
        await c.wait_for(lambda: wid in c.engine.members.facts, 15, "the thawed worker to rejoin")
        assert c.engine.members.facts[wid].name == frozen_name
        assert frozen.returncode is None, "the thawed worker exited instead of reconnecting"
        await c.wait_for(
            lambda: c.engine.members.stats[wid].pushes >= 5,  # the stats rejoining started afresh
            15,
            "5 pushes from the rejoined worker",
        )
        # Back in lockstep with both, and nobody was evicted again.
        assert sorted(c.engine.members.facts) == sorted([wid, healthy])
        assert departures_of(c, wid, since) == reasons
        assert not departures_of(c, healthy, since)
        clocks = [f.clock for f in c.engine.members.facts.values()]
        assert max(clocks) - min(clocks) <= 1, clocks
    finally:
        # Never leave a stopped process behind: a stopped worker cannot act on SIGTERM.
        for proc in c.procs:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGCONT)
        await stop_processes(c.procs)
        await daemon.stop()


async def test_a_worker_building_its_trainer_is_not_evicted() -> None:
    """Heartbeats start with the welcome, before the worker loads data and compiles: the daemon
    hears from it all through its build, not first with its first push.

    What is asserted does not depend on the host's load. The build takes ~1 s on a quiet machine
    and 10-20 s at load 25, where the daemon still heard from the worker every 0.85 s at worst. A
    0.5 s timeout, as this test once had, then evicted it: a timing, not the product. Hence the
    count of signs of life during the build, with a timeout that load cannot reach."""
    daemon = Daemon(heartbeat_config("asp", 0.1, 5.0))
    port = await daemon.start()
    c = Cluster(daemon, f"ws://127.0.0.1:{port}")
    heard: dict[int, set[float]] = {}  # per worker: the daemon's last_seen values before it pushed

    def pushed() -> bool:
        for wid, st in list(c.engine.members.stats.items()):
            if st.pushes == 0:
                heard.setdefault(wid, set()).add(st.last_seen)
        return any(st.pushes >= 3 for st in c.engine.members.stats.values()) and bool(
            c.engine.members.facts
        )

    try:
        with no_compile_cache():  # it compiles its step itself, not from the session's cache
            await c.spawn(1)
        await c.wait_for(pushed, 60, "3 pushes")
        assert not c.engine.members.departures, list(c.engine.members.departures)
        # Joining is one sign of life; without heartbeats during the build, a pull is at most the
        # only other before the first push (~10 heartbeats in a quiet machine's build).
        assert (
            list(heard) == list(c.engine.members.facts) and len(next(iter(heard.values()))) >= 4
        ), heard
    finally:
        await stop_processes(c.procs)
        await daemon.stop()


async def test_a_worker_stopped_before_it_trains_still_says_bye() -> None:
    """SIGTERM while the worker builds its trainer (it joined, it has not pushed): it has no step
    to finish, so it is cancelled at once, and still says bye on its open session. Before, it
    closed without one and the daemon logged "connection closed", as for a crash."""
    daemon = Daemon(heartbeat_config("asp", 0.2, 30.0))
    port = await daemon.start()
    c = Cluster(daemon, f"ws://127.0.0.1:{port}")
    try:
        with no_compile_cache():  # it compiles its step itself: seconds in which it has not pushed
            await c.spawn(1)
        await c.wait_for(lambda: bool(c.engine.members.facts), 60, "the join")
        wid = next(iter(c.engine.members.facts))
        early = c.engine.members.stats[wid].pushes == 0
        c.procs[0].send_signal(signal.SIGTERM)
        await c.wait_for(lambda: bool(departures_of(c, wid)), 30, "the departure")
        assert departures_of(c, wid) == ["stopped (SIGTERM)"], (
            early,
            list(c.engine.members.departures),
        )
        assert await c.procs[0].wait() == 128 + signal.SIGTERM or not early
    finally:
        await stop_processes(c.procs)
        await daemon.stop()
