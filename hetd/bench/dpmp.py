"""``hetd bench --suite dpmp``: DP+MP (the ``dpmp`` policy) against DP-only (``lbbsp``) on the
memory-poor scenarios B, C, D and E, three ways side by side, plus the Lyapunov budget run and its
sweep of ``V``, judged against :data:`TARGETS`.

The three columns of each scenario's batch time (a round of the global batch):

* *pipeline*: the pipeline event simulator (:func:`hetd.sim.dpmp.compare`): the planner's
  structure charged micro-batch by micro-batch, the median simulated round from round
  ``from_round`` on; what the cost model predicts, beside the engine;
* *engine*: the engine's simulator (:func:`hetd.sim.loop.run_sim`) running the ``dpmp`` and
  ``lbbsp`` policies on the packaged scenarios ``B`` .. ``E`` (memory-poor workers through the
  worker ``memory`` key, a block-structured model), the median interval between the versions
  its rounds publish over the last two thirds of ``engine_budget_s`` virtual seconds; its
  pipeline replicas run as the daemon's replica driver runs them (:mod:`hetd.sim.replicas`);
* *real* (only with ``real``, it takes minutes): a real daemon and ``hetd-worker`` processes
  (:func:`hetd.bench.real.run_real`) for ``real_budget_s`` wall seconds; its batch time is the
  global batch over the samples per second measured from the run's warm start. The engine's
  simulator's figure for it is measured the same way (``engine_per_throughput_s``). The
  memory-poor workers run with ``--emulate-memory``: a whole-model step (a data-parallel step or
  a profile) that does not fit fails and the worker leaves, as in the engine's simulator, and
  they join at the run's t = 0 instead of warming up under bsp's whole-model steps; their
  pipeline stages run at their emulated slow-down and links.

The targets: in the engine's simulator, dpmp at least 15 % less batch time than lbbsp on B and
45 % less on D, and within 5 % of it on C and E; the engine's simulator within 15 % of the
pipeline simulator's batch time for dpmp on B and D; the pipeline simulator's own targets (the
same reductions, the planner's prediction on B within 15 % of its simulated round); the
Lyapunov run's time-average cost within 5 % of its budget; with ``real``: dpmp ahead of lbbsp on
B, and each real batch time within 1.3x of the engine's simulator's. Virtual time, so the
machine's load does not enter but in real mode; a scenario's figure is the median over seeds,
and a target passes only when every seed meets it. Writes OUT/dpmp.json, OUT/dpmp.md and
OUT/dpmp_budget.png (the ``V`` sweep).
"""

from __future__ import annotations

import itertools
import json
import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hetd.sim.dpmp import PRICES_B, SCENARIOS, budget_run, compare
from hetd.sim.results import PolicySpec, RunResult
from hetd.sim.scenario import Scenario, load_scenario, replace

KEYS = ("B", "C", "D", "E")
POLICIES = ("dpmp", "lbbsp")
SKIP = 1 / 3  # the engine's first third of the budget is warm-up (profiles, the first plans)

# One run of a policy on a scenario: (scenario, policy, seed) -> (result, versions as (t, v)).
EngineRun = Callable[[Scenario, PolicySpec, int], tuple[RunResult, list[tuple[float, int]]]]
RealRun = Callable[[Scenario, PolicySpec, int], RunResult]


@dataclass(frozen=True, slots=True)
class DpmpOptions:
    out: Path
    seeds: int = 3
    rounds: int = 60
    from_round: int = 20
    budget_rounds: int = 1000
    v: float = 10.0  # the budget run's V, judged against the target
    sweep: tuple[float, ...] = (1.0, 3.0, 10.0, 30.0, 100.0)
    engine: bool = True  # the engine's simulator's column
    engine_budget_s: float = 10.0  # virtual s per engine run
    real: bool = False  # the real daemon's column (minutes)
    real_seeds: int = 1
    real_budget_s: float = 20.0  # wall s per real run, from the warm start


def engine_sim(
    sc: Scenario, policy: PolicySpec, seed: int
) -> tuple[RunResult, list[tuple[float, int]]]:
    """One run of the engine's simulator: its result and the versions it published."""
    from hetd.sim.loop import run_sim

    run = run_sim(sc, policy, seed)
    return run.result, run.versions


def real_run(sc: Scenario, policy: PolicySpec, seed: int) -> RunResult:
    """One real run: a daemon and ``hetd-worker`` processes on loopback, links emulated."""
    from hetd.bench.real import run_real

    return run_real(sc, policy, seed, sc.lr, lambda t: None)


def round_s(versions: Sequence[tuple[float, int]], budget_s: float, skip: float = SKIP) -> float:
    """The median interval between published versions from ``skip`` of the budget on (a
    synchronous policy publishes one version per round); nan with fewer than two."""
    times = [t for t, _ in versions if t >= skip * budget_s]
    gaps = [b - a for a, b in itertools.pairwise(times)]
    return statistics.median(gaps) if gaps else math.nan


