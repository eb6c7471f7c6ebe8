"""What a person reads after ``hetd bench``: ``summary.md`` and four PNG plots.

Owns :func:`summary_markdown` (the table), :func:`plot_accuracy` (test accuracy vs time, the
median over seeds, one line per policy), :func:`plot_timeline` (per-worker compute /
communication / waiting, seed 0 of each policy), :func:`plot_shares` (each worker's share of
the global batch over time) and :func:`plot_pareto` (time against bytes to target). Everything is computed from the runs; nothing reads a clock.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from hetd.sim.results import RunResult
from hetd.sim.scenario import Scenario

MAX_ROWS = 16  # workers drawn in the timeline (the first ones)


def _fmt(x: float | None, spec: str = ".2f") -> str:
    return "–" if x is None else format(x, spec)


def _evals_line(runs: list[dict[str, Any]]) -> list[str]:
    """Real mode: how each run evaluated (``--evals``); nothing in sim mode."""
    modes = {r["evals"] for r in runs if "evals" in r}
    if not modes:
        return []
    if modes == {"deferred"}:
        return [
            "* evaluations deferred: the parameters at each evaluation were kept and evaluated "
            "after the run (no CPU taken from it)"
        ]
    if modes == {"live"}:
        return ["* evaluations live: the daemon evaluated during the run (its CPU included)"]
    each = ", ".join(sorted({f"{r['policy']} {r['evals']}" for r in runs if "evals" in r}))
    return [f"* evaluations: {each} (live: a policy that reads the evaluations' loss)"]


def summary_markdown(doc: dict[str, Any], sc: Scenario, mode: str) -> str:
    """The summary table (one row per policy) with the scenario above it."""
    runs = doc["runs"]
    slow = ", ".join(f"{w.slowdown:g}" for w in sc.workers[:12]) + (", …" if sc.n > 12 else "")
    lines = [
        f"# hetd bench: {sc.name} ({mode})",
        "",
        f"{sc.description}".strip(),
        "",
        f"* data `{sc.dataset}`, model `{sc.model}` {dict(sc.model_kwargs) or ''}, "
        f"optimizer {sc.optimizer}, global batch {sc.global_batch} ({sc.batch_per_worker} per worker)",
        f"* {sc.n} workers, slow-downs [{slow}]; base step {sc.base_step_s:g} s per "
        f"{sc.base_batch} samples; {len(sc.shifts)} regime shift(s)",
        f"* target {sc.target_text}, budget {sc.budget_s:g} s "
        f"({'virtual' if mode == 'sim' else 'wall'}), evaluation every {sc.eval_interval_s:g} s "
        "(not charged)",
        f"* seeds: {sorted({r['seed'] for r in runs})}",
        *_evals_line(runs),
        "",
        "| policy | lr | reached | TTA median (s) | TTA IQR (s) | speed-up vs BSP | TTA / ideal "
        "| final acc. (median) | samples/s | staleness mean / p95 | idle (mean) | MB up / down "
        "| KB per push / pull | MB to target (median) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in doc["summary"]:
        mine = [r for r in runs if r["policy"] == row["policy"]]
        reached = sum(r["tta_s"] is not None for r in mine)
        ideal = row["tta_ideal_s"]
        ratio = row["tta_median_s"] / ideal if ideal and row["tta_median_s"] else None
        idle = [float(np.mean(list(r["idle_fraction"].values()))) for r in mine]
        lines.append(
            f"| {row['policy']} | {_lrs(mine)} | {reached}/{len(mine)} "
            f"| {_fmt(row['tta_median_s'])} | {_fmt(row['tta_iqr_s'])} "
            f"| {_fmt(row['speedup_vs_bsp'])} | {_fmt(ratio)} "
            f"| {row['final_accuracy_median']:.4f} "
            f"| {np.median([r['samples_per_s'] for r in mine]):.0f} "
            f"| {np.median([r['staleness_mean'] for r in mine]):.2f} / "
            f"{np.median([r['staleness_p95'] for r in mine]):.1f} "
            f"| {np.median(idle):.2f} "
            f"| {np.median([r['bytes_up'] for r in mine]) / 1e6:.0f} / "
            f"{np.median([r['bytes_down'] for r in mine]) / 1e6:.0f} "
            f"| {np.median([r['bytes_up'] / max(1, r['pushes']) for r in mine]) / 1e3:.1f} / "
            f"{np.median([r['bytes_down'] / max(1, r['releases']) for r in mine]) / 1e3:.1f} "
            f"| {_fmt(_mb(row.get('bytes_to_target_median')), '.1f')} |"
        )
    switched = [r for r in runs if r["stages"]]
    if switched:
        lines += [
            "",
            "Stage switches (s): "
            + "; ".join(
                f"{r['policy']} seed {r['seed']}: "
                + ", ".join(f"{stage} {t:.2f}" for t, stage in r["stages"])
                for r in switched
            ),
        ]
    ideal = doc["summary"][0]["tta_ideal_s"] if doc["summary"] else None
    lines += [
        "",
        f"TTA ideal = {_fmt(ideal, '.3f')} s: the samples one process needs to reach the target "
        "(global batch, best lr in use, median over seeds) divided by the workers' summed "
        "throughput — perfect balance, no waiting, free communication (docs/benchmark.md).",
        "Speed-up vs BSP = BSP's median TTA / the policy's. Medians over seeds; a seed that never "
        "reaches the target counts as infinitely slow. TTA is read between evaluations "
        "(linear). Idle = time the worker's device did not compute (waiting for a release or "
        "its link). "
        "MB to target = bytes pushed plus pulled, all workers, until the target was reached "
        "(– when the runner does not record them, or the median seed never reached it).",
        "",
        "Files: `results.json`, `accuracy.png` (median accuracy vs time), `timeline.png` "
        "(seed 0, per-worker compute / communication / waiting), `batch_shares.png`, "
        "`pareto.png` (TTA against bytes to target, per policy).",
        "",
    ]
    return "\n".join(lines)


def _mb(x: float | None) -> float | None:
    return None if x is None else x / 1e6


def _lrs(runs: Sequence[dict[str, Any]]) -> str:
    return ", ".join(f"{v:g}" for v in sorted({r["lr"] for r in runs}))


def _policies(runs: Sequence[RunResult]) -> list[str]:
    seen: list[str] = []
    for r in runs:
        if r.policy not in seen:
            seen.append(r.policy)
    return seen


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_accuracy(path: Path, runs: Sequence[RunResult], sc: Scenario) -> None:
    """Test accuracy vs time: per policy, the median over seeds of the step-held curves."""
    plt = _pyplot()
    grid = np.linspace(0.0, sc.budget_s, 400)
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for policy in _policies(runs):
        held = []
        for r in (r for r in runs if r.policy == policy):
            if not r.curve:
                continue
            t = np.array([c[0] for c in r.curve])
            acc = np.array([c[1] for c in r.curve])
            pos = np.searchsorted(t, grid, side="right") - 1
            held.append(np.where(pos >= 0, acc[np.clip(pos, 0, None)], np.nan))
        if held:
            seeds = len(held)
            ax.plot(grid, np.nanmedian(np.array(held), axis=0), label=f"{policy} ({seeds} seeds)")
    ax.axhline(sc.target_accuracy, color="grey", ls="--", lw=0.8, label="target")
    ax.set_xlabel("time (s)")
    ax.set_ylabel("test accuracy (median over seeds)")
    ax.set_title(f"{sc.name}: accuracy vs time")
    ax.set_ylim(max(0.0, sc.target_accuracy - 0.3), 1.0)
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _window(runs: Sequence[RunResult], sc: Scenario) -> float:
    """A time window that shows individual steps: ~25 of the slowest worker's nominal steps."""
    slowest = max(sc.slowdown_at(i, 0.0) for i in range(sc.n))
    step = sc.base_step_s * sc.batch_per_worker / sc.base_batch * slowest
    return min(sc.budget_s, max(25 * step, 1e-3))


