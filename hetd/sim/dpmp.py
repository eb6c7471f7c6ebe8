"""Batch time of DP-only against DP+MP (pipeline replicas of memory-poor workers), by event
simulation of every micro-batch.

The planner (:mod:`policies.dpmp`) predicts a replica's round as ``a + c·b``; this module charges
the same structure event by event to check that prediction and to give the "batch time
reduction" figure for a scenario:

* :func:`pipeline_makespan` runs one replica's step: each stage worker is one compute resource
  (forward = 1/3 and backward = 2/3 of its fwd+bwd time), each worker's uplink and downlink a FIFO
  resource with its latency, activations relayed by the head (two hops, up then down); each
  stage runs the fixed 1F1B order of :func:`policies.dpmp.costs.stage_order` for its in-flight
  cap (the planner's: ``S − s`` or more to hide the relay's round trip);
* :func:`round_time` is the BSP round of a structure: every replica pulls its slices, runs its
  share, pushes; the round ends with the last replica (rounds are sequential, as the engine's
  flush makes them); a pipeline shape's first round also takes its slowest member's compile
  (``Scenario.compile_s``, as the engine's simulator charges a shape's first step);
* :func:`compare` gives, per scenario, BSP (equal shares over the workers that can hold the
  model), DP-only with equal-finish shares (LB-BSP) and the best DP+MP structure, each as the
  median simulated round over ``rounds`` rounds whose worker speeds jitter by ``±jitter``, next to
  the planner's prediction.

Memory is *declared* (``WorkerSpec.mem_bytes``): memory-poor workers are emulated, and a
structure that breaks a stage's memory is never formed. :func:`budget_run` runs the Lyapunov
controller (:mod:`policies.dpmp.lyapunov`) against a money budget on simulated rounds. Run
``python -m hetd.sim.dpmp`` for the table of the built-in scenarios and a sweep of ``V``.
"""

from __future__ import annotations

import dataclasses
import random
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from policies.dpmp.costs import RHO, Block, ReplicaCost, WorkerSpec, need_full, stage_order
from policies.dpmp.groups import Shape, Structure, candidates, evaluate
from policies.dpmp.lyapunov import LyapunovConfig, LyapunovState, choose, observe, structure_options


def pipeline_makespan(
    blocks: Sequence[Block],
    group: Sequence[WorkerSpec],
    cuts: Sequence[int],
    micro: int,
    micro_batches: int,
    caps: Sequence[int] = (),
) -> float:
    """Seconds from the first forward to the last backward of ``micro_batches`` micro-batches;
    stage ``s`` holds at most ``caps[s]`` (default ``S − s``) micro-batches in flight."""
    n = len(group)
    cap_of = list(caps) if caps else [n - s for s in range(n)]
    taus = [w.taus(blocks) for w in group]
    t = [micro * sum(taus[s][cuts[s] : cuts[s + 1]]) for s in range(n)]
    fwd = [x / 3 for x in t]
    bwd = [2 * x / 3 for x in t]
    act = [micro * blocks[cuts[s + 1] - 1].act_bytes for s in range(n - 1)]  # bytes at cut s
    link_free: dict[tuple[int, str], float] = {}

    def hop(now: float, w: int, way: str, size: float) -> float:
        spec = group[w]
        bw = spec.bw_up if way == "up" else spec.bw_down
        start = max(now, link_free.get((w, way), 0.0))
        done = start + size / bw
        link_free[(w, way)] = done
        return done + spec.lat_s

    orders = [stage_order(cap_of[s] if s < n - 1 else 1, micro_batches) for s in range(n)]
    arrived: dict[tuple[int, str, int], float] = {(0, "F", mb): 0.0 for mb in range(micro_batches)}
    nxt = [0] * n
    free_at = [0.0] * n
    end = 0.0
    # Each stage runs its fixed 1F1B order; of the stages whose next task's input is in, the one
    # that can start first goes next (so events are processed in time order).
    while any(nxt[s] < len(orders[s]) for s in range(n)):
        best: tuple[float, int] | None = None
        for s in range(n):
            if nxt[s] < len(orders[s]):
                kind, mb = orders[s][nxt[s]]
                ready = arrived.get((s, kind, mb))
                if ready is not None and (best is None or max(free_at[s], ready) < best[0]):
                    best = (max(free_at[s], ready), s)
        if best is None:  # pragma: no cover - a 1F1B order never waits on itself
            raise RuntimeError("pipeline schedule stalled")
        start, s = best
        kind, mb = orders[s][nxt[s]]
        nxt[s] += 1
        if kind == "F":
            finish = start + fwd[s]
            if s == n - 1:  # the last stage turns straight into its backward
                arrived[(s, "B", mb)] = finish
            else:
                arrived[(s + 1, "F", mb)] = hop(hop(finish, s, "up", act[s]), s + 1, "down", act[s])
        else:
            finish = start + bwd[s]
            if s > 0:
                arrived[(s - 1, "B", mb)] = hop(
                    hop(finish, s, "up", act[s - 1]), s - 1, "down", act[s - 1]
                )
        free_at[s] = finish
        end = max(end, finish)
    return end


