"""Which workers form which replicas: candidate structures, their predicted round time, and
regrouping with hysteresis.

A *structure* is a set of replicas (each a :class:`~policies.dpmp.costs.ReplicaCost`: members in
stage order, cuts, micro-batch) plus the idle workers, with the equal-finish split of the global
batch and its predicted round time ``τ*``. Candidates:

1. every worker that can hold the model as a data-parallel replica, memory-poor ones idle (the
   LB-BSP baseline);
2. the *pool* (memory-poor workers, and workers more than 2× slower than the median) split into
   pipeline groups of 2 or 3 (every way for a pool of up to 7, greedily beyond), a capable pool
   member left alone running data parallel;
3. *helper* pairs: a capable worker with one memory-poor worker left idle by the best of 2.

Only workers that run pipeline stages (``WorkerSpec.stages``) are ever in a group of more than
one; the others run data parallel when they can hold the model, and are idle when they cannot.

:func:`decide` keeps the current structure unless a candidate predicts ``τ_new + switch/H ≤
keep·τ_cur`` (``keep = 0.75``: a predicted gain of at least 1/0.75) and ``R`` rounds have passed
since the last change; a structure whose members are no longer all present is replaced at once.
The structure kept includes its pipeline replicas' shapes (order, cuts, micro-batch): re-cut or
re-sized on every change of the measured speeds, a replica would compile new kernels on its next
step (seconds on a CPU, the whole synchronous round waiting), so a new shape of the same groups
needs the same gain.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, replace

from policies.dpmp.costs import (
    Block,
    ReplicaCost,
    Split,
    WorkerSpec,
    fits,
    memory_poor,
    micro_batch,
    replica_cost,
    split_batch,
)
from policies.dpmp.search import best_partition

Groups = tuple[tuple[int, ...], ...]  # replica members (stage order not implied), sorted
# A pipeline replica's shape: (members in stage order, cuts, micro-batch). A new shape costs its
# stages a compile of their kernels on their first step (seconds on a CPU), and a synchronous
# round waits for it.
Shape = tuple[tuple[int, ...], tuple[int, ...], int]


@dataclass(frozen=True, slots=True)
class Structure:
    """Replicas, idle workers, the split and its predicted round time."""

    replicas: tuple[ReplicaCost, ...]
    idle: tuple[int, ...]
    split: Split

    @property
    def tau(self) -> float:
        return self.split.tau

    @property
    def groups(self) -> Groups:
        """The member sets, order-free (what identifies a structure for hysteresis)."""
        return tuple(sorted(tuple(sorted(r.members)) for r in self.replicas))

    @property
    def shapes(self) -> tuple[Shape, ...]:
        """The pipeline replicas' shapes, sorted (data-parallel replicas compile nothing new)."""
        return tuple(sorted((r.members, r.cuts, r.micro) for r in self.replicas if r.stages > 1))

    def describe(self) -> str:
        parts = []
        for r, b in zip(self.replicas, self.split.sizes, strict=True):
            who = "+".join(str(w) for w in r.members)
            cuts = "" if r.stages == 1 else f" cuts {list(r.cuts)}"
            parts.append(f"[{who}{cuts} m={r.micro} b={b}]")
        idle = f" idle {list(self.idle)}" if self.idle else ""
        return " ".join(parts) + idle + f" τ={self.tau * 1e3:.1f} ms"


Memo = dict[tuple[tuple[int, ...], int], ReplicaCost | None]


