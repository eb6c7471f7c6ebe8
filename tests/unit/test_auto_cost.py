"""auto's planning cost bench (hetd/bench/auto_cost.py): the cluster it builds, one round measured
over every default candidate, and its command line."""

from __future__ import annotations

import pytest

from hetd.bench import auto_cost
from hetd.core.planner import DEFAULT_CANDIDATES, untimed
from policies.twin_worker import exchange_s


def test_the_cluster_is_timed_and_its_round_trip_is_the_links_alone() -> None:
    view = auto_cost.cluster(7)
    assert view.n == 7 and view.global_batch == 7 * auto_cost.BATCH
    assert untimed(view) == ()  # the planner runs it at once
    assert exchange_s(view) == pytest.approx(0.0, abs=1e-9)
    slowest = max(f.compute_s or 0.0 for f in view.workers.values())
    assert slowest == pytest.approx(auto_cost.STEP_S * max(auto_cost.SLOWDOWNS))
    with pytest.raises(ValueError, match="at least one worker"):
        auto_cost.cluster(0)


def test_one_round_forecasts_every_default_candidate(capsys: pytest.CaptureFixture[str]) -> None:
    rec = auto_cost.measure(3, repeats=1)
    assert rec["candidates"] == len(DEFAULT_CANDIDATES) and rec["refused"] == []
    assert 0.0 <= rec["cost_min_s"] <= rec["cost_s"] <= rec["cost_max_s"]
    text = auto_cost.line(rec, 30.0)
    assert text.startswith("auto planning, 3 workers, 8 candidates") and "% of one core" in text
    assert auto_cost.main(["--workers", "2", "--repeats", "1"]) == 0
    assert "auto planning, 2 workers" in capsys.readouterr().out
    for bad in (["--workers", "x"], ["--every", "0"], ["--repeats", "0"]):
        with pytest.raises(SystemExit):
            auto_cost.main(bad)