def replica_round(
    blocks: Sequence[Block], workers: Mapping[int, WorkerSpec], r: ReplicaCost, batch: int
) -> float:
    """Pull, ``batch`` samples as whole micro-batches (the last padded), push; 0 for no work."""
    if batch <= 0:
        return 0.0
    big_m = -(-batch // r.micro)
    group = [workers[w] for w in r.members]
    return step_time(blocks, group, r.cuts, r.micro, big_m, r.inflight)


def step_time(
    blocks: Sequence[Block],
    group: Sequence[WorkerSpec],
    cuts: Sequence[int],
    micro: int,
    micro_batches: int,
    caps: Sequence[int] = (),
) -> float:
    """One replica step from release to its last push: every stage pulls its slice of the
    parameters (blocks ``[cuts[s], cuts[s+1])``), the pipeline runs ``micro_batches``
    micro-batches of ``micro`` samples, every stage pushes its slice's gradient. The engine's
    simulator charges a pipeline replica's steps with it (:mod:`hetd.sim.replicas`)."""
    slices = [sum(b.param_bytes for b in blocks[cuts[s] : cuts[s + 1]]) for s in range(len(group))]
    pull = max(w.lat_s + p / w.bw_down for w, p in zip(group, slices, strict=True))
    push = max(w.lat_s + p / w.bw_up for w, p in zip(group, slices, strict=True))
    return pull + pipeline_makespan(blocks, group, cuts, micro, micro_batches, caps) + push


def round_time(
    blocks: Sequence[Block],
    workers: Mapping[int, WorkerSpec],
    structure: Structure,
    compiled: set[tuple[int, Shape]] | None = None,
) -> float:
    """The BSP round of ``structure``: its slowest replica. With ``compiled`` (the
    (worker, pipeline shape) pairs compiled so far, updated here), a pipeline replica whose
    member runs its shape for the first time takes that member's ``compile_s`` longer, as
    the engine's simulator charges its first step (:mod:`hetd.sim.replicas`)."""
    return max(
        replica_round(blocks, workers, r, b) + _compile(workers, r, compiled)
        for r, b in zip(structure.replicas, structure.split.sizes, strict=True)
    )


def _compile(
    workers: Mapping[int, WorkerSpec], r: ReplicaCost, compiled: set[tuple[int, Shape]] | None
) -> float:
    """Seconds replica ``r``'s stages compile before its step (0 for data parallel)."""
    if compiled is None or len(r.members) < 2:
        return 0.0
    shape = (tuple(r.members), tuple(r.cuts), r.micro)
    fresh = [w for w in r.members if (w, shape) not in compiled]
    compiled.update((w, shape) for w in fresh)
    return max((workers[w].compile_s or 0.0 for w in fresh), default=0.0)


# --- scenarios -----------------------------------------------------------------------------------


def mlp_blocks(dims: Sequence[int] = (784, 512, 512, 512, 10)) -> list[Block]:
    """An MLP's blocks (one per Dense layer, fp32), FLOPs proportional to parameters."""
    out = []
    for j in range(len(dims) - 1):
        p = dims[j] * dims[j + 1] + dims[j + 1]
        out.append(Block(f"dense{j}", 4.0 * p, 4.0 * dims[j + 1], float(p)))
    return out


@dataclass(frozen=True, slots=True)
class Scenario:
    """Workers as (slow-down, memory-poor, link bytes/s); ``t0`` s/sample at slow-down 1."""

    name: str
    workers: tuple[tuple[float, bool, float], ...]
    batch: int = 512
    t0: float = 1e-3
    lat_s: float = 2e-3
    poor_fraction: float = 0.6  # a memory-poor worker's usable memory, of the whole model's need
    compile_s: float = 1.0  # s a worker takes to compile a pipeline stage shape new to it

    def specs(self, blocks: Sequence[Block]) -> dict[int, WorkerSpec]:
        full = need_full(blocks, 32)
        return {
            i: WorkerSpec(
                i,
                self.t0 * slow,
                mem_bytes=self.poor_fraction * full / RHO if poor else 1e12,
                bw_up=bw,
                bw_down=bw,
                lat_s=self.lat_s,
                compile_s=self.compile_s,
            )
            for i, (slow, poor, bw) in enumerate(self.workers)
        }


MB = 1e6
SCENARIOS: dict[str, Scenario] = {
    "A": Scenario(
        "A comm-heavy",
        ((1, False, 100 * MB), (1, False, 100 * MB), (2, False, 100 * MB))
        + ((2, True, 100 * MB),) * 2,
        t0=0.25e-3,
    ),
    "B": Scenario(
        "B main",
        ((1, False, 100 * MB), (1, False, 100 * MB), (2, False, 100 * MB))
        + ((2, True, 100 * MB),) * 2,
    ),
    "C": Scenario(
        "C poor on 2 MB/s",
        ((1, False, 100 * MB), (1, False, 100 * MB), (2, False, 100 * MB))
        + ((2, True, 2 * MB),) * 2,
    ),
    "D": Scenario(
        "D mostly poor",
        ((1, False, 100 * MB), (2, False, 100 * MB), (1, True, 100 * MB), (1, True, 100 * MB))
        + ((2, True, 100 * MB),) * 2,
    ),
    "E": Scenario("E homogeneous", ((1, False, 100 * MB),) * 4),
}


@dataclass(frozen=True, slots=True)
class Figures:
    """One scenario's median simulated round (s) per method, and the DP+MP prediction."""

    scenario: str
    bsp: float
    lbbsp: float
    dpmp: float
    predicted: float  # the planner's τ* of the DP+MP structure
    structure: str

    @property
    def reduction(self) -> float:
        """Batch time reduction of DP+MP against DP-only (LB-BSP)."""
        return 1 - self.dpmp / self.lbbsp


def _jittered(
    workers: Mapping[int, WorkerSpec], rng: random.Random, jitter: float
) -> dict[int, WorkerSpec]:
    return {
        w: dataclasses.replace(s, sample_s=s.sample_s * (1 + rng.uniform(-jitter, jitter)))
        for w, s in workers.items()
    }


def compare(
    sc: Scenario,
    blocks: Sequence[Block] | None = None,
    rounds: int = 30,
    jitter: float = 0.1,
    seed: int = 0,
    from_round: int = 0,
) -> Figures:
    """BSP, LB-BSP and DP+MP on ``sc``: each round plans on the nominal speeds (what the
    profile says) and runs on speeds jittered by ±``jitter``; medians over rounds
    ``from_round .. rounds - 1``."""
    if not 0 <= from_round < rounds:
        raise ValueError(f"from_round must be in [0, {rounds}), got {from_round}")
    blocks = list(blocks or mlp_blocks())
    workers = sc.specs(blocks)
    capable = tuple((w,) for w, s in workers.items() if RHO * s.mem_bytes >= need_full(blocks, 32))
    dp = evaluate(blocks, workers, sc.batch, capable)
    if dp is None:
        raise ValueError(f"scenario {sc.name}: no worker can hold the model")
    best = candidates(blocks, workers, sc.batch)[0]
    even = sc.batch // len(capable)
    bsp_sizes = tuple(
        even + (1 if i < sc.batch - even * len(capable) else 0) for i in range(len(capable))
    )
    bsp = dataclasses.replace(dp, split=dataclasses.replace(dp.split, sizes=bsp_sizes))
    rng = random.Random(seed)
    times: dict[str, list[float]] = {"bsp": [], "lbbsp": [], "dpmp": []}
    compiled: set[tuple[int, Shape]] = set()  # the first round compiles the pipelines' stages
    for _ in range(rounds):
        now = _jittered(workers, rng, jitter)
        times["bsp"].append(round_time(blocks, now, bsp))
        times["lbbsp"].append(round_time(blocks, now, dp))
        times["dpmp"].append(round_time(blocks, now, best, compiled))
    med = {k: statistics.median(v[from_round:]) for k, v in times.items()}
    return Figures(sc.name, med["bsp"], med["lbbsp"], med["dpmp"], best.tau, best.describe())


@dataclass(frozen=True, slots=True)
class BudgetRun:
    """A Lyapunov-controlled run: time-averaged simulated round and money against the budget."""

    v: float
    budget: float  # money per round
    unconstrained: float  # money per round of the fastest structure
    tau: float  # s, mean simulated round
    fastest_tau: float  # s, mean simulated round of the fastest structure alone
    money: float  # mean money per round
    max_queue: float


PRICES_B = (3.0, 3.0, 1.0, 0.5, 0.5)


def budget_run(
    sc: Scenario,
    prices: Sequence[float] = PRICES_B,
    budget_fraction: float = 0.8,
    v: float = 10.0,
    rounds: int = 1000,
    jitter: float = 0.1,
    seed: int = 0,
) -> BudgetRun:
    """Scenario ``sc`` with per-worker ``prices`` (per busy second) and a money budget of
    ``budget_fraction`` of what the fastest structure costs per round: each round the controller
    picks a structure (the fastest, or it without its dearest replicas), the round is simulated
    on jittered speeds, and its realised time and money update the queue."""
    blocks = mlp_blocks()
    workers = {
        w: dataclasses.replace(spec, price=prices[w]) for w, spec in sc.specs(blocks).items()
    }
    best = candidates(blocks, workers, sc.batch)[0]
    options = structure_options(blocks, workers, sc.batch, best)
    built = {
        o.groups: evaluate(blocks, workers, sc.batch, o.groups, kept=best.shapes) for o in options
    }
    full = options[0].costs[0]
    cfg = LyapunovConfig(v=v, budgets=(budget_fraction * full,))
    state, top, fastest = LyapunovState(), 0.0, 0.0
    rng = random.Random(seed)
    compiled: set[tuple[int, Shape]] = set()  # a shape's first round compiles its stages
    for _ in range(rounds):
        option, state = choose(options, state, cfg)
        structure = built[option.groups]
        assert structure is not None
        now = _jittered(workers, rng, jitter)
        tau = round_time(blocks, now, structure, compiled)
        fastest += round_time(blocks, now, best)
        busy = [w for r in structure.replicas for w in r.members]
        state = observe(state, cfg, tau, [tau * sum(workers[w].price for w in busy)])
        top = max(top, state.queues[0])
    mean_tau, (money,) = state.averages()
    return BudgetRun(v, cfg.budgets[0], full, mean_tau, fastest / rounds, money, top)


def main() -> None:  # pragma: no cover - a report
    print(
        f"{'scenario':<18} {'BSP':>8} {'LB-BSP':>8} {'DP+MP':>8} {'pred':>8} {'Δ LB-BSP':>9}  structure"
    )
    for key in sorted(SCENARIOS):
        f = compare(SCENARIOS[key])
        print(
            f"{f.scenario:<18} {f.bsp * 1e3:8.1f} {f.lbbsp * 1e3:8.1f} {f.dpmp * 1e3:8.1f} "
            f"{f.predicted * 1e3:8.1f} {-f.reduction:+9.1%}  {f.structure}"
        )
    print(f"\nbudget run: scenario B, prices {list(PRICES_B)}, budget 80 % of the fastest's")
    print(f"{'V':>6} {'τ ms':>8} {'fastest':>8} {'cost/budget':>12} {'max Q':>7}")
    for v in (1, 3, 10, 30, 100):
        b = budget_run(SCENARIOS["B"], v=v)
        print(
            f"{v:6g} {b.tau * 1e3:8.1f} {b.fastest_tau * 1e3:8.1f} {b.money / b.budget:12.3f} "
            f"{b.max_queue:7.1f}"
        )


if __name__ == "__main__":  # pragma: no cover
    main()
