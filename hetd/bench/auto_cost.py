"""What ``auto``'s planning costs the daemon: one planning round timed on a cluster of N workers.

A planning round (:func:`hetd.core.planner.plan`) runs every candidate forward by the timing twin
on a snapshot of the cluster, in a thread of the daemon's process; the daemon lets rounds take at
most :data:`hetd.server.planning.CPU_SHARE` of one core over time (a round that took ``c`` CPU
seconds holds the next one back ``c / CPU_SHARE`` seconds), so what is measured here says how
often a round can run within that budget, and what share of one core one round every ``every_s``
takes.

The cluster is built from numbers, as a daemon's view holds them after its workers' first pushes:
``n`` workers of slow-downs cycling through :data:`SLOWDOWNS` (10 ms per 32 samples at 1), each on
a 1 GB/s link pushing the 0.2 M-parameter MLP's 814 KB frames, every worker waiting for its
release. Each round is timed by the planner's own clock (``time.thread_time``: this thread's CPU,
so other processes on the machine do not count), ``repeats`` times; the median is reported.

Run ``python -m hetd.bench.auto_cost [--workers 4,16] [--every 30] [--repeats 3]``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Sequence
from typing import Any

from hetd.core.planner import PlannerConfig, parse_candidates, plan
from hetd.server.planning import CPU_SHARE
from policies.efficiency import for_optimizer
from policies.types import ClusterView, WorkerFacts

SLOWDOWNS = (1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
STEP_S, BATCH = 0.01, 32  # s per step of BATCH samples at slow-down 1
PUSH_BYTES = 814_500.0  # the MLP of S1 (784-256-10), float32
LINK_BPS = 1e9


def cluster(n: int) -> ClusterView:
    """``n`` timed workers, every one waiting for its release (see the module docstring)."""
    if n < 1:
        raise ValueError(f"a cluster needs at least one worker, got {n}")
    workers = {}
    for i in range(n):
        s = SLOWDOWNS[i % len(SLOWDOWNS)]
        step = STEP_S * s
        workers[i] = WorkerFacts(
            worker=i,
            name=f"w{i}",
            clock=10,
            version=10,
            waiting=True,
            joined_at=0.0,
            last_push_at=1.0,
            prev_push_at=1.0 - step - 2 * PUSH_BYTES / LINK_BPS,
            compute_s=step,
            sample_s=step / BATCH,
            push_bytes=PUSH_BYTES,
            link_bps=LINK_BPS,
            samples=10 * BATCH,
            batch_size=BATCH,
        )
    return ClusterView(now=1.0, version=10, workers=workers, global_batch=BATCH * n)


def measure(n: int, repeats: int = 3, optimizer: str = "sgd") -> dict[str, Any]:
    """One planning round over auto's default candidates on :func:`cluster` (``n``), ``repeats``
    times: its CPU seconds (median, min, max), the candidates forecast and those refused."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    view = cluster(n)
    config = PlannerConfig(default_batch=BATCH, efficiency=for_optimizer(optimizer))
    candidates = parse_candidates(None)
    costs = []
    forecast = refused = None
    for _ in range(repeats):
        planned = plan(view, candidates, config, time.thread_time)
        costs.append(planned.forecast.cost_s)
        forecast, refused = planned.forecast, planned.refused
    assert forecast is not None and refused is not None  # repeats >= 1
    return {
        "workers": n,
        "candidates": len(forecast.predictions),
        "refused": [c for c, _ in refused],
        "cost_s": statistics.median(costs),
        "cost_min_s": min(costs),
        "cost_max_s": max(costs),
        "horizon_s": config.horizon_s,
        "horizon_rounds": config.horizon_rounds,
    }


def line(rec: dict[str, Any], every_s: float) -> str:
    """One record as the bench prints it: the round's CPU, its share of one core at one round
    every ``every_s``, and the shortest interval the daemon's CPU budget allows."""
    cost = float(rec["cost_s"])
    return (
        f"auto planning, {rec['workers']} workers, {rec['candidates']} candidates "
        f"(horizon {rec['horizon_s']:g} s / {rec['horizon_rounds']} rounds): "
        f"{cost:.3f} s CPU a round [{rec['cost_min_s']:.3f}-{rec['cost_max_s']:.3f}]; "
        f"one round every {every_s:g} s takes {100 * cost / every_s:.2f} % of one core; "
        f"the daemon's budget ({100 * CPU_SHARE:g} % of a core) allows one every "
        f"{cost / CPU_SHARE:.1f} s at the most"
    )


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m hetd.bench.auto_cost [--workers 4,16] [--every 30] [--repeats 3]``."""
    ap = argparse.ArgumentParser(prog="python -m hetd.bench.auto_cost", description=__doc__)
    ap.add_argument("--workers", default="4,16", help="comma-separated cluster sizes")
    ap.add_argument("--every", type=float, default=30.0, help="s between rounds (the default)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--optimizer", default="sgd", help="the workers' optimizer (efficiency)")
    args = ap.parse_args(argv)
    try:
        sizes = [int(x) for x in args.workers.split(",") if x.strip()]
    except ValueError:
        ap.error(f"--workers takes comma-separated integers, got {args.workers!r}")
    if not args.every > 0:
        ap.error(f"--every must be > 0 s, got {args.every}")
    if args.repeats < 1 or not sizes or min(sizes) < 1:
        ap.error("--repeats and every --workers size must be >= 1")
    for n in sizes:
        print(line(measure(n, args.repeats, args.optimizer), args.every), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
