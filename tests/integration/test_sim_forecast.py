"""Forecasts in the simulator: a policy that reads them gets the first as soon as every worker is
timed and then one every ``plan_every_s`` of virtual time, made from the engine's view at that
time, the same in every run; any other policy's run is as before (tests/golden); under churn
nothing is lost."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import pytest

from hetd.sim.loop import SimRun, run_sim
from hetd.sim.results import PolicySpec
from policies import registry
from policies.registry import make_policy
from policies.types import ClusterView, Event, Forecast, Policy
from tests.integration.test_churn_sim import check_churn, churn_scenario


def forecast_recorder(candidates: str = "bsp,asp,lbbsp") -> Policy:
    """asp that keeps every forecast it gets."""
    asp = make_policy("asp")

    def init(view: ClusterView) -> Any:
        return (asp.init(view), ())

    def update(event: Event, state: Any, view: ClusterView) -> tuple[Sequence[Any], Any]:
        inner, seen = state
        if isinstance(event, Forecast):
            return (), (inner, (*seen, event))
        out, inner = asp.update(event, inner, view)
        return out, (inner, seen)

    return Policy("recorder", init, update, {"candidates": candidates}, reads_forecasts=True)


@pytest.fixture
def recorder(monkeypatch: pytest.MonkeyPatch) -> str:
    """The recorder registered for this test only."""
    monkeypatch.setitem(registry._REGISTRY, "recorder", forecast_recorder)
    return "recorder"


def forecasts(run: SimRun) -> tuple[Forecast, ...]:
    seen: tuple[Forecast, ...] = run.engine.host.state[1]
    return seen


@pytest.mark.slow
def test_a_policy_that_reads_forecasts_gets_one_every_interval_and_loses_nothing(
    recorder: str,
) -> None:
    sc = dataclasses.replace(churn_scenario(), plan_every_s=1.0)
    run = run_sim(sc, PolicySpec(recorder), seed=0)
    check_churn(sc, run, recorder)  # every push answered once, no stall, training went on
    got = forecasts(run)
    # the first as soon as every worker is timed (its profile at the join), then every second
    first = got[0].now
    assert 0 < first < 0.5
    assert [f.now for f in got] == pytest.approx([first + k for k in range(len(got))])
    assert first + len(got) > sc.budget_s
    for f in got:
        assert [p.name for p in f.predictions] == ["bsp", "asp", "lbbsp"]
        assert f.cost_s == 0.0  # not read: the run must not depend on the machine
        assert all(p.samples_per_s > 0 for p in f.predictions)
    # on workers of speeds 1 to 4, asp (no waiting) applies more samples per second than bsp
    by_name = {p.name: p for p in got[-1].predictions}
    assert by_name["asp"].samples_per_s > by_name["bsp"].samples_per_s
    again = run_sim(sc, PolicySpec(recorder), seed=0)
    assert forecasts(again) == got
    assert again.result.curve == run.result.curve


@pytest.mark.slow
def test_no_planning_under_a_policy_that_reads_none_or_with_no_interval(recorder: str) -> None:
    sc = dataclasses.replace(churn_scenario(), plan_every_s=1.0, budget_s=1.5, events=())
    plain = run_sim(sc, PolicySpec("asp"), seed=0)  # asp reads none: runs as it always did
    off = run_sim(dataclasses.replace(sc, plan_every_s=0.0), PolicySpec(recorder), seed=0)
    assert forecasts(off) == ()
    # the recorder is asp but for forecasts: without them its run is asp's, update for update
    assert off.result.curve == plain.result.curve and off.versions == plain.versions
