"""Forecasts in a real daemon: ``auto`` on loopback with two real worker processes and a planning
round every 2 s. Forecasts reach the policy (its state and ``hetd status`` show the last one and
what auto made of it) and nothing is lost under whichever policies it ran: every push counted was
answered once (applied, buffered or dropped), and the store moved once per applied update."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from hetd import config as config_mod
from hetd.cli.admin_text import status_text
from tests.conftest import ADMIN_TOKEN, Cluster, make_config

pytestmark = pytest.mark.slow

PARAMS = {"start": "bsp", "candidates": "bsp,asp,lbbsp", "dwell_s": 2.0, "margin": 0.0}


@contextlib.asynccontextmanager
async def auto_cluster(plan_every_s: float) -> AsyncIterator[Cluster]:
    from hetd.local.procs import stop_processes
    from hetd.server.daemon import Daemon

    cfg = make_config("auto", PARAMS)
    cfg = config_mod.replace(cfg, "policy", plan_every_s=plan_every_s)
    daemon = Daemon(cfg)
    port = await daemon.start()
    c = Cluster(daemon, f"ws://127.0.0.1:{port}")
    try:
        yield c
    finally:
        await stop_processes(c.procs)
        await daemon.stop()


def ledger(c: Cluster) -> dict[str, Any]:
    """What was answered, read on the engine task (between two events)."""
    e = c.engine
    return {
        "updates_applied": e.applier.updates_applied,
        "version": e.store.version,
        "workers": {
            wid: (s.pushes, s.applied + s.buffered + s.dropped)
            for wid, s in e.members.stats.items()
        },
        "state": e.host.state,
    }


async def test_auto_in_a_real_daemon_gets_forecasts_and_loses_nothing() -> None:
    async with auto_cluster(plan_every_s=2.0) as c:
        for slowdown in (1, 3):
            await c.spawn(slowdown)
        await c.wait_for(lambda: len(c.engine.members.facts) == 2, 90, "2 workers to join")
        planning = c.daemon.planning
        assert planning is not None

        def planned() -> bool:
            return planning.rounds >= 2 and c.engine.host.state.last is not None

        await c.wait_for(planned, 90, "two planning rounds and auto to weigh a forecast")
        got = await c.engine.queue.call(lambda: ledger(c))
        # nothing lost: each push counted was answered once, each applied update one version
        assert got["updates_applied"] == got["version"] > 0
        for wid, (pushes, answered) in got["workers"].items():
            assert pushes == answered > 0, (wid, got["workers"])
        choice = got["state"].describe()["last_choice"]  # auto's own account, as status shows it
        assert {s["policy"] for s in choice["candidates"]} == {"bsp", "asp", "lbbsp"}
        assert planning.rounds >= 2 and planning.failed == 0
        # what an operator sees
        async with (
            aiohttp.ClientSession() as http,
            http.get(
                c.admin_url + "/v1/status", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}
            ) as resp,
        ):
            body = await resp.json()
        text = status_text(body)
        rows = dict(line.split("  ", 1) for line in text.splitlines() if "  " in line)
        assert "3 candidate(s)" in rows["forecast"], text
        assert rows["choice"].strip(), text
        assert body["planning"]["last"]["predictions"][0]["goodput"] > 0


async def test_under_adam_the_warm_up_ends_with_the_daemons_optimizer_restarted(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A real daemon training with Adam: auto warms up on ashl (the adaptive default) and, with no
    forecast in ``warmup_s`` (planning off), goes to its start policy; that switch restarts the
    daemon's optimizer, and nothing is lost across it."""
    from hetd.local.procs import stop_processes
    from hetd.server.daemon import Daemon

    params = {"start": "lbbsp", "candidates": "lbbsp,ashl", "warmup_s": 1.0}
    cfg = make_config("auto", params, optimizer="adam", lr=0.001)
    cfg = config_mod.replace(cfg, "policy", plan_every_s=0.0)
    caplog.set_level("INFO", logger="hetd.core.engine")
    daemon = Daemon(cfg)
    port = await daemon.start()
    c = Cluster(daemon, f"ws://127.0.0.1:{port}")
    try:
        for slowdown in (1, 2):
            await c.spawn(slowdown)
        await c.wait_for(lambda: len(c.engine.members.facts) == 2, 90, "2 workers to join")

        def switched() -> bool:
            return bool(c.engine.host.state.switches) and c.engine.store.version > 20

        await c.wait_for(switched, 90, "the warm-up to end and training to go on")
        got = await c.engine.queue.call(lambda: ledger(c))
    finally:
        await stop_processes(c.procs)
        await daemon.stop()
    state = got["state"]
    assert [s[1:3] for s in state.switches] == [("ashl", "lbbsp")]
    assert "no forecast in 1 s" in state.switches[0][3]
    assert any("optimizer restarted (policy auto)" in r.getMessage() for r in caplog.records)
    assert got["updates_applied"] == got["version"] > 0
    for wid, (pushes, answered) in got["workers"].items():
        assert pushes == answered > 0, (wid, got["workers"])
