"""dpmp group formation: the benchmark scenarios' structures and regrouping with hysteresis."""

from __future__ import annotations

from dataclasses import replace

import pytest

from policies.dpmp.costs import RHO, Block, WorkerSpec, need_full
from policies.dpmp.groups import GroupConfig, GroupState, candidates, decide, evaluate


def _mlp(dims: tuple[int, ...] = (784, 512, 512, 512, 10)) -> list[Block]:
    """The benchmark MLP as one block per Dense layer (fp32)."""
    out = []
    for j in range(len(dims) - 1):
        p = dims[j] * dims[j + 1] + dims[j + 1]
        out.append(Block(f"b{j}", 4.0 * p, 4.0 * dims[j + 1], float(p)))
    return out


BLOCKS = _mlp()
POOR = 0.6 * need_full(BLOCKS, 32) / RHO  # usable memory 0.6 of what the whole model needs


def _w(i: int, slow: float, poor: bool = False, bw: float = 100e6) -> WorkerSpec:
    mem = POOR if poor else 1e12
    return WorkerSpec(i, 1e-3 * slow, mem_bytes=mem, bw_up=bw, bw_down=bw, lat_s=2e-3)


def _dp_only(ws: dict[int, WorkerSpec]) -> float:
    s = evaluate(BLOCKS, ws, 512, tuple((w,) for w in ws if ws[w].mem_bytes > POOR))
    assert s is not None
    return s.tau


def _by_id(*ws: WorkerSpec) -> dict[int, WorkerSpec]:
    return {w.wid: w for w in ws}


B = _by_id(_w(0, 1), _w(1, 1), _w(2, 2), _w(3, 2, True), _w(4, 2, True))
D = _by_id(_w(0, 1), _w(1, 2), _w(2, 1, True), _w(3, 1, True), _w(4, 2, True), _w(5, 2, True))


def test_scenario_b_pairs_the_memory_poor_workers() -> None:
    best = candidates(BLOCKS, B, 512)[0]
    assert best.groups == ((0,), (1,), (2,), (3, 4))
    assert best.tau <= 0.85 * _dp_only(B)  # ≥ 15 % less batch time than DP-only
    assert sum(best.split.sizes) == 512


def test_scenario_d_two_pairs_and_a_paper_sized_gain() -> None:
    best = candidates(BLOCKS, D, 512)[0]
    assert sorted(len(g) for g in best.groups) == [1, 1, 2, 2]
    assert best.tau <= 0.55 * _dp_only(D)


def test_slow_links_and_homogeneous_workers_stay_data_parallel() -> None:
    c = _by_id(_w(0, 1), _w(1, 1), _w(2, 2), _w(3, 2, True, 2e6), _w(4, 2, True, 2e6))
    assert candidates(BLOCKS, c, 512)[0].groups == ((0,), (1,), (2,))
    e = _by_id(*(_w(i, 1) for i in range(4)))
    assert candidates(BLOCKS, e, 512)[0].groups == ((0,), (1,), (2,), (3,))


def test_a_helper_pairs_a_capable_worker_with_a_lone_memory_poor_one() -> None:
    ws = _by_id(_w(0, 4), _w(1, 1, True))  # a slow capable worker and a fast poor one
    best = candidates(BLOCKS, ws, 512)[0]
    assert best.groups == ((0, 1),)
    assert best.tau < _dp_only(ws)


def test_nobody_able_to_hold_the_model_is_an_error() -> None:
    tiny = _by_id(WorkerSpec(0, 1e-3, mem_bytes=1000.0))
    assert candidates(BLOCKS, tiny, 512) == []
    with pytest.raises(ValueError, match="no feasible structure"):
        decide(BLOCKS, tiny, 512, GroupState(), 0)


