"""The cost model of a replica and the search for its cuts.

A *replica* is one worker (data parallel, ``S = 1``) or an ordered group of workers, stage ``s``
on worker ``s``, holding blocks ``[k_s, k_{s+1})`` of a block-structured model. Its round time
for a batch ``b`` run as micro-batches of ``m`` is linear, ``T(b) = a + c·b``:

* the *units* ``u`` are the per-micro-batch times of the pipeline's stages: each stage's compute
  (forward + backward of its blocks) and each stage worker's uplink and downlink as their own
  pseudo-stages (a middle stage's uplink carries its forward output *and* its backward input
  gradient, both relayed by the head);
* ``T(M) = Σu + (M−1)·max u + Σlat + max pushpull``, so ``c = max u / m`` and ``a`` is the rest;
  a data-parallel replica's pull and push include its worker's fixed work per step
  (``WorkerSpec.step_s``: the head's and the host's handling of the step's frames, measured by
  the policy on data-parallel steps). A pipeline's is not added: its stages' speeds are
  calibrated on its measured steps, which carry its own.

:mod:`policies.dpmp.search` finds the cuts and order of a group under each stage's memory;
:func:`split_batch` shares a global batch across replicas so that they finish together, in whole
micro-batches; :func:`stage_order` is a stage's 1F1B order of tasks.

Units: bytes, seconds, bytes/s. No jax, numpy or clock.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from policies.finish import fluid_finish

RHO = 0.8  # the usable fraction of a worker's memory


@dataclass(frozen=True, slots=True)
class Block:
    """One block of the model: one array in, one array out."""

    name: str
    param_bytes: float  # P_j
    act_bytes: float  # A_j: its output's bytes per sample (what crosses a cut after it)
    flops: float  # F_j, relative compute (any unit; only shares matter)
    resid_bytes: float | None = None  # R_j: bytes per sample kept for the backward; None: A_j

    @property
    def residual(self) -> float:
        """Bytes per sample the block keeps between its forward and its backward."""
        return self.act_bytes if self.resid_bytes is None else self.resid_bytes


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    """What the planner knows of one worker."""

    wid: int
    sample_s: float  # s per sample, forward + backward of the whole model
    mem_bytes: float = math.inf  # its memory (RHO of it is usable)
    bw_up: float = math.inf  # bytes/s to the head
    bw_down: float = math.inf  # bytes/s from the head
    lat_s: float = 0.0  # one-way latency to the head
    price: float = 1.0  # cost per busy second
    block_s: tuple[float, ...] | None = None  # s per sample per block (an exact profile)
    stages: bool = True  # it can run a pipeline stage (a worker that did not say so cannot)
    step_s: float = 0.0  # s of fixed work per data-parallel step beyond compute and links
    compile_s: float | None = None  # s to compile a new stage shape's kernels (None: not measured)

    def taus(self, blocks: Sequence[Block]) -> list[float]:
        """s per sample of each block: the exact profile, else ``sample_s`` by FLOP share."""
        if self.block_s is not None:
            if len(self.block_s) != len(blocks):
                raise ValueError(
                    f"worker {self.wid}: {len(self.block_s)} block times for {len(blocks)} blocks"
                )
            return list(self.block_s)
        total = sum(b.flops for b in blocks)
        if total <= 0:
            raise ValueError("the blocks' flops must sum to > 0")
        return [self.sample_s * b.flops / total for b in blocks]


@dataclass(frozen=True, slots=True)
class ReplicaCost:
    """One replica's structure and its predicted round time ``a + c·b``."""

    members: tuple[int, ...]  # worker ids, stage order
    cuts: tuple[int, ...]  # 0 = k_0 < k_1 < ... < k_S = L
    micro: int  # m, samples per micro-batch
    units: tuple[float, ...]  # per-micro-batch times: stage computes, then link pseudo-stages
    fill_s: float  # a: Σu − period + Σlat + max pushpull
    per_sample_s: float  # c: period / m
    mem_need: tuple[float, ...]  # bytes per stage
    slice_bytes: tuple[float, ...]  # parameter bytes per stage
    inflight: tuple[int, ...] = ()  # micro-batches each stage may hold (residuals kept)

    @property
    def stages(self) -> int:
        return len(self.members)

    @property
    def bottleneck(self) -> float:
        """The slowest stage or link per micro-batch (what the cut search minimises)."""
        return max(self.units)

    @property
    def period(self) -> float:
        """s between micro-batches in steady state: the bottleneck, or a stage's round trip
        over its in-flight cap when memory keeps that cap too small to hide it."""
        return self.per_sample_s * self.micro

    def time(self, batch: float) -> float:
        """Predicted seconds from release to the last part's push for ``batch`` samples."""
        return self.fill_s + self.per_sample_s * batch