def per_throughput_s(result: RunResult, global_batch: int) -> float:
    """The global batch over the run's samples per second: a round's time as throughput says."""
    return global_batch / result.samples_per_s if result.samples_per_s > 0 else math.inf


@dataclass(frozen=True, slots=True)
class _Target:
    name: str
    need: str
    value: Callable[[dict[str, Any]], list[float]]  # one figure per seed
    ok: Callable[[float], bool]
    badness: Callable[[float], float]  # the worst seed is the one with the largest


def _per_seed(key: str, field: str) -> Callable[[dict[str, Any]], list[float]]:
    return lambda doc: [float(r[field]) for r in doc["scenarios"][key]["seeds"] if field in r]


def _less_by(name: str, key: str, field: str, frac: float) -> _Target:
    """dpmp's batch time at least ``frac`` below lbbsp's."""
    return _Target(
        name, f"≥ {frac:.0%} less".replace("%", " %"), _per_seed(key, field),
        lambda x: x >= frac, lambda x: -x,
    )  # fmt: skip


def _at_most(name: str, key: str, field: str, cap: float) -> _Target:
    return _Target(name, f"≤ {cap:.2f}", _per_seed(key, field), lambda x: x <= cap, lambda x: x)


def _within(name: str, key: str, field: str, tol: float) -> _Target:
    """A ratio within ``tol`` of 1."""
    return _Target(
        name, f"within ±{tol:.0%}".replace("%", " %"), _per_seed(key, field),
        lambda x: abs(x - 1) <= tol, lambda x: abs(x - 1),
    )  # fmt: skip


TARGETS = (
    _less_by("B: dpmp batch time vs lbbsp", "B", "reduction", 0.15),
    _within("B: measured / predicted", "B", "measured_over_predicted", 0.15),
    _less_by("D: dpmp batch time vs lbbsp", "D", "reduction", 0.45),
    _at_most("C: dpmp / lbbsp", "C", "dpmp_over_lbbsp", 1.05),
    _at_most("E: dpmp / lbbsp", "E", "dpmp_over_lbbsp", 1.05),
    _less_by("engine B: dpmp batch time vs lbbsp", "B", "engine_reduction", 0.15),
    _less_by("engine D: dpmp batch time vs lbbsp", "D", "engine_reduction", 0.45),
    _at_most("engine C: dpmp / lbbsp", "C", "engine_dpmp_over_lbbsp", 1.05),
    _at_most("engine E: dpmp / lbbsp", "E", "engine_dpmp_over_lbbsp", 1.05),
    _within("B: engine / pipeline (dpmp)", "B", "engine_over_pipeline", 0.15),
    _within("D: engine / pipeline (dpmp)", "D", "engine_over_pipeline", 0.15),
    _Target(
        "budget: time-average cost / budget",
        "within ±5 %",
        lambda doc: [float(r["cost_over_budget"]) for r in doc["budget"]["seeds"]],
        lambda x: abs(x - 1) <= 0.05,
        lambda x: abs(x - 1),
    ),
)


REAL_TARGETS = (
    _Target(
        "real B: dpmp batch time vs lbbsp",
        "> 0 % less",
        _per_seed("B", "real_reduction"),
        lambda x: x > 0,
        lambda x: -x,
    ),
    *(
        _at_most(f"{key}: real / engine ({policy})", key, f"real_over_engine_{policy}", 1.3)
        for key in KEYS
        for policy in POLICIES
    ),
)

FIELDS = (
    "bsp_s",
    "lbbsp_s",
    "dpmp_s",
    "predicted_s",
    "reduction",
    "dpmp_over_lbbsp",
    "measured_over_predicted",
)


def _engine_row(key: str, seed: int, opts: DpmpOptions, run: EngineRun) -> dict[str, Any]:
    sc = replace(load_scenario(key), budget_s=opts.engine_budget_s)
    row: dict[str, Any] = {}
    for policy in POLICIES:
        result, versions = run(sc, PolicySpec(policy), seed)
        row[f"engine_{policy}_s"] = round_s(versions, sc.budget_s)
        row[f"engine_per_throughput_{policy}_s"] = per_throughput_s(result, sc.global_batch)
    row["engine_reduction"] = 1 - row["engine_dpmp_s"] / row["engine_lbbsp_s"]
    row["engine_dpmp_over_lbbsp"] = row["engine_dpmp_s"] / row["engine_lbbsp_s"]
    return row


def _real_row(key: str, seed: int, opts: DpmpOptions, run: RealRun) -> dict[str, Any]:
    sc = replace(load_scenario(key), budget_s=opts.real_budget_s)
    row: dict[str, Any] = {}
    for policy in POLICIES:
        row[f"real_{policy}_s"] = per_throughput_s(
            run(sc, PolicySpec(policy), seed), sc.global_batch
        )
    row["real_reduction"] = 1 - row["real_dpmp_s"] / row["real_lbbsp_s"]
    return row


