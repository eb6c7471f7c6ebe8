"""``hetd bench``: every policy × seed on one scenario, learning rates chosen fairly, and the outputs.

Owns :class:`BenchOptions`, :func:`run_bench` (the loop over policies and seeds with a progress bar,
``--tune-lr``), :func:`ideal_tta` (docs/benchmark.md's perfectly balanced, zero-wait lower bound) and
:func:`write_outputs` (``results.json``, ``summary.md``, PNGs — the last two in
:mod:`hetd.bench.plots`). A run is the :data:`Runner` it is given
(:func:`hetd.bench.suites.runner_for`): ``--mode sim`` (:func:`hetd.sim.loop.run_sim`, virtual
time) or ``--mode real`` (:func:`hetd.bench.real.run_real`, a real daemon and real worker
processes); both give the same :class:`~hetd.sim.results.RunResult`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import numpy as np
from tqdm import tqdm

from hetd.sim.results import PolicySpec, RunResult, check_results, summarize
from hetd.sim.scenario import Scenario

Runner = Callable[[Scenario, PolicySpec, int, float, Callable[[float], None]], RunResult]
"""(scenario, policy, seed, lr, on_time) -> one run's result."""


@dataclass(frozen=True)
class BenchOptions:
    """What ``hetd bench`` takes."""

    scenario: Scenario
    policies: tuple[PolicySpec, ...]
    out: Path
    seeds: int = 3  # seeds 0 .. seeds-1
    mode: str = "sim"  # sim | real
    tune_lr: bool = False  # pick each policy's lr on seed 0 from lr_grid, then freeze it
    lr: float | None = None  # one lr for every policy (default: the scenario's)
    lr_grid: tuple[float, ...] | None = None  # default: the scenario's lr_grid
    quiet: bool = False
    links: str = "emulated"  # real mode: emulated (the worker sleeps) | netns (hetd.bench.links)
    evals: str = (
        "deferred"  # real mode: deferred (evaluated after the run) | live (hetd.bench.real)
    )


def _better(a: RunResult, b: RunResult) -> bool:
    """Whether ``a`` beats ``b``: reached the target sooner, or higher final accuracy."""

    def key(r: RunResult) -> tuple[float, float]:
        return (math.inf if r.tta_s is None else r.tta_s, -r.final_accuracy)

    return key(a) < key(b)


def run_bench(opts: BenchOptions, run: Runner) -> dict[str, Any]:
    """Run every policy × seed with ``run`` (the run function of ``opts.mode``), write the outputs
    to ``opts.out``, return the results document."""
    sc = opts.scenario
    grid = tuple(opts.lr_grid or sc.lr_grid) if opts.tune_lr else ()
    n_runs = len(opts.policies) * (opts.seeds + len(grid) - (1 if grid else 0))
    bar = tqdm(
        total=round(n_runs * sc.budget_s, 3),
        disable=opts.quiet,
        unit="s",
        desc=f"{sc.name} {opts.mode}",
        bar_format="{l_bar}{bar}| {n:.0f}/{total:.0f} {unit} [{elapsed}<{remaining}] {postfix}",
    )
    done = 0.0  # seconds of finished runs, for the bar
    cache: dict[tuple[str, int, float], RunResult] = {}

    def one(policy: PolicySpec, seed: int, lr: float) -> RunResult:
        nonlocal done
        key = (policy.label, seed, lr)
        if opts.mode == "sim" and key in cache:  # deterministic: the tuning run is seed 0's run
            return cache[key]
        bar.set_postfix_str(f"{policy.label} seed {seed} lr {lr:g}")

        def on_time(t: float) -> None:
            bar.update(done + min(t, sc.budget_s) - bar.n)  # tqdm limits the redraw rate

        result = run(sc, policy, seed, lr, on_time)
        done += sc.budget_s
        bar.update(done - bar.n)
        cache[key] = result
        return result

    runs: list[RunResult] = []
    try:
        for policy in opts.policies:
            lr = opts.lr if opts.lr is not None else sc.lr
            if grid:
                trials = [one(policy, 0, g) for g in grid]
                best = trials[0]
                for t in trials[1:]:
                    if _better(t, best):
                        best = t
                lr = best.lr
            runs.extend(one(policy, seed, lr) for seed in range(opts.seeds))
    finally:
        bar.close()
    lrs = sorted({r.lr for r in runs})
    ideal = ideal_tta(sc, lrs, range(opts.seeds))
    doc = {"runs": [r.to_json() for r in runs], "summary": summarize(runs, {sc.name: ideal})}
    write_outputs(opts.out, doc, runs, sc, opts.mode)
    return doc


def throughput_at(sc: Scenario, t: float) -> float:
    """Σ over the workers in the run at time ``t`` (churn: joined, not left) of samples/s:
    nominal speed, stragglers' long-run mean included, communication free."""
    per_sample = sc.base_step_s / sc.base_batch
    everyone = sc.all_workers
    return sum(
        1.0 / (per_sample * sc.slowdown_at(i, t) * everyone[i].stragglers.mean_factor())
        for i in sc.present_at(t)
    )


def time_for_samples(sc: Scenario, samples: float) -> float:
    """Seconds for the whole cluster, perfectly balanced, to process ``samples`` samples."""
    times = [s.time(sc.budget_s) for s in sc.shifts] + [e.at_s for e in sc.events]
    cuts = sorted({t for t in times if t > 0})
    t, left = 0.0, samples
    for cut in [*cuts, math.inf]:
        rate = throughput_at(sc, t)
        if left <= rate * (cut - t):
            return t + left / rate
        left -= rate * (cut - t)
        t = cut
    return math.inf  # unreachable: the last piece is unbounded


def ideal_tta(sc: Scenario, lrs: Sequence[float], seeds: Sequence[int]) -> float | None:
    """docs/benchmark.md: samples one process needs to reach the target (global batch, the best of
    the learning rates in use, median over seeds) / Σ worker throughput. None if one process
    never gets there within 200 epochs, and None for a loss target (``target_loss``: the
    single-process count is measured against accuracy only, so far)."""
    from hetd.sim.compute import samples_to_target, scenario_compute

    if sc.target_loss > 0:
        return None

    counts = []
    for seed in seeds:
        data, model, compute = scenario_compute(sc, seed)
        init = model.init(jax.random.PRNGKey(seed), data.input_shape)
        best = [
            samples_to_target(
                compute,
                {k: np.asarray(v) for k, v in init.items()},
                data,
                batch=sc.global_batch,
                lr=lr,
                optimizer=sc.optimizer,
                target=sc.target_accuracy,
                seed=seed,
                max_samples=200 * len(data.y_train),
            )
            for lr in lrs
        ]
        reached = [b for b in best if b is not None]
        counts.append(min(reached) if reached else math.inf)
    med = float(np.median(counts)) if counts else math.inf
    return time_for_samples(sc, med) if math.isfinite(med) else None


def write_outputs(
    out: Path, doc: dict[str, Any], runs: Sequence[RunResult], sc: Scenario, mode: str
) -> None:
    """``results.json`` (checked against its schema first), ``summary.md`` and the PNGs."""
    from hetd.bench import plots as benchplots

    check_results(doc)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(doc, indent=1) + "\n")
    (out / "summary.md").write_text(benchplots.summary_markdown(doc, sc, mode))
    benchplots.plot_accuracy(out / "accuracy.png", runs, sc)
    benchplots.plot_timeline(out / "timeline.png", runs, sc)
    benchplots.plot_shares(out / "batch_shares.png", runs, sc)
    benchplots.plot_pareto(out / "pareto.png", runs, sc)
