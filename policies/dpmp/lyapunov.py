"""The drift-plus-penalty controller: keep time-averaged costs within budgets while keeping the
round time low.

Each round (a *slot*) the controller is offered :class:`Option` s, each a predicted round time
``τ`` and predicted costs ``C_k`` (money for busy seconds, head bytes, ...), and picks the one
minimising

    V·τ/T_ref + Σ_k Q_k·C_k/C̄_k + V·switch_s/(H·T_ref)

where ``Q_k`` is the virtual queue of constraint ``k`` (average ``C_k ≤ C̄_k``). After the round
the *realised* costs update the queues, ``Q_k ← max(0, Q_k + C_k/C̄_k − 1)``. A budget of ``inf``
switches its constraint off (its queue stays 0). :class:`LyapunovConfig` holds ``V`` and the
budgets; it is passed to every call, so changing it between rounds changes the controller live.

:func:`structure_options` turns a structure (:mod:`policies.dpmp.groups`) into options that
differ in participation: the structure, then repeatedly without the replica of the worst price
per throughput. The costs are ``C_1 = τ·Σ price`` of the participating workers (they are held for
the round) and ``C_2`` = head bytes: parameter pulls and pushes plus relayed activations and
their gradients, two hops each.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

from policies.dpmp.costs import Block, WorkerSpec
from policies.dpmp.groups import Groups, Structure, evaluate


@dataclass(frozen=True, slots=True)
class Option:
    """One candidate decision for a slot."""

    label: str
    tau: float  # s, predicted round time
    costs: tuple[float, ...]  # predicted C_k per round
    switch_s: float = 0.0  # s it costs to move to it (0 for the current structure)
    groups: Groups = ()


@dataclass(frozen=True, slots=True)
class LyapunovConfig:
    """``V`` weighs the round time against the queues; ``budgets[k]`` is ``C̄_k`` per round."""

    v: float = 10.0
    budgets: tuple[float, ...] = ()
    horizon: int = 50  # H: rounds a switch's cost is amortised over

    def __post_init__(self) -> None:
        if not (self.v > 0 and math.isfinite(self.v)):
            raise ValueError(f"V must be a positive finite number, got {self.v}")
        if any(not b > 0 for b in self.budgets):
            raise ValueError(f"budgets must be > 0 (inf: no constraint), got {self.budgets}")
        if self.horizon < 1:
            raise ValueError(f"horizon must be >= 1, got {self.horizon}")


@dataclass(frozen=True, slots=True)
class LyapunovState:
    """Queues and running sums (what a checkpoint keeps)."""

    queues: tuple[float, ...] = ()
    t_ref: float | None = None  # s, the first slot's best predicted round time
    rounds: int = 0
    tau_sum: float = 0.0
    cost_sums: tuple[float, ...] = field(default=())

    def averages(self) -> tuple[float, tuple[float, ...]]:
        """Time-averaged realised round time and costs so far."""
        n = max(1, self.rounds)
        return self.tau_sum / n, tuple(c / n for c in self.cost_sums)


def _queues(state: LyapunovState, k: int) -> tuple[float, ...]:
    return state.queues + (0.0,) * (k - len(state.queues))


def score(option: Option, state: LyapunovState, cfg: LyapunovConfig, t_ref: float) -> float:
    """``V·τ/T_ref + Σ Q_k·C_k/C̄_k + V·switch/(H·T_ref)``."""
    q = _queues(state, len(cfg.budgets))
    s = cfg.v * (option.tau + option.switch_s / cfg.horizon) / t_ref
    for k, budget in enumerate(cfg.budgets):
        if math.isfinite(budget) and k < len(option.costs):
            s += q[k] * option.costs[k] / budget
    return s


def choose(
    options: Sequence[Option], state: LyapunovState, cfg: LyapunovConfig
) -> tuple[Option, LyapunovState]:
    """The option of least score (the first on ties); the state gains ``T_ref`` on first use."""
    if not options:
        raise ValueError("no options to choose from")
    if state.t_ref is None:
        state = replace(state, t_ref=min(o.tau for o in options))
    t_ref = state.t_ref if state.t_ref and state.t_ref > 0 else 1.0
    best = min(options, key=lambda o: score(o, state, cfg, t_ref))
    return best, state


def observe(
    state: LyapunovState, cfg: LyapunovConfig, tau: float, costs: Sequence[float]
) -> LyapunovState:
    """The state after a round that took ``tau`` and cost ``costs`` (realised)."""
    k = len(cfg.budgets)
    q = list(_queues(state, k))
    for i, budget in enumerate(cfg.budgets):
        if math.isfinite(budget) and i < len(costs):
            q[i] = max(0.0, q[i] + costs[i] / budget - 1.0)
        else:
            q[i] = 0.0
    sums = list(state.cost_sums) + [0.0] * (len(costs) - len(state.cost_sums))
    for i, c in enumerate(costs):
        sums[i] += c
    return replace(
        state,
        queues=tuple(q),
        rounds=state.rounds + 1,
        tau_sum=state.tau_sum + tau,
        cost_sums=tuple(sums),
    )


def round_costs(
    structure: Structure, blocks: Sequence[Block], workers: Mapping[int, WorkerSpec]
) -> tuple[float, float]:
    """``(C_1, C_2)`` of one round of ``structure``: money ``τ·Σ price`` of its workers, and head
    bytes (each replica pulls and pushes the model once; each cut relays its activations forward
    and their gradients back, two hops each, for every sample)."""
    busy = [w for r in structure.replicas for w in r.members]
    money = structure.tau * sum(workers[w].price for w in busy)
    model = sum(b.param_bytes for b in blocks)
    relayed = 0.0
    for r, b in zip(structure.replicas, structure.split.sizes, strict=True):
        if b == 0:
            continue
        relayed += 2 * model
        for cut in r.cuts[1:-1]:
            relayed += 4 * b * blocks[cut - 1].act_bytes
    return money, relayed


def structure_options(
    blocks: Sequence[Block],
    workers: Mapping[int, WorkerSpec],
    total: int,
    structure: Structure,
) -> list[Option]:
    """``structure`` and its participation variants: repeatedly drop the replica with the most
    price per sample of throughput, while one remains."""
    out = []
    current: Structure | None = structure
    while current is not None:
        label = current.describe()
        out.append(
            Option(label, current.tau, round_costs(current, blocks, workers), 0.0, current.groups)
        )
        if len(current.replicas) == 1:
            break

        def dear(i: int, s: Structure = current) -> float:
            r = s.replicas[i]
            return sum(workers[w].price for w in r.members) * r.per_sample_s

        worst = max(range(len(current.replicas)), key=dear)
        keep = tuple(tuple(sorted(r.members)) for i, r in enumerate(current.replicas) if i != worst)
        current = evaluate(blocks, workers, total, keep, kept=structure.shapes)
    return out
