"""The chaos suite with a head of headers (``--pservers 2 --pserver-heads headers``: the daemon
takes each push's header only and holds no parameters): a 15 s run with two local pservers, one
killed and the daemon killed, that loses and doubles nothing and ends with the slices at the head's
last checkpoint. A file of its own, so that the test processes run it beside the whole-push run of
``test_chaos_pservers.py``."""

from __future__ import annotations

from pathlib import Path

import pytest

from hetd.bench.chaos import ChaosOptions, run_chaos
from hetd.sim.results import PolicySpec


@pytest.mark.timeout(1200)
def test_chaos_with_a_head_of_headers_is_exactly_once(tmp_path: Path) -> None:
    """15 s with 2 workers and 2 local pservers behind a head that holds no parameters: a pserver
    killed at 5 s and the daemon at 10 s (it restarts from a checkpoint without parameters, its
    pservers loading their slices saved there). Nothing is applied twice or lost, every pull's
    slices verify, the killed pserver is restarted, and in each run the slices saved at the last
    checkpoint stand at its log position and version, join into the model, are finite and consumed
    the same pushes. Timings are printed by the bench, not asserted (a loaded machine)."""
    opts = ChaosOptions(
        policies=(PolicySpec("asp"),), out=tmp_path, workers=2, minutes=15 / 60, fault_every=5.0,
        seed=0, quiet=True, pservers=2, headers=True,
    )  # fmt: skip
    doc = run_chaos(opts)
    assert doc["options"]["pserver_heads"] == "headers"
    (p,) = doc["policies"]
    assert p["duplicate_or_partial_applies"] == 0 and p["hash_mismatches"] == 0
    assert p["parts_dropped"] == 0  # no push waited past the part timeout and was dropped
    assert p["pserver_heads"] == "headers"
    assert p["slices_match_head"] is True, p["slices_why"]
    checks = [p["chaos"]["slices"], *p["baseline"]["slices"]]
    for got in checks:  # each run's own check was the one for a head without parameters
        assert got["slice_positions"] == [got["head_position"]] * 2
        assert got["slice_versions"] == [got["head_version"]] * 2 and got["head_version"] > 0
    assert p["daemon_restarted"] is True and p["workers_back"] is True
    kills = [f for f in p["chaos"]["faults"] if f["kind"] == "kill_pserver"]
    assert [f["at_s"] for f in kills] == [5.0]
    assert p["pserver_kills"] >= 1 and p["pservers_restarted"] is True
    assert p["chaos"]["versions_gained"] > 0
    assert p["verdict"] == "pass" or p["failures"] == [
        f"{p['versions_lost']} versions lost, more than {p['lost_bound']}"
    ]
    assert "taking each push's header only" in (tmp_path / "chaos.md").read_text()
