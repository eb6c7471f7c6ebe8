"""The chaos suite's smoke run: a ~20 s run with 2 workers under asp, one fault every 5 s including
the daemon's SIGKILL and restart, then its baseline. Asserts what holds on a loaded machine (no
duplicate or partial apply, the daemon restarted, every worker came back), not timings."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hetd.bench.chaos import ChaosOptions, run_chaos, schedule
from hetd.sim.results import PolicySpec

pytestmark = pytest.mark.slow


def test_schedule_is_seeded_with_one_daemon_kill() -> None:
    opts = ChaosOptions(policies=(PolicySpec("asp"),), out=Path("."), minutes=3, fault_every=30)
    a, b = schedule(opts), schedule(opts)
    assert [(f.at_s, f.kind, f.slot) for f in a] == [(f.at_s, f.kind, f.slot) for f in b]
    assert [f.kind for f in a].count("kill_daemon") == 1
    assert [f.at_s for f in a] == [30.0, 60.0, 90.0, 120.0, 150.0]


@pytest.mark.timeout(900)
def test_chaos_smoke(tmp_path: Path) -> None:
    opts = ChaosOptions(
        policies=(PolicySpec("asp"),),
        out=tmp_path,
        workers=2,
        minutes=20 / 60,
        fault_every=5.0,
        seed=0,
        quiet=True,
    )
    run_chaos(opts)
    doc = json.loads((tmp_path / "chaos.json").read_text())
    assert (tmp_path / "chaos.md").exists()
    (p,) = doc["policies"]
    assert p["duplicate_or_partial_applies"] == 0
    assert p["daemon_restarted"] is True
    assert p["workers_back"] is True
    kinds = [f["kind"] for f in p["chaos"]["faults"]]
    assert kinds.count("kill_daemon") == 1
    kill = next(f for f in p["chaos"]["faults"] if f["kind"] == "kill_daemon")
    assert kill["version_after"] <= kill["version_before"]
    assert p["chaos"]["versions_gained"] > 0 and p["baseline"]["versions_gained"] > 0
