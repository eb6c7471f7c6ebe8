"""One dpmp round at a time: structure, generations, participation under a budget."""

from __future__ import annotations

from dataclasses import replace

from policies.dpmp.controller import DpmpConfig, DpmpState, end_round, plan_round
from policies.dpmp.groups import candidates
from policies.dpmp.lyapunov import LyapunovConfig, round_costs
from tests.unit.test_dpmp_groups import BLOCKS, B

PRICED = {w: replace(s, price=p) for (w, s), p in zip(B.items(), (3, 3, 1, 0.5, 0.5), strict=True)}


def test_the_first_round_forms_the_pair_and_later_rounds_keep_it() -> None:
    plan, state = plan_round(BLOCKS, B, 512, DpmpState())
    assert plan.reason == "start" and plan.idle == ()
    pair = next(r for r in plan.replicas if len(r.members) == 2)
    assert sorted(pair.members) == [3, 4] and pair.cuts == (0, 1, 4)
    assert pair.batch % pair.micro == 0 and len(pair.inflight) == 2
    assert sum(r.batch for r in plan.replicas) == 512
    assert sorted(r.gen for r in plan.replicas) == [1, 2, 3, 4]
    state = end_round(state, DpmpConfig(), plan.tau, [0.0])
    again, _ = plan_round(BLOCKS, B, 512, state)
    assert again.reason == "keep" and again.replicas == plan.replicas


def test_a_budget_leaves_replicas_out_without_new_generations() -> None:
    cfg = DpmpConfig(lyapunov=LyapunovConfig(v=10.0, budgets=(1.6,)))  # fastest costs ~1.9/round
    state = DpmpState()
    seen: dict[tuple[int, ...], set[int]] = {}
    money = 0.0
    without = 0
    for _ in range(300):
        plan, state = plan_round(BLOCKS, PRICED, 512, state, cfg)
        without += all(r.members != (0,) for r in plan.replicas)
        for r in plan.replicas:
            seen.setdefault(r.members, set()).add(r.gen)
        assert sum(r.batch for r in plan.replicas) == 512
        busy = [w for r in plan.replicas for w in r.members]
        cost = plan.tau * sum(PRICED[w].price for w in busy)
        money += cost
        state = end_round(state, cfg, plan.tau, [cost])
    assert 0 < without < 300  # the dearest worker sat some rounds out ...
    assert all(len(g) == 1 for g in seen.values())  # ... and came back in the same generation
    assert abs(money / 300 / 1.6 - 1) < 0.05
    assert state.lyapunov.rounds == 300


def test_a_lost_stage_worker_forces_new_generations() -> None:
    plan, state = plan_round(BLOCKS, B, 512, DpmpState())
    state = end_round(state, DpmpConfig(), plan.tau, [])
    survivors = {w: s for w, s in B.items() if w != 4}
    after, _ = plan_round(BLOCKS, survivors, 512, state)
    assert after.reason == "forced"
    assert all(4 not in r.members for r in after.replicas)
    helper = next(r for r in after.replicas if 3 in r.members)
    assert len(helper.members) == 2 and helper.gen > max(r.gen for r in plan.replicas)


def test_round_costs_match_the_plan() -> None:
    plan, _ = plan_round(BLOCKS, PRICED, 512, DpmpState())
    best = candidates(BLOCKS, PRICED, 512)[0]
    money, _ = round_costs(best, BLOCKS, PRICED)
    assert money == best.tau * 8.0 and plan.tau == best.tau
