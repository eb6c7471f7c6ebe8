"""``hetd bench --mode real`` runs every scenario the simulator runs: regime shifts, stragglers of
any factor and length, and link latency reach each ``hetd-worker`` process as emulation flags, on
one time origin shared with the run (the simulator's t = 0)."""

from __future__ import annotations

import statistics
from typing import Any

import pytest

from hetd.bench.real import _worker_args, check_real, run_real
from hetd.sim.results import PolicySpec
from hetd.sim.scenario import from_mapping, load_scenario, replace, scenario_names
from workers import cli

BASE_STEP_S = 0.02  # s per 32 samples at slow-down 1
SHIFT_TO = 10.0  # worker 0's slow-down after its shift
LATENCY_S = 0.015  # worker 1's link latency, each way

TINY_SHIFT: dict[str, Any] = {
    "name": "tiny-shift",
    "dataset": "digits",
    "model": "mlp",
    "model_kwargs": {"hidden": [32]},
    "global_batch": 64,
    "base_batch": 32,
    "base_step_s": BASE_STEP_S,
    "target_accuracy": 0.8,
    "budget_s": 6.0,
    "eval_interval_s": 0.5,
    "lr": 0.2,
    "workers": [
        {"slowdown": 1.0},
        {"slowdown": 1.0, "latency_s": LATENCY_S},
    ],
    "shifts": [{"worker": 0, "slowdown": SHIFT_TO, "at_fraction": 0.4}],  # at 2.4 s
}


@pytest.mark.parametrize("name", scenario_names())
def test_every_packaged_scenario_is_expressed_by_worker_flags(name: str) -> None:
    """No scenario is refused, and every worker's flags are ones ``hetd-worker`` accepts and turn
    into the scenario's schedule (shifts at_fraction resolved against the budget given)."""
    budget = max(8.0, load_scenario(name).eval_interval_s)  # S7_slow evaluates every 12 s
    sc = replace(load_scenario(name), budget_s=budget)
    check_real(sc)
    fastest = min([w.slowdown for w in sc.workers] + [s.slowdown for s in sc.shifts])
    for i, w in enumerate(sc.workers[:4]):  # scale100's hundred are alike
        emu = cli.build_emulation(cli.parser().parse_args(["ws://x", *_worker_args(sc, i, 1)]))
        assert emu.slowdown == pytest.approx(w.slowdown / fastest)
        mine = [s for s in sc.shifts if s.worker == i]
        assert emu.shifts == tuple((s.time(budget), s.slowdown / fastest) for s in mine)
        assert emu.stragglers == w.stragglers.p
        if w.stragglers.p > 0:
            assert (emu.straggle_factor, emu.straggle_mean) == (
                w.stragglers.factor,
                w.stragglers.mean_len,
            )
        assert emu.latency_s == w.latency_s
        assert emu.clock is not None and emu.clock.origin is None  # waits for the run's t = 0
    if name == "S3":
        assert "4.0:3.0" in _worker_args(sc, 0, 0)  # half of the 8 s budget given


def _durations(spans: list[tuple[float, float, str]], lo: float, hi: float) -> list[float]:
    """Durations of the busy spans that begin and end within [lo, hi) (the span open at the end
    of the budget is cut there: not a whole span)."""
    return [t1 - t0 for t0, t1, _ in spans if lo <= t0 and t1 < hi]


@pytest.mark.slow
def test_a_real_run_follows_the_shift_and_charges_latency_both_ways() -> None:
    """Under ASP a worker's busy span runs from one push's arrival to the next: the parameters'
    transfer, the step and the push's transfer. Each span is at least its emulated time (a
    lower bound that holds however loaded the machine is): after its shift, worker 0's spans
    last at least 10 base steps and are far longer than before it, while worker 1's (never
    shifted) do not change alike; worker 1's spans include its latency twice."""
    sc = from_mapping(TINY_SHIFT)
    shift_at = sc.shifts[0].time(sc.budget_s)
    result = run_real(sc, PolicySpec("asp"), 0, sc.lr, lambda t: None)
    timeline = result.trace.timeline
    margin = 0.3  # s around the shift: the span in progress at the shift started before it
    before = _durations(timeline["0"], 0.3, shift_at - margin)
    after = _durations(timeline["0"], shift_at + margin, sc.budget_s)
    assert len(before) >= 3 and len(after) >= 3, (before, after)
    slow = statistics.median(after)
    assert slow >= 0.95 * SHIFT_TO * BASE_STEP_S, after  # the emulated step, padded and shifted
    # Not earlier: the origin is the run's t = 0, not some worker's welcome seconds before it.
    assert sum(d >= 0.95 * SHIFT_TO * BASE_STEP_S for d in before) <= len(before) // 4, before
    assert slow >= 2.0 * statistics.median(before), (before, after)
    # The shift is a worker's own: its peer keeps its pace (a wide margin for a loaded machine).
    peer_before = _durations(timeline["1"], 0.3, shift_at - margin)
    peer_after = _durations(timeline["1"], shift_at + margin, sc.budget_s)
    assert statistics.median(peer_after) < 0.6 * slow, (peer_before, peer_after)
    # Worker 1 pays its latency on the parameters and on the push of every round.
    assert min(peer_before + peer_after) >= 0.95 * (2 * LATENCY_S + BASE_STEP_S)
    assert result.final_accuracy > result.curve[0][1]  # and it trained