def evaluate(
    blocks: Sequence[Block],
    workers: Mapping[int, WorkerSpec],
    total: int,
    groups: Groups,
    memo: Memo | None = None,
    kept: Sequence[Shape] = (),
) -> Structure | None:
    """The structure made of ``groups`` (each a replica; its best order and cuts), the others
    idle; None when a group fits no order and cuts, or nobody works. ``memo`` keeps each
    (group, micro-batch)'s partition across calls on the same facts. A group with a shape in
    ``kept`` keeps that order, those cuts and that micro-batch while they fit its memory (its
    stages hold their compiled kernels), costed at the workers' speeds now."""
    if not groups:
        return None
    speed = {w: 1.0 / spec.sample_s for w, spec in workers.items()}
    whole = sum(speed[w] for g in groups for w in g)
    shapes = {tuple(sorted(members)): (members, cuts, m) for members, cuts, m in kept}
    replicas = []
    for g in groups:
        cost = _kept_cost(blocks, workers, shapes.get(g))
        if cost is None:
            share = total * sum(speed[w] for w in g) / whole
            m = micro_batch(share, len(g))
            if memo is not None and (g, m) in memo:
                cost = memo[(g, m)]
            else:
                cost = best_partition(blocks, [workers[w] for w in g], m)
                if memo is not None:
                    memo[(g, m)] = cost
        if cost is None:
            return None
        replicas.append(cost)
    busy = {w for g in groups for w in g}
    idle = tuple(sorted(w for w in workers if w not in busy))
    return Structure(tuple(replicas), idle, split_batch(total, replicas))


def _kept_cost(
    blocks: Sequence[Block], workers: Mapping[int, WorkerSpec], shape: Shape | None
) -> ReplicaCost | None:
    """The cost of a kept ``shape`` at the workers' speeds now; None when there is none, it no
    longer fits the workers' memory, or it no longer matches the model."""
    if shape is None:
        return None
    members, cuts, m = shape
    if any(w not in workers for w in members):
        return None
    group = [workers[w] for w in members]
    try:
        cost = replica_cost(blocks, group, cuts, m)
    except ValueError:  # cuts of another model
        return None
    return cost if fits(cost, group) else None


def _partitions(pool: Sequence[int]) -> Iterator[list[tuple[int, ...]]]:
    """Every way to split ``pool`` into blocks of 1, 2 or 3 (order-free)."""
    if not pool:
        yield []
        return
    first, rest = pool[0], list(pool[1:])
    for tail in _partitions(rest):
        yield [(first,), *tail]
    for i, b in enumerate(rest):
        others = rest[:i] + rest[i + 1 :]
        for tail in _partitions(others):
            yield [(first, b), *tail]
        for k, c in enumerate(others):
            for tail in _partitions(others[:k] + others[k + 1 :]):
                yield [(first, b, c), *tail]


def _greedy(pool: Sequence[int], workers: Mapping[int, WorkerSpec]) -> list[tuple[int, ...]]:
    """Pairs by speed, fastest with most memory first."""
    order = sorted(pool, key=lambda w: (workers[w].sample_s, -workers[w].mem_bytes, w))
    return [tuple(order[i : i + 2]) for i in range(0, len(order), 2)]


def candidates(
    blocks: Sequence[Block], workers: Mapping[int, WorkerSpec], total: int, exhaustive: int = 7
) -> list[Structure]:
    """The candidate structures (§ module doc), each evaluated; infeasible ones left out."""
    ids = sorted(workers)
    if not ids:
        return []
    m0 = micro_batch(total / len(ids), 1)
    poor = {w for w in ids if memory_poor(workers[w], blocks, m0)}
    median = statistics.median(workers[w].sample_s for w in ids)
    slow = {w for w in ids if w not in poor and workers[w].sample_s > 2 * median}
    capable = [w for w in ids if w not in poor]
    # only workers that run pipeline stages are grouped; the others are data parallel or idle
    pool = sorted(w for w in poor | slow if workers[w].stages)
    found: dict[Groups, Structure] = {}
    memo: Memo = {}

    def add(groups: Sequence[tuple[int, ...]]) -> Structure | None:
        key = tuple(sorted(tuple(sorted(g)) for g in groups))
        if key in found:
            return found[key]
        s = evaluate(blocks, workers, total, key, memo)
        if s is not None:
            found[key] = s
        return s

    add([(w,) for w in capable])
    fixed = [(w,) for w in capable if w not in pool]
    splits = list(_partitions(pool)) if len(pool) <= exhaustive else [_greedy(pool, workers)]
    for part in splits:
        groups = fixed + [g for g in part if len(g) > 1 or g[0] not in poor]
        add(groups)
    best = min(found.values(), key=lambda s: s.tau, default=None)
    if best is not None:
        for p in best.idle:
            if p not in poor or not workers[p].stages:
                continue
            for h in capable:
                if (h,) in best.groups and workers[h].stages:
                    add([g for g in best.groups if g != (h,)] + [(h, p)])
    return sorted(found.values(), key=lambda s: (s.tau, len(s.replicas)))


