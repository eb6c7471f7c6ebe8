"""Every registered policy under churn, in the simulator: workers join while the adaptive policies
still profile and again later, one crashes (silent: the heartbeat timeout finds it) and one leaves
cleanly (its bye follows its last push). Whatever the policy and its stage:

* no update is lost: every push that reached the daemon is answered exactly once, and the store's
  version moved once per applied update;
* no stall: after the first leave, the version never stands still for longer than one heartbeat
  timeout (plus the tick that notices it), up to the end of the budget;
* training goes on: the model ends better than it started, and every worker still in the run at
  the end (the joiners included) pushed.
"""

from __future__ import annotations

from typing import Any

import pytest

from hetd.sim.loop import SimRun, run_sim
from hetd.sim.results import PolicySpec
from hetd.sim.scenario import Leave, Scenario, from_mapping
from policies.registry import policy_names

TIMEOUT_S = 0.5

CHURN: dict[str, Any] = {
    "name": "tiny-churn",
    "dataset": "digits",
    "model": "mlp",
    "model_kwargs": {"hidden": [32]},
    "global_batch": 64,
    "base_batch": 16,
    "base_step_s": 0.01,
    "target_accuracy": 0.9,
    "budget_s": 4.0,
    "eval_interval_s": 0.25,
    "lr": 0.2,
    "heartbeat_timeout_s": TIMEOUT_S,
    "workers": [
        {"slowdown": 1.0, "count": 2},
        {"slowdown": 2.0, "name": "crasher"},
        {"slowdown": 4.0, "name": "quitter"},
    ],
    "events": [
        # while ashl and adsp still profile the first four
        {"at_s": 0.01, "join": {"slowdown": 1.5, "name": "early"}},
        {"at_s": 1.0, "leave": "crasher", "how": "crash"},
        {"at_s": 1.5, "join": {"slowdown": 3.0, "name": "late"}},
        {"at_s": 2.5, "leave": "quitter", "how": "clean"},
    ],
}


def churn_scenario() -> Scenario:
    return from_mapping(CHURN, "tiny-churn")


def check_churn(sc: Scenario, run: SimRun, label: str) -> None:
    """The three promises of the module docstring, for one run."""
    engine, result = run.engine, run.result
    # exactly once: what reached the daemon was answered, each push once
    for w in run.workers:
        assert sorted(w.answered) == sorted(w.delivered), (label, w.index)
        assert len(set(w.answered)) == len(w.answered), (label, w.index)
    assert sum(len(w.delivered) for w in run.workers) == run.pushes
    assert engine.applier.updates_applied == engine.store.version, label
    # no stall: after the first leave, the version never waits longer than the policy's own
    # rhythm before it (a round of local steps for diloco) plus one heartbeat timeout and the
    # tick that notices it, to the end of the budget
    first_leave = min(e.at_s for e in sc.events if isinstance(e, Leave))
    early = [0.0] + [t for t, _ in run.versions if t < first_leave]
    rhythm = max(b - a for a, b in zip(early, [*early[1:], first_leave], strict=True))
    times = [t for t, _ in run.versions if t >= first_leave] + [sc.budget_s]
    gaps = [b - a for a, b in zip([early[-1], *times], times, strict=False)]
    assert max(gaps) <= rhythm + TIMEOUT_S + sc.tick_s + 1e-9, (label, max(gaps), rhythm)
    # the crashed worker was dropped by the heartbeat timeout, the clean one by its bye
    reasons = {engine.members.departed[wid].name: why for _, wid, why in engine.members.departures}
    assert reasons.get("w2") == "heartbeat timeout", (label, reasons)
    assert reasons.get("w3") == "stopped (SIGTERM)", (label, reasons)
    # training went on, and every worker still there at the end took part
    assert result.final_accuracy > result.curve[0][1] + 0.3, (label, result.curve)
    names = sorted(f.name for f in engine.members.facts.values())
    assert names == ["w0", "w1", "w4", "w5"], (label, names)
    assert all(f.samples > 0 for f in engine.members.facts.values()), label
    # a profiling policy: the early joiner came while it still profiled (auto's stages are those
    # of the policy it swaps in, which starts from the timings auto has, without a profile)
    if result.stages and label != "auto":
        assert result.stages[0][1] == "profile" and result.stages[1][0] > 0.01, result.stages


@pytest.mark.slow
# staleness_weight is a weight concern that dynsgd composes with a gate: alone it releases nobody
# and trains nothing, churn or not
@pytest.mark.parametrize("policy", [p for p in policy_names() if p != "staleness_weight"])
def test_every_policy_loses_nothing_and_goes_on_under_churn(policy: str) -> None:
    sc = churn_scenario()
    check_churn(sc, run_sim(sc, PolicySpec(policy), seed=0), policy)