def need_full(blocks: Sequence[Block], micro: int) -> float:
    """Bytes a worker needs to train the whole model alone: parameters, gradients and one
    micro-batch's residuals."""
    return 2 * sum(b.param_bytes for b in blocks) + micro * sum(b.residual for b in blocks)


def memory_poor(w: WorkerSpec, blocks: Sequence[Block], micro: int) -> bool:
    """True when ``w`` cannot hold the whole model (it can only help as a stage)."""
    return RHO * w.mem_bytes < need_full(blocks, micro)


def stage_terms(
    blocks: Sequence[Block],
    taus: Sequence[float],
    w: WorkerSpec,
    i: int,
    j: int,
    s: int,
    n_stages: int,
    micro: int,
    inflight: int,
) -> tuple[tuple[float, float, float], float, float]:
    """Stage ``s`` holding blocks ``[i, j)`` on ``w``: its (compute, uplink, downlink) times per
    micro-batch, its memory need and its parameter bytes."""
    compute = micro * sum(taus[i:j])
    crossing = (blocks[i - 1].act_bytes if s > 0 else 0.0) + (
        blocks[j - 1].act_bytes if s < n_stages - 1 else 0.0
    )
    up = micro * crossing / w.bw_up if crossing else 0.0
    down = micro * crossing / w.bw_down if crossing else 0.0
    params = sum(b.param_bytes for b in blocks[i:j])
    mem = 2 * params + inflight * micro * sum(b.residual for b in blocks[i:j])
    return (compute, up, down), mem, params


def base_inflight(s: int, n_stages: int, micro_batches: int | None) -> int:
    cap = n_stages - s
    return cap if micro_batches is None else max(1, min(micro_batches, cap))


def replica_cost(
    blocks: Sequence[Block],
    group: Sequence[WorkerSpec],
    cuts: Sequence[int],
    micro: int,
    micro_batches: int | None = None,
) -> ReplicaCost:
    """The cost of ``group`` (stage order) with ``cuts`` and micro-batch ``micro``.

    Stage ``s`` may hold ``k_s`` micro-batches in flight: at least ``min(M, S − s)``, raised to
    ``⌈cycle_s / max u⌉`` as far as its memory allows, where ``cycle_s`` is one micro-batch's
    round trip from stage ``s``'s forward to its backward (downstream compute, relay hops both
    ways, their latencies). With fewer, the stage idles waiting for gradients: the steady-state
    period is then ``max(max u, max_s cycle_s / k_s)``."""
    n = len(group)
    if len(cuts) != n + 1 or cuts[0] != 0 or cuts[-1] != len(blocks):
        raise ValueError(f"cuts {tuple(cuts)} must run 0 .. {len(blocks)} with {n + 1} entries")
    if any(cuts[s] >= cuts[s + 1] for s in range(n)):
        raise ValueError(f"cuts {tuple(cuts)} must be strictly increasing (no empty stage)")
    if micro < 1:
        raise ValueError(f"micro-batch must be >= 1, got {micro}")
    computes: list[float] = []
    links: list[float] = []
    mems: list[float] = []
    slices: list[float] = []
    pushpull = 0.0
    for s, w in enumerate(group):
        (t, up, down), mem, params = stage_terms(
            blocks,
            w.taus(blocks),
            w,
            cuts[s],
            cuts[s + 1],
            s,
            n,
            micro,
            base_inflight(s, n, micro_batches),
        )
        computes.append(t)
        if n > 1:
            links += [up, down]
        mems.append(mem)
        slices.append(params)
        fixed = w.step_s if n == 1 else 0.0  # a pipeline's steps calibrate its stages
        pushpull = max(pushpull, fixed + 2 * w.lat_s + params / w.bw_up + params / w.bw_down)
    lat = sum(2 * (group[s].lat_s + group[s + 1].lat_s) for s in range(n - 1))
    units = tuple(computes + links)
    period = max(units)
    caps = [base_inflight(s, n, micro_batches) for s in range(n)]
    for s in range(n - 1):
        cycle = sum(computes[s:])
        for c in range(s, n - 1):
            size = micro * blocks[cuts[c + 1] - 1].act_bytes
            a, b = group[c], group[c + 1]
            cycle += size * (1 / a.bw_up + 1 / b.bw_down + 1 / b.bw_up + 1 / a.bw_down)
            cycle += 2 * (a.lat_s + b.lat_s)
        resid = micro * sum(blk.residual for blk in blocks[cuts[s] : cuts[s + 1]])
        room = RHO * group[s].mem_bytes - 2 * slices[s]
        allowed = room / resid if resid > 0 else math.inf
        allowed = math.floor(allowed) if math.isfinite(allowed) else allowed
        want = min(math.ceil(cycle / period - 1e-9) if period > 0 else 1, allowed)
        if micro_batches is not None:
            want = min(want, micro_batches)
        if want > caps[s]:
            mems[s] += (want - caps[s]) * resid
            caps[s] = int(want)
        period = max(period, cycle / caps[s])
    return ReplicaCost(
        members=tuple(w.wid for w in group),
        cuts=tuple(cuts),
        micro=micro,
        units=units,
        fill_s=sum(units) - period + lat + pushpull,
        per_sample_s=period / micro,
        mem_need=tuple(mems),
        slice_bytes=tuple(slices),
        inflight=tuple(caps),
    )