@dataclass(frozen=True, slots=True)
class GroupConfig:
    """Hysteresis: regroup at most once per ``period`` rounds, and only for a predicted
    ``τ_new + switch_s/horizon ≤ keep·τ_cur``."""

    period: int = 50  # R
    keep: float = 0.75
    switch_s: float = 1.0  # s a regroup costs at least (new compiles, slice moves)
    horizon: int = 50  # H, rounds over which that cost is amortised


@dataclass(frozen=True, slots=True)
class GroupState:
    current: Groups | None = None
    changed_at: int | None = None  # round of the last change
    pool: frozenset[int] = frozenset()  # the workers the current structure was chosen among
    shapes: tuple[Shape, ...] = ()  # the current structure's pipeline shapes


def switch_cost(
    workers: Mapping[int, WorkerSpec],
    new: Sequence[Shape],
    old: Sequence[Shape],
    cfg: GroupConfig,
) -> float:
    """Seconds a move to pipeline shapes ``new`` from ``old`` costs: the slowest compile
    (:attr:`WorkerSpec.compile_s`, as measured) of a member of a shape not running now, whose
    stages compile before it steps; ``cfg.switch_s`` at least (a regroup also moves slices and
    runs a round without the new replicas)."""
    fresh = [w for shape in new if shape not in old for w in shape[0]]
    measured = [
        c
        for w in fresh
        if (spec := workers.get(w)) is not None and (c := spec.compile_s) is not None
    ]
    return max([cfg.switch_s, *measured])


def decide(
    blocks: Sequence[Block],
    workers: Mapping[int, WorkerSpec],
    total: int,
    state: GroupState,
    round_: int,
    cfg: GroupConfig = GroupConfig(),
) -> tuple[Structure, GroupState, str]:
    """This round's structure, the new state and why: ``"start"``, ``"forced"`` (a member of the
    current structure is gone or it no longer fits), ``"joined"`` (a worker came that the current
    structure was not chosen among: the hysteresis holds a structure against small gains, not
    against a worker it never saw), ``"regroup"`` (the gain clears the hysteresis), or
    ``"keep"``. Raises ValueError when no structure is feasible."""
    cands = candidates(blocks, workers, total)
    if not cands:
        raise ValueError("no feasible structure: no worker or group can hold the model")
    best = cands[0]
    present = frozenset(workers)

    def chosen(why: str) -> tuple[Structure, GroupState, str]:
        # the groups that stay keep their shapes (their stages hold the compiled kernels)
        s = evaluate(blocks, workers, total, best.groups, kept=state.shapes) or best
        return s, GroupState(s.groups, round_, present, s.shapes), why

    if state.current is None:
        return chosen("start")
    current = None
    if all(w in present for g in state.current for w in g):
        current = evaluate(blocks, workers, total, state.current, kept=state.shapes)
    if current is None:
        return chosen("forced")
    if present - state.pool:
        return chosen("joined")
    kept = replace(state, pool=present, shapes=current.shapes)
    if (best.groups, best.shapes) == (current.groups, current.shapes):
        return current, kept, "keep"
    # Another structure, or the same groups in other shapes (cuts, micro-batch: new compiles):
    # both only for the gain the hysteresis asks, after its period.
    waited = state.changed_at is None or round_ - state.changed_at >= cfg.period
    cost = switch_cost(workers, best.shapes, current.shapes, cfg)
    gain = best.tau + cost / max(1, cfg.horizon) <= cfg.keep * current.tau
    if waited and gain:
        return best, GroupState(best.groups, round_, present, best.shapes), "regroup"
    return current, kept, "keep"
