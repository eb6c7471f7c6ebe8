"""The dpmp cost model: per-stage times, memory, the cut search and the batch split."""

from __future__ import annotations

import math
import random

import pytest

from policies.dpmp.costs import (
    Block,
    WorkerSpec,
    fits,
    memory_poor,
    micro_batch,
    need_full,
    replica_cost,
    split_batch,
)
from policies.dpmp.search import best_partition, brute_force_cuts, dp_cuts


def _even(n: int, p: float = 100.0, act: float = 10.0) -> list[Block]:
    return [Block(f"b{j}", p, act, 1.0) for j in range(n)]


def test_two_equal_stages_match_the_pipeline_formula() -> None:
    # 4 equal blocks, 4 s/sample whole model => 1 s/sample/block; m = 8: 16 s per stage and
    # micro-batch. T(M) = Σu + (M-1)·max u = 32 + 3·16 = 80 s for M = 4 (b = 32).
    blocks = _even(4)
    group = [WorkerSpec(0, 4.0), WorkerSpec(1, 4.0)]
    cost = replica_cost(blocks, group, (0, 2, 4), micro=8)
    assert cost.units == (16.0, 16.0, 0.0, 0.0, 0.0, 0.0)  # links infinitely fast
    assert cost.time(32) == pytest.approx(80.0)
    assert cost.per_sample_s == pytest.approx(2.0)
    assert cost.fill_s == pytest.approx(16.0)


def test_links_are_pseudo_stages_per_worker() -> None:
    # act 1000 B/sample at the cut, m = 10 -> 10 kB per micro-batch each way; stage 0's uplink
    # at 1 kB/s takes 10 s: it is the bottleneck, and latency adds to the fill only.
    blocks = [Block("a", 0.0, 1000.0, 1.0), Block("b", 0.0, 5.0, 1.0)]
    slow = WorkerSpec(0, 0.2, bw_up=1000.0, bw_down=1e9, lat_s=0.5)
    fast = WorkerSpec(1, 0.2, bw_up=1e9, bw_down=1e9, lat_s=0.5)
    cost = replica_cost(blocks, [slow, fast], (0, 1, 2), micro=10)
    assert cost.bottleneck == pytest.approx(10.0)
    assert cost.per_sample_s == pytest.approx(1.0)
    # Σlat = 2·(0.5 + 0.5) for the one cut (forward and backward crossings)
    assert cost.fill_s == pytest.approx(sum(cost.units) - 10.0 + 2.0 + 1.0)


def test_memory_counts_params_grads_and_inflight_residuals() -> None:
    blocks = [Block("a", 100.0, 2.0, 1.0), Block("b", 50.0, 3.0, 1.0, resid_bytes=7.0)]
    cost = replica_cost(blocks, [WorkerSpec(0, 1.0), WorkerSpec(1, 1.0)], (0, 1, 2), micro=4)
    # stage 0: 2·100 + 2 in flight·4·2; stage 1: 2·50 + 1·4·7
    assert cost.mem_need == (216.0, 128.0)
    assert need_full(blocks, 4) == 2 * 150 + 4 * 9
    assert memory_poor(WorkerSpec(0, 1.0, mem_bytes=100.0), blocks, 4)
    assert not memory_poor(WorkerSpec(0, 1.0, mem_bytes=1000.0), blocks, 4)


def test_the_big_block_goes_to_the_big_memory_worker() -> None:
    blocks = [
        Block("small", 10.0, 1.0, 1.0),
        Block("big", 1000.0, 1.0, 1.0),
        Block("s2", 10.0, 1.0, 1.0),
    ]
    poor = WorkerSpec(0, 1.0, mem_bytes=100.0)
    rich = WorkerSpec(1, 1.0, mem_bytes=10_000.0)
    best = best_partition(blocks, [poor, rich], micro=1)
    assert best is not None
    owner = dict(zip(best.members, zip(best.cuts, best.cuts[1:], strict=False), strict=True))
    lo, hi = owner[1]
    assert lo <= 1 < hi  # block "big" on the rich worker
    assert fits(best, [poor, rich] if best.members == (0, 1) else [rich, poor])


def test_infeasible_memory_is_none() -> None:
    blocks = _even(3, p=1000.0)
    group = [WorkerSpec(0, 1.0, mem_bytes=100.0), WorkerSpec(1, 1.0, mem_bytes=100.0)]
    assert dp_cuts(blocks, group, micro=8) is None
    assert brute_force_cuts(blocks, group, micro=8) is None
    assert best_partition(blocks, group, micro=8) is None
    assert dp_cuts(blocks, [WorkerSpec(i, 1.0) for i in range(4)], micro=8) is None  # S > L