def test_hysteresis_waits_r_rounds_and_needs_the_gain() -> None:
    cfg = GroupConfig(period=50, keep=0.75, switch_s=1.0, horizon=50)
    dp_d = GroupState(current=((0,), (1,)), changed_at=0, pool=frozenset(D))
    s, st, why = decide(BLOCKS, D, 512, dp_d, 10, cfg)
    assert why == "keep" and s.groups == ((0,), (1,)) and st == dp_d
    s, st, why = decide(BLOCKS, D, 512, dp_d, 50, cfg)  # gain 2.2x after R rounds
    assert why == "regroup" and len(s.groups) == 4 and st.changed_at == 50
    # B's pairing gains only 1.2x < 1/0.75: DP-only stays however long it waits
    dp_b = GroupState(current=((0,), (1,), (2,)), changed_at=0, pool=frozenset(B))
    assert decide(BLOCKS, B, 512, dp_b, 500, cfg)[2] == "keep"
    assert decide(BLOCKS, B, 512, dp_b, 500, GroupConfig(keep=0.95))[2] == "regroup"


def test_a_worker_that_joins_is_planned_at_once_whatever_the_hysteresis() -> None:
    """A structure chosen before a worker came never weighed it: the hysteresis (R rounds, the
    gain) holds a structure against small gains, not against a worker it never saw."""
    cfg = GroupConfig(period=50, keep=0.75)
    first = {0: D[0]}
    s, st, why = decide(BLOCKS, first, 512, GroupState(), 0, cfg)
    assert why == "start" and s.groups == ((0,),)
    s, st, why = decide(BLOCKS, D, 512, st, 1, cfg)
    assert why == "joined" and set(D) <= {w for g in s.groups for w in g}
    assert decide(BLOCKS, D, 512, st, 2, cfg)[2] == "keep"


def test_a_lost_member_forces_a_regroup_at_once() -> None:
    st = GroupState(current=((0,), (1,), (2,), (3, 4)), changed_at=7)
    survivors = {w: spec for w, spec in B.items() if w != 4}
    s, new, why = decide(BLOCKS, survivors, 512, st, 8)
    assert why == "forced" and new.changed_at == 8
    assert all(4 not in g for g in s.groups)
    # 3 cannot hold the model alone: it pairs with a helper (2, as slow as it) and beats DP-only
    assert s.groups == ((0,), (1,), (2, 3))
    assert s.tau < _dp_only(survivors)
    s, _, why = decide(BLOCKS, B, 512, GroupState(), 0)
    assert why == "start" and s.groups == ((0,), (1,), (2,), (3, 4))


def test_a_kept_pipeline_keeps_its_cuts_and_micro_batch_as_speeds_change() -> None:
    """A new shape (cuts, micro-batch) of a pipeline replica compiles its stages' kernels on
    the next step, and the synchronous round waits for it; the same groups in another shape need
    the hysteresis' gain. (In real mode the replica was re-sized from 16 to 8 samples per
    micro-batch by its first calibrated steps, a 2.4 s round of compiles for a predicted 6 %.)"""
    guessed = {w: replace(s, sample_s=1e-3) if w in (3, 4) else s for w, s in B.items()}
    first, st, why = decide(BLOCKS, guessed, 512, GroupState(), 0)
    assert why == "start"
    (pipe,) = [r for r in first.replicas if r.stages > 1]
    slower = {w: replace(s, sample_s=4.5e-3) if w in (3, 4) else s for w, s in B.items()}
    afresh, _, _ = decide(BLOCKS, slower, 512, GroupState(), 0)
    (fresh,) = [r for r in afresh.replicas if r.stages > 1]
    assert (fresh.cuts, fresh.micro) != (pipe.cuts, pipe.micro)  # planned anew: another shape
    for round_, cfg in ((1, GroupConfig()), (100, GroupConfig())):
        kept, _, why = decide(BLOCKS, slower, 512, st, round_, cfg)
        (now,) = [r for r in kept.replicas if r.stages > 1]
        assert why == "keep" and (now.members, now.cuts, now.micro) == (
            pipe.members, pipe.cuts, pipe.micro,
        )  # fmt: skip
        assert kept.tau > afresh.tau  # costed at the speeds now: the kept shape is slower
    # a gain that clears the hysteresis re-shapes it
    eager = GroupConfig(period=50, keep=0.95, switch_s=0.0)
    assert decide(BLOCKS, slower, 512, st, 1, eager)[2] == "keep"  # within the period
    shaped, _, why = decide(BLOCKS, slower, 512, st, 50, eager)
    assert why == "regroup" and shaped.describe() == afresh.describe()
