"""The engine's Forecast command: a policy that reads forecasts gets it as an event and its decisions
are carried out; any other policy never hears of it, one swapped in meanwhile included."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from hetd.core import commands as cmd
from hetd.core.planner import PlannerConfig, parse_candidates, plan, snapshot
from policies import ClusterView, Policy, make_policy
from policies.types import Event, Forecast, Prediction, SetPlan
from tests.unit.test_engine import Harness


def recording(reads: bool) -> Policy:
    """ASP that keeps every event it hears of in its state, and on a forecast gives each worker
    a batch of as many samples as the best prediction's staleness + 2."""
    asp = make_policy("asp")

    def init(view: ClusterView) -> Any:
        return (asp.init(view), ())

    def update(event: Event, state: Any, view: ClusterView) -> tuple[Sequence[Any], Any]:
        inner, seen = state
        if isinstance(event, Forecast):
            best = max(event.predictions, key=lambda p: p.goodput)
            batch = int(best.staleness) + 2
            return [SetPlan(w, {"batch_size": batch}) for w in view.workers], (
                inner,
                (*seen, event),
            )
        out, inner = asp.update(event, inner, view)
        return out, (inner, (*seen, event))

    return Policy("recording", init, update, {}, reads_forecasts=reads)


FORECAST = Forecast(
    now=100.0,
    horizon_s=10.0,
    predictions=(
        Prediction("bsp", (), 100.0, 1.0, 0.0),
        Prediction("asp", (), 300.0, 0.9, 5.0),
    ),
    cost_s=0.1,
)


def forecasts(h: Harness) -> list[Forecast]:
    return [e for e in h.engine.host.state[1] if isinstance(e, Forecast)]


def test_a_policy_that_reads_forecasts_gets_one_and_its_decisions_are_carried_out() -> None:
    h = Harness.of(recording(reads=True))
    h.run("join a")
    h.peers["a"].got.clear()
    h.engine.handle(cmd.Forecast(FORECAST))
    assert forecasts(h) == [FORECAST]
    assert h.peers["a"].got == ["plan batch 7"]  # asp's staleness 5 + 2
    assert h.engine.members.plans[h.ids["a"]].batch_size == 7


def test_any_other_policy_never_hears_of_a_forecast() -> None:
    h = Harness.of(recording(reads=False))
    h.run("join a")
    before = h.engine.host.state
    h.engine.handle(cmd.Forecast(FORECAST))
    assert h.engine.host.state is before
    assert forecasts(h) == []


def test_a_forecast_made_for_a_policy_swapped_out_meanwhile_is_dropped() -> None:
    h = Harness.of(recording(reads=True))
    h.run("join a")
    h.engine.swap_policy("asp")
    state = h.engine.host.state
    h.engine.handle(cmd.Forecast(FORECAST))  # asp's update would not know what to do with it
    assert h.engine.host.state is state and h.engine.host.policy.name == "asp"


def test_the_planner_on_the_engine_view_reaches_the_policy() -> None:
    h = Harness.of(recording(reads=True))
    for name in ("a", "b"):
        h.run(f"join {name}")
    h.run("push a")
    h.run("push b")  # both timed by a push
    view = snapshot(h.engine.view())
    out = plan(view, parse_candidates("bsp,asp"), PlannerConfig(horizon_s=1.0), lambda: 0.0)
    assert [p.name for p in out.forecast.predictions] == ["bsp", "asp"]
    h.engine.handle(cmd.Forecast(out.forecast))
    assert forecasts(h) == [out.forecast]
