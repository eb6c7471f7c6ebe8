"""The dpmp drift-plus-penalty controller on scenario B with per-worker prices."""

from __future__ import annotations

import itertools
import math
import random
from dataclasses import replace

import pytest

from policies.dpmp.groups import candidates
from policies.dpmp.lyapunov import (
    LyapunovConfig,
    LyapunovState,
    Option,
    choose,
    observe,
    round_costs,
    structure_options,
)
from tests.unit.test_dpmp_groups import BLOCKS, B

PRICES = {0: 3.0, 1: 3.0, 2: 1.0, 3: 0.5, 4: 0.5}
WORKERS = {w: replace(s, price=PRICES[w]) for w, s in B.items()}
BEST = candidates(BLOCKS, WORKERS, 512)[0]
OPTIONS = structure_options(BLOCKS, WORKERS, 512, BEST)
UNCONSTRAINED = OPTIONS[0].costs[0]


def _run(
    cfg: LyapunovConfig, rounds: int, noise: float = 0.0, seed: int = 0
) -> tuple[LyapunovState, float]:
    rng = random.Random(seed)
    state, top = LyapunovState(), 0.0
    for _ in range(rounds):
        o, state = choose(OPTIONS, state, cfg)
        jitter = 1 + rng.uniform(-noise, noise)
        state = observe(state, cfg, o.tau * jitter, [c * jitter for c in o.costs])
        top = max(top, state.queues[0])
    return state, top


def test_options_drop_the_dearest_replica_first() -> None:
    assert [len(o.groups) for o in OPTIONS] == [4, 3, 2, 1]
    assert (0,) not in OPTIONS[1].groups  # price 3 at full speed: dearest per sample
    assert all(a.tau < b.tau for a, b in itertools.pairwise(OPTIONS))
    assert all(a.costs[0] > b.costs[0] for a, b in itertools.pairwise(OPTIONS))
    money, head = round_costs(BEST, BLOCKS, WORKERS)
    assert money == pytest.approx(BEST.tau * 8.0)
    model = sum(b.param_bytes for b in BLOCKS)
    pair_b = BEST.split.sizes[BEST.groups.index((3, 4))]
    assert head == pytest.approx(4 * 2 * model + 4 * pair_b * 4 * 512)  # one cut after block 0


def test_the_budget_is_met_on_average_with_bounded_queues() -> None:
    budget = 0.8 * UNCONSTRAINED
    state, top = _run(LyapunovConfig(v=10.0, budgets=(budget,)), 2000, noise=0.1, seed=3)
    tau, (money, _) = state.averages()
    assert abs(money / budget - 1) < 0.05
    assert top < 10.0 + 3  # O(V): V·Δτ/T_ref plus one slot's excess
    assert tau > BEST.tau  # the budget cost some speed ...
    assert tau < OPTIONS[2].tau  # ... but it mixes the two cheapest-fitting options


def test_larger_v_trades_cost_for_speed_monotonically() -> None:
    budget = 0.8 * UNCONSTRAINED
    runs = [_run(LyapunovConfig(v=v, budgets=(budget,)), 400) for v in (1, 3, 10, 30, 100)]
    taus = [s.averages()[0] for s, _ in runs]
    costs = [s.averages()[1][0] for s, _ in runs]
    tops = [top for _, top in runs]
    assert all(a >= b - 1e-12 for a, b in itertools.pairwise(taus))
    assert all(a <= b + 1e-12 for a, b in itertools.pairwise(costs))
    assert all(a < b for a, b in itertools.pairwise(tops))
    assert taus[0] > taus[-1] and costs[0] < costs[-1]


def test_no_budget_always_takes_the_fastest() -> None:
    state, top = _run(LyapunovConfig(v=10.0, budgets=(math.inf,)), 50)
    assert top == 0.0 and state.averages()[0] == pytest.approx(BEST.tau)


def test_a_budget_changed_live_is_tracked_from_then_on() -> None:
    loose, tight = (
        LyapunovConfig(v=3.0, budgets=(UNCONSTRAINED,)),
        LyapunovConfig(v=3.0, budgets=(0.6 * UNCONSTRAINED,)),
    )
    state, _ = _run(loose, 200)
    before = state
    for _ in range(1000):
        o, state = choose(OPTIONS, state, tight)
        state = observe(state, tight, o.tau, o.costs)
    spent = (state.cost_sums[0] - before.cost_sums[0]) / (state.rounds - before.rounds)
    assert abs(spent / (0.6 * UNCONSTRAINED) - 1) < 0.05


def test_bad_configs_and_empty_options_are_refused() -> None:
    with pytest.raises(ValueError, match="V must be"):
        LyapunovConfig(v=0.0)
    with pytest.raises(ValueError, match="budgets"):
        LyapunovConfig(budgets=(0.0,))
    with pytest.raises(ValueError, match="no options"):
        choose([], LyapunovState(), LyapunovConfig())
    # a switch cost is amortised over H rounds: V·switch/(H·T_ref) tips a near tie
    cheap = Option("stay", 1.0, (0.0,))
    move = Option("move", 0.99, (0.0,), switch_s=1.0)
    assert choose([cheap, move], LyapunovState(), LyapunovConfig(horizon=50))[0] is cheap
    assert choose([cheap, move], LyapunovState(), LyapunovConfig(horizon=1000))[0] is move