def fits(cost: ReplicaCost, group: Sequence[WorkerSpec]) -> bool:
    """Every stage's memory need within ``RHO`` of its worker's memory."""
    return all(need <= RHO * w.mem_bytes for need, w in zip(cost.mem_need, group, strict=True))


def stage_order(inflight: int, micro_batches: int) -> list[tuple[str, int]]:
    """A stage's 1F1B order of tasks (``("F" | "B", micro-batch)``) when it may hold
    ``inflight`` micro-batches: ``inflight − 1`` warm-up forwards, then forward and backward in
    turn, then the remaining backwards. The last stage (``inflight = 1``) alternates F, B. A
    fixed order (PipeDream's) rather than "a queued backward first": that priority drains every
    kept micro-batch before feeding the next and was up to 1.4x slower in event simulation."""
    if inflight < 1 or micro_batches < 0:
        raise ValueError(
            f"need inflight >= 1 and micro_batches >= 0, got {inflight}, {micro_batches}"
        )
    warm = min(inflight - 1, micro_batches)
    order = [("F", mb) for mb in range(warm)]
    for i in range(micro_batches - warm):
        order += [("F", warm + i), ("B", i)]
    order += [("B", mb) for mb in range(micro_batches - warm, micro_batches)]
    return order


def micro_batch(expected_share: float, stages: int, lo: int = 8, hi: int = 128) -> int:
    """A micro-batch for a replica expecting ``expected_share`` samples per round: the largest
    power of two ≤ share/(4·S) for a pipeline (so M ≥ 4S, small bubbles, few distinct shapes)
    and ≤ share/8 for a data-parallel replica (LB-BSP's quantum: the split balances within about
    an eighth of a share), clipped to [lo, hi]."""
    target = expected_share / (8 if stages <= 1 else 4 * stages)
    m = lo
    while m * 2 <= min(target, hi):
        m *= 2
    return max(lo, min(hi, m))


@dataclass(frozen=True, slots=True)
class Split:
    """Batch shares across replicas and the predicted round time."""

    sizes: tuple[int, ...]
    tau: float  # s, the latest predicted finish among replicas with work


def split_batch(
    total: int, replicas: Sequence[ReplicaCost], caps: Sequence[int] | None = None
) -> Split:
    """Share ``total`` samples across ``replicas`` so that their predicted finishes
    ``a_r + c_r·b_r`` are equal (the equal-finish LP solved by bisection on τ with bounds
    ``0 ≤ b_r ≤ cap_r``), then round to whole micro-batches: floors, then one micro-batch at a time
    to whoever finishes earliest with it; a remainder smaller than every micro-batch goes to the
    replica that finishes earliest with it (its last micro-batch padded). ``Σ b_r = total``; a
    replica too slow to be worth any work gets 0. Raises ValueError if the caps cannot hold it."""
    n = len(replicas)
    if n == 0:
        raise ValueError("no replicas to share the batch")
    hi = list(caps) if caps is not None else [total] * n
    if sum(hi) < total:
        raise ValueError(f"the replicas' caps {hi} hold {sum(hi)} samples, fewer than {total}")
    a = [r.fill_s for r in replicas]
    c = [r.per_sample_s for r in replicas]
    x = fluid_finish(total, a, c, [0.0] * n, hi, iters=200)
    out = [min(hi[i], replicas[i].micro * math.floor(x[i] / replicas[i].micro)) for i in range(n)]
    rest = total - sum(out)

    def finish(i: int, extra: int) -> float:
        return a[i] + c[i] * (out[i] + extra)

    while rest > 0:
        room = [
            i for i in range(n) if replicas[i].micro <= rest and out[i] + replicas[i].micro <= hi[i]
        ]
        if room:
            i = min(room, key=lambda k: (finish(k, replicas[k].micro), k))
            out[i] += replicas[i].micro
            rest -= replicas[i].micro
            continue
        room = [i for i in range(n) if out[i] + rest <= hi[i]]
        if not room:  # caps force single samples wherever there is room
            i = min((k for k in range(n) if out[k] < hi[k]), key=lambda k: (finish(k, 1), k))
            out[i] += 1
            rest -= 1
            continue
        i = min(room, key=lambda k: (finish(k, rest), k))
        out[i] += rest
        rest = 0
    tau = max((a[i] + c[i] * out[i] for i in range(n) if out[i] > 0), default=0.0)
    return Split(tuple(out), tau)
