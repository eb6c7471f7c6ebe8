"""One round of the dpmp controller: structure (with hysteresis), participation and split under
the Lyapunov budgets, as the decisions an engine with replicas will carry out.

:func:`plan_round` takes the planner's facts (blocks, workers) and the controller's state, and
returns a :class:`RoundPlan`: one :class:`ReplicaSpec` per working replica (members in stage
order, cuts, micro-batch, in-flight caps, batch) with a generation number that changes only when
the structure does, the idle workers, the predicted round and why the structure is what it is.
:func:`end_round` feeds back what the round took and cost. Both are pure; :class:`DpmpConfig`
is passed to every call, so ``V``, the budgets and the hysteresis change live.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

from policies.dpmp.costs import Block, WorkerSpec
from policies.dpmp.groups import GroupConfig, GroupState, Structure, decide, evaluate
from policies.dpmp.lyapunov import (
    LyapunovConfig,
    LyapunovState,
    choose,
    observe,
    structure_options,
)

Key = tuple[tuple[int, ...], tuple[int, ...], int]  # (members in stage order, cuts, micro)


def _keys(structure: Structure) -> set[Key]:
    return {(r.members, r.cuts, r.micro) for r in structure.replicas}


@dataclass(frozen=True, slots=True)
class ReplicaSpec:
    """What the engine sends a replica's stages (``stage{...}`` and ``step{...}`` on the wire)."""

    replica: int  # the id of its first stage's worker
    gen: int
    members: tuple[int, ...]  # stage order
    cuts: tuple[int, ...]
    micro: int
    inflight: tuple[int, ...]
    batch: int  # samples this round: a whole number of micro-batches but perhaps the last


@dataclass(frozen=True, slots=True)
class RoundPlan:
    replicas: tuple[ReplicaSpec, ...]
    idle: tuple[int, ...]
    tau: float  # s, predicted round
    reason: str  # "start" | "forced" | "regroup" | "keep"
    option: str  # the participation option the controller chose


@dataclass(frozen=True, slots=True)
class DpmpConfig:
    groups: GroupConfig = field(default_factory=GroupConfig)
    lyapunov: LyapunovConfig = field(default_factory=LyapunovConfig)


@dataclass(frozen=True, slots=True)
class DpmpState:
    groups: GroupState = field(default_factory=GroupState)
    lyapunov: LyapunovState = field(default_factory=LyapunovState)
    round: int = 0
    gen: int = 0  # the structure's generation
    gens: Mapping[Key, int] = field(default_factory=dict)  # replica -> its generation


def plan_round(
    blocks: Sequence[Block],
    workers: Mapping[int, WorkerSpec],
    total: int,
    state: DpmpState,
    cfg: DpmpConfig = DpmpConfig(),
) -> tuple[RoundPlan, DpmpState]:
    """This round's plan. Raises ValueError when no structure is feasible."""
    structure, groups, reason = decide(
        blocks, workers, total, state.groups, state.round, cfg.groups
    )
    options = structure_options(blocks, workers, total, structure)
    option, lyap = choose(options, state.lyapunov, cfg.lyapunov)
    chosen = structure if option.groups == structure.groups else None
    if chosen is None:
        chosen = evaluate(blocks, workers, total, option.groups, kept=structure.shapes)
        assert chosen is not None  # a subset of a feasible structure is feasible
    # A replica keeps its generation while its members, order, cuts and micro-batch stay, even
    # through rounds the budget leaves it out; anything else is a new generation.
    gens = {k: v for k, v in state.gens.items() if k in _keys(structure)}
    gen = state.gen
    specs = []
    for r, b in zip(chosen.replicas, chosen.split.sizes, strict=True):
        key = (r.members, r.cuts, r.micro)
        if key not in gens:
            gen += 1
            gens[key] = gen
        specs.append(
            ReplicaSpec(r.members[0], gens[key], r.members, r.cuts, r.micro, r.inflight, b)
        )
    busy = {w for s in specs for w in s.members}
    plan = RoundPlan(
        tuple(specs),
        tuple(sorted(w for w in workers if w not in busy)),
        chosen.tau,
        reason,
        option.label,
    )
    return plan, replace(state, groups=groups, lyapunov=lyap, gen=gen, gens=gens)


def end_round(state: DpmpState, cfg: DpmpConfig, tau: float, costs: Sequence[float]) -> DpmpState:
    """The state after a round that took ``tau`` s and cost ``costs`` (realised)."""
    lyap = observe(state.lyapunov, cfg.lyapunov, tau, costs)
    return replace(state, lyapunov=lyap, round=state.round + 1)
