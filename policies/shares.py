"""Heterogeneity-aware batch shares: LB-BSP and H-PS (docs/policies.md).

Both keep a synchronous aggregate and a fixed global batch ``B`` but size each worker's batch so that
all finish a round together, from per-worker timing models ``T_i(b) = a_i + c_i·b`` fitted to the
pushes (EWMA moments, least squares; the model and the split are :mod:`policies.finish`). H-PS adds
a memory cap per worker, a one-round lead for pipelined workers and a per-worker codec chosen from
the measured link speed.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from types import MappingProxyType

# Timing is also policies.shares.Timing, the name checkpoints written before policies.finish give it
from policies.finish import Timing, quantized
from policies.registry import register
from policies.types import (
    Buffer,
    ClusterView,
    Decision,
    Event,
    Flush,
    Join,
    Leave,
    Policy,
    Push,
    Release,
    SetPlan,
    Tick,
)

# Codec per bit width for flexible quantization (H-PS §8.3): the integer widths round
# stochastically (unbiased, QSGD-like, per-tensor max-norm scale); 1 bit is sign + scale, which
# stands in for the paper's 2 (we ship no 2-bit packing) [D].
BITS_CODECS: Mapping[int, str] = MappingProxyType(
    {32: "none", 16: "bf16", 8: "int8:stochastic=true", 4: "int4:stochastic=true", 1: "sign"}
)


def choose_bits(
    budget_s: float, latency_s: float, fp32_bytes: float, link_bps: float, options: Sequence[int]
) -> int:
    """The largest bit width whose push fits ``budget_s``: ``lat + (q/32)·bytes/bw ≤ budget``; the
    smallest option when none fits."""
    for q in sorted(options, reverse=True):
        if latency_s + (q / 32) * fp32_bytes / link_bps <= budget_s:
            return q
    return min(options)


@dataclass(frozen=True, slots=True)
class SharesState:
    """Timing models, current batches (samples), codec bits, the last re-plan's imbalance and the
    workers already told to pipeline."""

    timing: Mapping[int, Timing]
    batches: Mapping[int, int]
    bits: Mapping[int, int]
    imbalance: float = 1.0  # predicted max T / min T at the last plan
    piped: frozenset[int] = frozenset()  # workers whose plan says ``pipeline`` (lead > 0)


@dataclass(frozen=True, slots=True)
class SharesConfig:
    """Parameters of the batch-share planner."""

    global_batch: int | None  # None: the view's global batch
    b_min: int
    eps: float  # hysteresis: re-plan only when predicted imbalance exceeds 1 + eps
    lead: int  # rounds a worker may run ahead (0: BSP, 1: H-PS pipelining)
    mem_per_sample: float | None  # bytes per sample for the memory cap (None: no cap)
    rho: float  # fraction of free memory a batch may use
    quantize: bool
    bits_options: tuple[int, ...]
    comm_min_s: float
    latency_s: float
    quantum: int = 0  # batch sizes are multiples of this (0: automatic); bounds recompilation


def _caps(cfg: SharesConfig, view: ClusterView, workers: Sequence[int], total: int) -> list[int]:
    caps = []
    for w in workers:
        cap = total
        mem = view.workers[w].free_mem
        if cfg.mem_per_sample and mem is not None:
            cap = min(cap, max(cfg.b_min, math.floor(cfg.rho * mem / cfg.mem_per_sample)))
        caps.append(cap)
    return caps


def _plan(
    cfg: SharesConfig, state: SharesState, view: ClusterView, force: bool
) -> tuple[list[Decision], SharesState]:
    workers = sorted(view.workers)
    if not workers:
        return [], state
    total = cfg.global_batch or view.global_batch
    fits = [state.timing.get(w, Timing()).fit() for w in workers]
    known = [f for f in fits if f is not None]
    c_mean = sum(f[1] for f in known) / len(known) if known else 1.0
    a = [f[0] if f else 0.0 for f in fits]
    c = [f[1] if f else c_mean for f in fits]
    current = [state.batches.get(w, max(1, total // len(workers))) for w in workers]
    times = [a[i] + c[i] * current[i] for i in range(len(workers))]
    imbalance = max(times) / max(1e-12, min(times))
    caps = _caps(cfg, view, workers, total)
    over_cap = any(current[i] > caps[i] for i in range(len(workers)))
    force = force or sum(current) != total  # the global batch changed, or was never met
    if not force and not over_cap and imbalance <= 1 + cfg.eps:
        return [], state
    lo = [min(cfg.b_min, caps[i]) for i in range(len(workers))]
    sizes = quantized(total, a, c, lo, caps, cfg.quantum)
    new_round = max(a[i] + c[i] * sizes[i] for i in range(len(workers)))
    # Hysteresis: move samples only when the predicted round gets shorter by more than eps.
    if not force and not over_cap and new_round > max(times) * (1 - cfg.eps):
        return [], state
    out: list[Decision] = []
    batches = dict(state.batches)
    bits = dict(state.bits)
    tau = max(a[i] + c[i] * sizes[i] for i in range(len(workers)))
    # The round lasts about τ plus the fastest full-precision push; a worker's push must fit what
    # is left of it after its compute (and, when pipelined, may also overlap the next step).
    comm32 = [
        cfg.latency_s + f.push_bytes * 32 / bits.get(w, 32) / f.link_bps
        for w, f in view.workers.items()
        if f.link_bps and f.push_bytes
    ]
    round_s = tau + (min(comm32) if comm32 else 0.0)
    for i, w in enumerate(workers):
        fields: dict[str, object] = {}
        if state.batches.get(w) != sizes[i]:
            fields["batch_size"] = sizes[i]
        batches[w] = sizes[i]
        f = view.workers[w]
        if cfg.quantize and f.link_bps and f.push_bytes:
            fp32 = f.push_bytes * 32 / bits.get(w, 32)
            own = a[i] + c[i] * sizes[i]
            budget = max(round_s - own + (own if cfg.lead else 0.0), cfg.comm_min_s)
            q = choose_bits(budget, cfg.latency_s, fp32, f.link_bps, cfg.bits_options)
            if bits.get(w, 32) != q:
                fields.update(codec=BITS_CODECS[q], bits=q)
            bits[w] = q
        if cfg.lead:
            fields["pipeline"] = True
        if fields:
            out.append(SetPlan(w, fields))
    new_times = [a[i] + c[i] * sizes[i] for i in range(len(workers))]
    return out, SharesState(
        MappingProxyType(dict(state.timing)),
        MappingProxyType(batches),
        MappingProxyType(bits),
        max(new_times) / max(1e-12, min(new_times)),
        state.piped | frozenset(workers) if cfg.lead else state.piped,
    )


def shares_policy(name: str, cfg: SharesConfig, params: Mapping[str, object]) -> Policy:
    """A synchronous aggregate with batch shares (the body of ``lbbsp`` and ``hps``)."""

    def init(view: ClusterView) -> SharesState:
        timing = {
            w: Timing().add(f.batch_size, f.compute_s)
            for w, f in view.workers.items()
            if f.compute_s is not None
        }
        batches = {w: f.batch_size for w, f in view.workers.items()}
        return SharesState(
            MappingProxyType(timing), MappingProxyType(batches), MappingProxyType({})
        )

    def update(
        event: Event, state: SharesState, view: ClusterView
    ) -> tuple[Sequence[Decision], SharesState]:
        out: list[Decision] = []
        lo = view.min_clock()
        if isinstance(event, Push):
            out.append(Buffer(float(event.samples), group=view.workers[event.worker].clock))
            t = dict(state.timing)
            t[event.worker] = t.get(event.worker, Timing()).add(event.samples, event.compute_s)
            state = replace(state, timing=MappingProxyType(t))
        if isinstance(event, Leave):
            state = replace(
                state,
                batches=MappingProxyType(
                    {w: b for w, b in state.batches.items() if w != event.worker}
                ),
                piped=state.piped - {event.worker},
            )
        # Round r (pushes whose clock is r) is complete once every active worker reached r.
        if (
            view.workers
            and isinstance(event, Push | Leave | Tick)
            and (view.buffered or isinstance(event, Push))
        ):
            out.append(Flush(normalize=True, upto=lo))
        # Re-size between rounds only: when this event completes a round, or the set changes.
        round_done = isinstance(event, Push) and view.workers[event.worker].clock == lo
        if round_done or isinstance(event, Join | Leave):
            decisions, state = _plan(cfg, state, view, force=isinstance(event, Join | Leave))
            out.extend(decisions)
        if cfg.lead and not view.workers.keys() <= state.piped:
            # A worker no plan has told to pipeline yet: a policy built on a running cluster (a
            # swap, the real bench's t = 0) whose batches need no re-plan would otherwise never
            # say it, and its workers would run without the lead.
            new = sorted(view.workers.keys() - state.piped)
            out.extend(SetPlan(w, {"pipeline": True}) for w in new)
            state = replace(state, piped=state.piped | frozenset(new))
        out.extend(
            Release(w) for w, f in view.workers.items() if f.waiting and f.clock - lo <= cfg.lead
        )
        return out, state

    return Policy(name, init, update, params)


def _check(global_batch: int | None, b_min: int, eps: float, quantum: int = 1) -> None:
    if not isinstance(quantum, int) or quantum < 0:
        raise ValueError(f"quantum must be an int >= 0 (0: automatic), got {quantum!r}")
    if global_batch is not None and (not isinstance(global_batch, int) or global_batch < 1):
        raise ValueError(f"global_batch must be a positive int, got {global_batch!r}")
    if not isinstance(b_min, int) or b_min < 1:
        raise ValueError(f"b_min must be an int >= 1, got {b_min!r}")
    if not eps >= 0:
        raise ValueError(f"eps must be >= 0, got {eps!r}")


@register("lbbsp")
def lbbsp(
    global_batch: int | None = None, b_min: int = 4, eps: float = 0.05, quantum: int = 0
) -> Policy:
    """LB-BSP (Chen et al., SoCC 2020): BSP with the global batch fixed and each worker's batch
    sized between rounds so all finish together; weights ``b_i/B``."""
    _check(global_batch, b_min, eps, quantum)
    cfg = SharesConfig(global_batch, b_min, eps, 0, None, 0.8, False, (32,), 0.005, 0.002, quantum)
    params = {"global_batch": global_batch, "b_min": b_min, "eps": eps, "quantum": quantum}
    return shares_policy("lbbsp", cfg, params)


@register("hps")
def hps(
    global_batch: int | None = None,
    b_min: int = 4,
    eps: float = 0.05,
    mem_per_sample: float = 4e6,
    rho: float = 0.8,
    pipeline: bool = True,
    quantize: bool = True,
    bits: Sequence[int] = (32, 16, 8, 4),
    comm_min_s: float = 0.005,
    latency_s: float = 0.002,
    quantum: int = 0,
) -> Policy:
    """H-PS (Xian et al., IEEE Access 2021): LB-BSP shares capped by each worker's free memory
    (``b_i ≤ ρ·free_mem_i / mem_per_sample``), a one-round lead so pipelined workers compute the next
    step while the last one is in flight, and per-worker bits chosen from the measured link speed."""
    _check(global_batch, b_min, eps, quantum)
    if not mem_per_sample > 0 or not 0 < rho <= 1:
        raise ValueError("mem_per_sample must be > 0 and 0 < rho <= 1")
    bad = [q for q in bits if isinstance(q, bool) or not isinstance(q, int) or q not in BITS_CODECS]
    if bad or not bits:
        raise ValueError(f"bits must be drawn from {sorted(BITS_CODECS)}, got {list(bits)}")
    cfg = SharesConfig(
        global_batch,
        b_min,
        eps,
        1 if pipeline else 0,
        mem_per_sample,
        rho,
        quantize,
        tuple(bits),
        comm_min_s,
        latency_s,
        quantum,
    )
    params = {
        "global_batch": global_batch,
        "b_min": b_min,
        "eps": eps,
        "mem_per_sample": mem_per_sample,
        "rho": rho,
        "pipeline": pipeline,
        "quantize": quantize,
        "bits": list(bits),
        "comm_min_s": comm_min_s,
        "latency_s": latency_s,
        "quantum": quantum,
    }
    return shares_policy("hps", cfg, params)
