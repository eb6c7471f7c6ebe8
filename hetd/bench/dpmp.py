"""``hetd bench --suite dpmp``: DP+MP (the ``dpmp`` planner's structure) against DP-only (LB-BSP)
on the simulator's scenarios B, C, D and E over seeds, plus the Lyapunov budget run and its sweep
of ``V``, judged against :data:`TARGETS`: DP+MP at least 15 % less batch time than LB-BSP on B and
45 % less on D, within 5 % of it on C and E, the planner's prediction on B within 15 % of the
simulated round, and the Lyapunov run's time-average cost within 5 % of its budget.

The metric is batch training time: the median simulated round from round ``from_round`` on
(:func:`hetd.sim.dpmp.compare`; virtual time, so the machine's load does not enter), per seed; a
scenario's figure is the median over seeds, and a target passes only when every seed meets it.
Writes OUT/dpmp.json, OUT/dpmp.md and OUT/dpmp_budget.png (the ``V`` sweep).
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hetd.sim.dpmp import PRICES_B, SCENARIOS, budget_run, compare

KEYS = ("B", "C", "D", "E")


@dataclass(frozen=True, slots=True)
class DpmpOptions:
    out: Path
    seeds: int = 3
    rounds: int = 60
    from_round: int = 20
    budget_rounds: int = 1000
    v: float = 10.0  # the budget run's V, judged against the target
    sweep: tuple[float, ...] = (1.0, 3.0, 10.0, 30.0, 100.0)


@dataclass(frozen=True, slots=True)
class _Target:
    name: str
    need: str
    value: Callable[[dict[str, Any]], list[float]]  # one figure per seed
    ok: Callable[[float], bool]
    badness: Callable[[float], float]  # the worst seed is the one with the largest


def _per_seed(key: str, field: str) -> Callable[[dict[str, Any]], list[float]]:
    return lambda doc: [float(r[field]) for r in doc["scenarios"][key]["seeds"]]


TARGETS = (
    _Target(
        "B: dpmp batch time vs lbbsp",
        "≥ 15 % less",
        _per_seed("B", "reduction"),
        lambda x: x >= 0.15,
        lambda x: -x,
    ),
    _Target(
        "B: measured / predicted",
        "within ±15 %",
        _per_seed("B", "measured_over_predicted"),
        lambda x: abs(x - 1) <= 0.15,
        lambda x: abs(x - 1),
    ),
    _Target(
        "D: dpmp batch time vs lbbsp",
        "≥ 45 % less",
        _per_seed("D", "reduction"),
        lambda x: x >= 0.45,
        lambda x: -x,
    ),
    _Target(
        "C: dpmp / lbbsp",
        "≤ 1.05",
        _per_seed("C", "dpmp_over_lbbsp"),
        lambda x: x <= 1.05,
        lambda x: x,
    ),
    _Target(
        "E: dpmp / lbbsp",
        "≤ 1.05",
        _per_seed("E", "dpmp_over_lbbsp"),
        lambda x: x <= 1.05,
        lambda x: x,
    ),
    _Target(
        "budget: time-average cost / budget",
        "within ±5 %",
        lambda doc: [float(r["cost_over_budget"]) for r in doc["budget"]["seeds"]],
        lambda x: abs(x - 1) <= 0.05,
        lambda x: abs(x - 1),
    ),
)


def _scenario(key: str, opts: DpmpOptions) -> dict[str, Any]:
    rows = []
    structure = ""
    for seed in range(opts.seeds):
        f = compare(SCENARIOS[key], rounds=opts.rounds, seed=seed, from_round=opts.from_round)
        structure = f.structure
        rows.append(
            {
                "seed": seed,
                "bsp_s": f.bsp,
                "lbbsp_s": f.lbbsp,
                "dpmp_s": f.dpmp,
                "predicted_s": f.predicted,
                "reduction": f.reduction,
                "dpmp_over_lbbsp": f.dpmp / f.lbbsp,
                "measured_over_predicted": f.dpmp / f.predicted,
            }
        )

    def med(field: str) -> float:
        return statistics.median(r[field] for r in rows)

    return {
        "name": SCENARIOS[key].name,
        "workers": [list(w) for w in SCENARIOS[key].workers],
        "structure": structure,
        "seeds": rows,
        **{
            k: med(k)
            for k in (
                "bsp_s",
                "lbbsp_s",
                "dpmp_s",
                "predicted_s",
                "reduction",
                "dpmp_over_lbbsp",
                "measured_over_predicted",
            )
        },
    }


def _budget(opts: DpmpOptions) -> dict[str, Any]:
    def one(v: float, seed: int) -> dict[str, Any]:
        b = budget_run(SCENARIOS["B"], v=v, rounds=opts.budget_rounds, seed=seed)
        return {
            "v": v,
            "seed": seed,
            "round_s": b.tau,
            "fastest_round_s": b.fastest_tau,
            "cost_over_budget": b.money / b.budget,
            "max_queue": b.max_queue,
        }

    seeds = [one(opts.v, s) for s in range(opts.seeds)]
    sweep = []
    for v in opts.sweep:
        runs = seeds if v == opts.v else [one(v, s) for s in range(opts.seeds)]
        sweep.append(
            {
                "v": v,
                **{
                    k: statistics.median(r[k] for r in runs)
                    for k in ("round_s", "fastest_round_s", "cost_over_budget", "max_queue")
                },
            }
        )
    return {
        "scenario": "B",
        "prices": list(PRICES_B),
        "budget_fraction": 0.8,
        "rounds": opts.budget_rounds,
        "v": opts.v,
        "seeds": seeds,
        "sweep": sweep,
    }


def run_dpmp(opts: DpmpOptions) -> dict[str, Any]:
    """Every scenario and the budget run over ``opts.seeds`` seeds; writes the JSON, Markdown
    and plot, and returns the document."""
    if opts.seeds < 1:
        raise ValueError(f"--seeds must be >= 1, got {opts.seeds}")
    doc: dict[str, Any] = {
        "suite": "dpmp",
        "seeds": opts.seeds,
        "rounds": opts.rounds,
        "from_round": opts.from_round,
        "scenarios": {key: _scenario(key, opts) for key in KEYS},
        "budget": _budget(opts),
    }
    targets = []
    for t in TARGETS:
        values = t.value(doc)
        targets.append(
            {
                "target": t.name,
                "need": t.need,
                "median": statistics.median(values),
                "worst": max(values, key=t.badness),
                "per_seed": values,
                "pass": all(t.ok(x) for x in values),
            }
        )
    doc["targets"] = targets
    doc["verdict"] = "pass" if all(t["pass"] for t in targets) else "miss"
    opts.out.mkdir(parents=True, exist_ok=True)
    (opts.out / "dpmp.json").write_text(json.dumps(doc, indent=1) + "\n")
    (opts.out / "dpmp.md").write_text(markdown(doc))
    plot_sweep(doc["budget"]["sweep"], opts.out / "dpmp_budget.png")
    return doc


def markdown(doc: dict[str, Any]) -> str:
    """The scenario table, the budget sweep and the targets."""
    n = doc["seeds"]
    lines = [
        f"# hetd bench --suite dpmp ({n} seed{'s' if n > 1 else ''}, sim)",
        "",
        f"Median simulated batch time (ms) of rounds {doc['from_round']}–{doc['rounds'] - 1}, "
        "median over seeds; dpmp is the planner's structure, lbbsp DP-only with equal-finish "
        "shares over the workers that can hold the model.",
        "",
        "| scenario | BSP | LB-BSP | dpmp | predicted | measured/predicted | Δ vs LB-BSP | structure |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for s in doc["scenarios"].values():
        lines.append(
            f"| {s['name']} | {s['bsp_s'] * 1e3:.1f} | {s['lbbsp_s'] * 1e3:.1f} | "
            f"{s['dpmp_s'] * 1e3:.1f} | {s['predicted_s'] * 1e3:.1f} | "
            f"{s['measured_over_predicted']:.3f} | {-s['reduction']:+.1%} | {s['structure']} |"
        )
    b = doc["budget"]
    lines += [
        "",
        f"Budget run: scenario B, prices {b['prices']} per busy second, budget "
        f"{b['budget_fraction']:.0%} of the fastest structure's cost, {b['rounds']} rounds "
        "(medians over seeds):",
        "",
        "| V | round ms | fastest alone ms | cost / budget | max queue |",
        "|---|---|---|---|---|",
    ]
    for r in b["sweep"]:
        lines.append(
            f"| {r['v']:g} | {r['round_s'] * 1e3:.1f} | {r['fastest_round_s'] * 1e3:.1f} | "
            f"{r['cost_over_budget']:.3f} | {r['max_queue']:.1f} |"
        )
    lines += ["", "| target | need | median | worst seed | verdict |", "|---|---|---|---|---|"]
    for t in doc["targets"]:
        spec = ".1%" if "less" in t["need"] else ".3f"
        lines.append(
            f"| {t['target']} | {t['need']} | {format(t['median'], spec)} | "
            f"{format(t['worst'], spec)} | "
            f"{'pass' if t['pass'] else 'miss'} |"
        )
    lines += ["", f"Verdict: {doc['verdict']}.", ""]
    return "\n".join(lines)


def plot_sweep(sweep: Sequence[dict[str, Any]], path: Path) -> None:
    """Time against cost over the ``V`` sweep, each point labelled with its ``V``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.5))
    xs = [r["cost_over_budget"] for r in sweep]
    ys = [r["round_s"] * 1e3 for r in sweep]
    ax.plot(xs, ys, marker="o")
    for r, x, y in zip(sweep, xs, ys, strict=True):
        ax.annotate(f"V={r['v']:g}", (x, y), textcoords="offset points", xytext=(4, 4))
    ax.axvline(1.0, color="grey", linestyle="--", linewidth=0.8)
    ax.set_xlabel("time-average cost / budget")
    ax.set_ylabel("mean round (ms)")
    ax.set_title("dpmp budget run, scenario B: the V trade-off")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