def _scenario(
    key: str, opts: DpmpOptions, engine: EngineRun = engine_sim, real: RealRun = real_run
) -> dict[str, Any]:
    rows = []
    structure = ""
    for seed in range(opts.seeds):
        f = compare(SCENARIOS[key], rounds=opts.rounds, seed=seed, from_round=opts.from_round)
        structure = f.structure
        row: dict[str, Any] = {
            "seed": seed,
            "bsp_s": f.bsp,
            "lbbsp_s": f.lbbsp,
            "dpmp_s": f.dpmp,
            "predicted_s": f.predicted,
            "reduction": f.reduction,
            "dpmp_over_lbbsp": f.dpmp / f.lbbsp,
            "measured_over_predicted": f.dpmp / f.predicted,
        }
        if opts.engine:
            row.update(_engine_row(key, seed, opts, engine))
            row["engine_over_pipeline"] = row["engine_dpmp_s"] / f.dpmp
        if opts.real and seed < opts.real_seeds:
            row.update(_real_row(key, seed, opts, real))
            for policy in POLICIES:
                sim = row[f"engine_per_throughput_{policy}_s"] if opts.engine else math.nan
                row[f"real_over_engine_{policy}"] = row[f"real_{policy}_s"] / sim
        rows.append(row)

    def med(field: str) -> float:
        values = [r[field] for r in rows if field in r]
        return statistics.median(values) if values else math.nan

    fields = sorted({k for r in rows for k in r if k != "seed"})
    return {
        "name": SCENARIOS[key].name,
        "workers": [list(w) for w in SCENARIOS[key].workers],
        "structure": structure,
        "seeds": rows,
        **{k: med(k) for k in fields},
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


def run_dpmp(
    opts: DpmpOptions, engine: EngineRun = engine_sim, real: RealRun = real_run
) -> dict[str, Any]:
    """Every scenario and the budget run over ``opts.seeds`` seeds; writes the JSON, Markdown
    and plot, and returns the document. ``engine``/``real``: how one engine-simulator or real
    run is made."""
    if opts.seeds < 1:
        raise ValueError(f"--seeds must be >= 1, got {opts.seeds}")
    doc: dict[str, Any] = {
        "suite": "dpmp",
        "seeds": opts.seeds,
        "rounds": opts.rounds,
        "from_round": opts.from_round,
        "engine_budget_s": opts.engine_budget_s if opts.engine else None,
        "real_budget_s": opts.real_budget_s if opts.real else None,
        "scenarios": {key: _scenario(key, opts, engine, real) for key in KEYS},
        "budget": _budget(opts),
    }
    targets = []
    chosen = [
        t
        for t in TARGETS
        if opts.engine or not t.name.startswith(("engine", "B: engine", "D: engine"))
    ]
    for t in chosen + (list(REAL_TARGETS) if opts.real and opts.engine else []):
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
    lines += ["", *three_columns(doc)]
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


def _ms(x: Any) -> str:
    return "—" if x is None or not math.isfinite(x) else f"{x * 1e3:.1f}"


def _less(dpmp: Any, lbbsp: Any) -> str:
    ok = all(v is not None and math.isfinite(v) for v in (dpmp, lbbsp)) and lbbsp > 0
    return f"{dpmp / lbbsp - 1:+.1%}" if ok else "—"


def three_columns(doc: dict[str, Any]) -> list[str]:
    """Each scenario's batch time (ms) for dpmp and lbbsp three ways: the pipeline simulator,
    the engine's simulator and real mode ("—" where a column was not run)."""
    eng = doc.get("engine_budget_s")
    real = doc.get("real_budget_s")
    lines = [
        "Batch time (ms), median over seeds, dpmp / lbbsp and dpmp's change: the pipeline "
        "simulator (median round), the engine's simulator"
        + (f" ({eng:g} virtual s per run, median round after the first third)" if eng else "")
        + ", real mode"
        + (
            f" ({real:g} s per run; global batch / samples per s, the engine's as measured so "
            "in brackets)"
            if real
            else " (not run: --mode real)"
        )
        + ".",
        "",
        "| scenario | pipeline sim | engine sim | real | engine / pipeline (dpmp) |",
        "|---|---|---|---|---|",
    ]
    for s in doc["scenarios"].values():
        g = s.get
        pipe = f"{_ms(g('dpmp_s'))} / {_ms(g('lbbsp_s'))} ({_less(g('dpmp_s'), g('lbbsp_s'))})"
        engine = (
            f"{_ms(g('engine_dpmp_s'))} / {_ms(g('engine_lbbsp_s'))} "
            f"({_less(g('engine_dpmp_s'), g('engine_lbbsp_s'))})"
        )
        live = (
            f"{_ms(g('real_dpmp_s'))} / {_ms(g('real_lbbsp_s'))} "
            f"({_less(g('real_dpmp_s'), g('real_lbbsp_s'))}) "
            f"[{_ms(g('engine_per_throughput_dpmp_s'))} / {_ms(g('engine_per_throughput_lbbsp_s'))}]"
            if real
            else "—"
        )
        ratio = g("engine_over_pipeline")
        ratio_text = f"{ratio:.3f}" if ratio is not None and math.isfinite(ratio) else "—"
        lines.append(f"| {s['name']} | {pipe} | {engine} | {live} | {ratio_text} |")
    return lines


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