def plot_timeline(path: Path, runs: Sequence[RunResult], sc: Scenario) -> None:
    """Per worker (rows), seed 0 of each policy (panels): compute, communication, waiting."""
    plt = _pyplot()
    policies = _policies(runs)
    window = _window(runs, sc)
    rows = min(len(sc.all_workers), MAX_ROWS)  # joiners below the initial workers
    fig, axes = plt.subplots(
        len(policies), 1, figsize=(8, 0.6 + (0.25 * rows + 0.6) * len(policies)), squeeze=False
    )
    colors = {"compute": "tab:green", "busy": "tab:green", "comm": "tab:orange"}
    for ax, policy in zip(axes[:, 0], policies, strict=True):
        r = min((r for r in runs if r.policy == policy), key=lambda r: r.seed)
        for row in range(rows):
            spans = r.trace.timeline.get(str(row), [])
            for kind, color in colors.items():
                bars = [
                    (t0, min(t1, window) - t0)
                    for t0, t1, k in spans
                    if k == kind and t0 < window and t1 > t0
                ]
                ax.broken_barh(bars, (row - 0.4, 0.8), facecolors=color, lw=0)
            idle = r.idle_fraction.get(str(row))
            if idle is not None:
                ax.text(window * 1.005, row, f"idle {idle:.0%}", va="center", fontsize=6)
        ax.set_xlim(0, window)
        ax.set_ylim(rows - 0.5, -0.5)
        ax.set_yticks(range(rows))
        labels = [f"w{i} x{sc.all_workers[i].slowdown:g}" for i in range(rows)]
        ax.set_yticklabels(labels, fontsize=6)
        kinds = {k for spans in r.trace.timeline.values() for _, _, k in spans}
        what = (
            "green busy (compute and transfers), blank waiting for a release"
            if "busy" in kinds
            else "green compute, orange communication, blank waiting for a release"
        )
        ax.set_title(f"{policy} (seed {r.seed}): {what}", fontsize=8)
    axes[-1, 0].set_xlabel(
        f"time (s), first {window:g} s"
        + (f"; first {rows} of {sc.n} workers" if rows < sc.n else "")
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_shares(path: Path, runs: Sequence[RunResult], sc: Scenario) -> None:
    """Each worker's share of the global batch over time (seed 0 of each policy)."""
    plt = _pyplot()
    policies = _policies(runs)
    fig, axes = plt.subplots(
        len(policies), 1, figsize=(7, 0.6 + 2.2 * len(policies)), squeeze=False
    )
    for ax, policy in zip(axes[:, 0], policies, strict=True):
        r = min((r for r in runs if r.policy == policy), key=lambda r: r.seed)
        if r.trace.shares:
            t = [s[0] for s in r.trace.shares]
            workers = sorted(r.trace.shares[0][1], key=int)
            ys = [[s[1].get(w, math.nan) for s in r.trace.shares] for w in workers]
            ax.stackplot(t, ys, labels=[f"w{w}" for w in workers])
            if len(workers) <= 8:
                ax.legend(loc="upper right", fontsize=6, ncol=len(workers))
        ax.set_ylim(0, 1)
        ax.set_xlim(0, sc.budget_s)
        ax.set_ylabel("batch share")
        ax.set_title(f"{policy} (seed {r.seed})", fontsize=8)
    axes[-1, 0].set_xlabel("time (s)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_pareto(path: Path, runs: Sequence[RunResult], sc: Scenario) -> None:
    """Time to target against bytes to target (pushed plus pulled): one small dot per seed, a
    large one at each policy's medians; the points nearest the origin are the Pareto front.
    Seeds that never reached the target (or whose bytes were not recorded) are left out and
    counted in the legend."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for policy in _policies(runs):
        mine = [r for r in runs if r.policy == policy]
        pts = [
            (b / 1e6, r.tta_s)
            for r in mine
            if r.tta_s is not None and (b := r.bytes_to_target) is not None
        ]
        missing = len(mine) - len(pts)
        label = policy + (f" ({missing} of {len(mine)} not reached)" if missing else "")
        if not pts:
            ax.plot([], [], "o", label=label)
            continue
        xs, ys = zip(*pts, strict=True)
        (line,) = ax.plot(xs, ys, "o", ms=3, alpha=0.5)
        ax.plot(
            [float(np.median(xs))],
            [float(np.median(ys))],
            "o",
            ms=9,
            color=line.get_color(),
            label=label,
        )
    ax.set_xscale("log")
    ax.set_xlabel("MB pushed + pulled until the target (log)")
    ax.set_ylabel("time to target (s)")
    ax.set_title(f"{sc.name}: time vs bytes to target {sc.target_accuracy:g}")
    ax.legend(loc="best", fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