def test_a_slow_worker_gets_fewer_blocks() -> None:
    blocks = _even(6)
    fast, slow = WorkerSpec(0, 6.0), WorkerSpec(1, 12.0)  # slow: 2 s per block
    cost = dp_cuts(blocks, [fast, slow], micro=1)
    assert cost is not None and cost.cuts == (0, 4, 6)  # 4 s | 4 s


def _random_instance(rng: random.Random) -> tuple[list[Block], list[WorkerSpec], int, int | None]:
    n_blocks = rng.randint(1, 9)
    blocks = [
        Block(f"b{j}", rng.uniform(1, 100), rng.uniform(0.1, 20), rng.uniform(0.1, 5))
        for j in range(n_blocks)
    ]
    n = rng.randint(1, min(4, n_blocks))
    total_p = sum(b.param_bytes for b in blocks)
    group = [
        WorkerSpec(
            i,
            rng.uniform(0.5, 4.0),
            mem_bytes=rng.choice([math.inf, rng.uniform(0.3, 3.0) * total_p]),
            bw_up=rng.uniform(5, 500),
            bw_down=rng.uniform(5, 500),
            lat_s=rng.uniform(0, 0.01),
        )
        for i in range(n)
    ]
    return blocks, group, rng.choice([1, 2, 4, 8]), rng.choice([None, 1, 2, 8])


def test_the_cut_program_equals_brute_force_on_200_random_instances() -> None:
    rng = random.Random(17)
    none = 0
    for _ in range(200):
        blocks, group, m, big_m = _random_instance(rng)
        dp = dp_cuts(blocks, group, m, big_m)
        bf = brute_force_cuts(blocks, group, m, big_m)
        if bf is None:
            assert dp is None
            none += 1
            continue
        assert dp is not None and fits(dp, group)
        assert dp.bottleneck == pytest.approx(bf.bottleneck, rel=1e-9)
        assert sum(dp.units) == pytest.approx(sum(bf.units), rel=1e-9)
    assert 0 < none < 150  # both kinds of instance were exercised


def test_micro_batch_is_a_power_of_two_with_m_at_least_4s() -> None:
    assert micro_batch(512, 2) == 64
    assert micro_batch(100, 2) == 8  # 12.5 -> 8
    assert micro_batch(512, 1) == 64  # share/8 for data parallel
    assert micro_batch(10, 1) == 8  # clipped up
    assert micro_batch(100_000, 1) == 128  # clipped down


def test_split_equalises_finishes_in_micro_batches() -> None:
    blocks = _even(2)
    reps = [
        replica_cost(blocks, [WorkerSpec(0, 1.0)], (0, 2), 8),
        replica_cost(blocks, [WorkerSpec(1, 2.0)], (0, 2), 8),
        replica_cost(blocks, [WorkerSpec(2, 2.0), WorkerSpec(3, 2.0)], (0, 1, 2), 16),
    ]
    split = split_batch(512, reps)
    assert sum(split.sizes) == 512
    assert all(b % r.micro == 0 for b, r in zip(split.sizes, reps, strict=True))
    finishes = [r.time(b) for b, r in zip(split.sizes, reps, strict=True)]
    # within one micro-batch of the slowest per-sample time of equal
    assert max(finishes) - min(finishes) <= max(r.per_sample_s * r.micro for r in reps)
    assert split.tau == pytest.approx(max(finishes))


def test_split_gives_nothing_to_a_replica_not_worth_it_and_refuses_small_caps() -> None:
    blocks = _even(1)
    quick = replica_cost(blocks, [WorkerSpec(0, 0.01)], (0, 1), 8)
    laggard = replica_cost(
        blocks, [WorkerSpec(1, 0.01, bw_up=1.0, bw_down=1.0)], (0, 1), 8
    )  # 200 s to push/pull its 100 B
    split = split_batch(64, [quick, laggard])
    assert split.sizes == (64, 0)
    with pytest.raises(ValueError, match="fewer than"):
        split_batch(64, [quick, laggard], caps=[16, 16])
    odd = split_batch(13, [quick, quick])  # 13 = 8 + 5: the remainder pads one micro-batch
    assert sum(odd.sizes) == 13
