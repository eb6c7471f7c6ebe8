"""``hetd bench --suite auto``: what auto is judged by. Every fixed candidate policy and ``auto`` ran
on each scenario (the policies sweep, one ``results.json`` per scenario); this module reads those
documents and auto's switches, and writes the comparison, its targets and the verdict.

Owns the suite's defaults (:data:`DEFAULT_SCENARIOS`, :data:`PLAN_FRACTION`), the auto policy a
scenario runs (:func:`auto_spec`), one scenario's row (:func:`scenario_row`), the whole document
with its verdict (:func:`judge`), and its Markdown (:func:`markdown`). The runs themselves are
:func:`hetd.bench.suites.run_auto`'s. Pure: no runs, no clock; :func:`write` is the only I/O.

The targets: on every scenario auto's median TTA at most :data:`RATIO_TARGET` times the best fixed
policy's, and auto's geometric mean over the scenarios below every fixed policy's. A seed that
never reaches the target counts as the budget, so a policy that never gets there still has a
time (a lower bound on its own) and the geometric mean is defined.
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from hetd.sim.results import PolicySpec
from policies.auto_choice import DEFAULT_CANDIDATES, NOT_CANDIDATES, key_of

# The packaged scenarios the suite runs unless told: all but S7, whose 2M transformer costs 35-47
# min of wall time per 60 s run on two shared cores (every step a real gradient), so its nine
# policies at 3 seeds would take most of a day; name it (--scenarios S7) on a machine that has one.
DEFAULT_SCENARIOS = (
    "S1",
    "S2",
    "S3b",
    "S4",
    "S6_5x",
    "peer_adam",
    "churn",
    "churn_profile",
)
RATIO_TARGET = 1.10  # auto's median TTA / the best fixed policy's, on every scenario
# A planning round every this fraction of the budget: the packaged scenarios last 20-60 s of
# virtual time, and the daemon's default (30 s) would plan at most twice in most of them.
PLAN_FRACTION = 0.1

Switch = Mapping[str, Any]  # {"at_s", "from", "to", "why"}, as auto's state describes one


def auto_spec(
    fixed: Sequence[PolicySpec], plan_every_s: float, params: Mapping[str, Any] | None = None
) -> PolicySpec:
    """The auto that is compared with ``fixed``: its candidates are the fixed policies it may run
    (not the DiLoCo family, which auto refuses), it starts on lbbsp when that is one of them (its
    default) or else on the first, and its minimum dwell is one planning round (the daemon's
    defaults keep the two equal, 30 s). ``params`` (``--auto``) override any of these."""
    cands = [p.label for p in fixed if p.name not in NOT_CANDIDATES]
    if not cands:
        raise ValueError(
            "auto needs a candidate among the fixed policies; e.g. --policies bsp,ashl"
        )
    keys = {key_of(p.name, p.params) for p in fixed if p.name not in NOT_CANDIDATES}
    chosen: dict[str, Any] = {"dwell_s": plan_every_s}
    if keys != {key_of(n, ()) for n in DEFAULT_CANDIDATES}:
        chosen["candidates"] = ",".join(cands)
        if key_of("lbbsp", ()) not in keys:
            chosen["start"] = cands[0]
    chosen |= dict(params or {})
    return PolicySpec("auto", tuple(sorted(chosen.items())))


def _tta(run: Mapping[str, Any], budget_s: float) -> float:
    return budget_s if run["tta_s"] is None else float(run["tta_s"])


def scenario_row(
    results: Mapping[str, Any],
    *,
    scenario: str,
    budget_s: float,
    plan_every_s: float,
    auto: str,
    switches: Mapping[int, Sequence[Switch]] | None,
) -> dict[str, Any]:
    """One scenario from its ``results.json`` document: each policy's median TTA over the seeds
    (a seed that never reached the target counted as ``budget_s``) and how many seeds reached
    it, the best fixed policy, auto's median and the ratio. ``auto`` is the label of auto's runs
    in ``results``; ``switches`` auto's switches by seed (None: not recorded, as in real mode)."""
    policies: dict[str, dict[str, Any]] = {}
    for run in results["runs"]:
        if run["scenario"] != scenario:
            continue
        p = policies.setdefault(run["policy"], {"tta_s": [], "seeds": []})
        p["tta_s"].append(run["tta_s"])
        p["seeds"].append(run["seed"])
    if auto not in policies:
        raise ValueError(f"{scenario}: no run of {auto!r} in the results ({sorted(policies)})")
    fixed = [label for label in policies if label != auto]
    if not fixed:
        raise ValueError(f"{scenario}: no fixed policy to compare auto with")
    for p in policies.values():
        p["median_s"] = statistics.median(_tta({"tta_s": t}, budget_s) for t in p["tta_s"])
        p["reached"] = sum(t is not None for t in p["tta_s"])
    best = min(fixed, key=lambda label: policies[label]["median_s"])  # the first of equals
    mine = policies[auto]
    return {
        "scenario": scenario,
        "budget_s": budget_s,
        "plan_every_s": plan_every_s,
        "auto": auto,
        "policies": policies,
        "best": best,
        "best_median_s": policies[best]["median_s"],
        "auto_median_s": mine["median_s"],
        "ratio": mine["median_s"] / policies[best]["median_s"],
        "switches": (
            None
            if switches is None
            else {str(s): [dict(x) for x in switches.get(s, ())] for s in mine["seeds"]}
        ),
    }


def _geomean(values: Sequence[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values))


def judge(rows: Sequence[Mapping[str, Any]], *, seeds: int, mode: str) -> dict[str, Any]:
    """The suite's document: the scenarios' rows, each policy's geometric mean of its median TTA
    over the scenarios (auto under ``"auto"``; a fixed policy missing from a scenario has none)
    and the verdict against the targets."""
    if not rows:
        raise ValueError("no scenario to judge")
    fixed_sets = [set(r["policies"]) - {r["auto"]} for r in rows]
    common = [label for label in rows[0]["policies"] if all(label in s for s in fixed_sets)]
    geomean = {
        label: _geomean([r["policies"][label]["median_s"] for r in rows]) for label in common
    }
    auto_geo = _geomean([r["auto_median_s"] for r in rows])
    misses = [
        f"{r['scenario']}: auto {r['ratio']:.2f}x {r['best']}, above {RATIO_TARGET:.2f}x"
        for r in rows
        if r["ratio"] > RATIO_TARGET
    ]
    beaten_by = [label for label, g in geomean.items() if not auto_geo < g]
    misses += [
        f"geometric mean: auto {auto_geo:.3g} s, not below {label}'s {geomean[label]:.3g} s"
        for label in beaten_by
    ]
    every = all(r["ratio"] <= RATIO_TARGET for r in rows)
    return {
        "suite": "auto",
        "mode": mode,
        "seeds": seeds,
        "ratio_target": RATIO_TARGET,
        "scenarios": [dict(r) for r in rows],
        "geomean_s": {"auto": auto_geo, **geomean},
        "verdict": {
            "every_scenario": every,
            "geomean": not beaten_by,
            "pass": every and not beaten_by,
            "misses": misses,
        },
    }


def _time(p: Mapping[str, Any], budget_s: float) -> str:
    n = len(p["tta_s"])
    if p["reached"] == 0:
        return f"never ({budget_s:g} s)"
    text = f"{p['median_s']:.2f} s"
    return text if p["reached"] == n else f"{text} ({p['reached']}/{n} reached)"


def switches_text(switches: Mapping[str, Sequence[Switch]] | None) -> str:
    """``1/0/2: ashl×2, adsp`` — switches per seed, then where they went and how often; ``–``
    when not recorded."""
    if switches is None:
        return "–"
    counts = "/".join(str(len(v)) for v in switches.values())
    to: dict[str, int] = {}
    for seed in switches.values():
        for s in seed:
            to[s["to"]] = to.get(s["to"], 0) + 1
    where = ", ".join(label + (f"×{n}" if n > 1 else "") for label, n in to.items())
    return f"{counts}: {where}" if where else counts


def markdown(doc: Mapping[str, Any]) -> str:
    """The scenario table, the geometric means and the verdict."""
    n = doc["seeds"]
    lines = [
        f"# hetd bench --suite auto ({n} seed{'s' if n > 1 else ''}, {doc['mode']})",
        "",
        "Median TTA over the seeds; a seed that never reaches the target counts as the budget "
        '("never (B s)": no seed did; "k/n reached": some did not). auto plans every '
        '"plan" seconds and may switch after one such dwell; switches: how many per seed, '
        "then to what.",
        "",
        "| scenario | plan | best fixed | its TTA | auto TTA | auto/best | switches |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in doc["scenarios"]:
        b = r["budget_s"]
        mark = "" if r["ratio"] <= doc["ratio_target"] else " ✗"
        lines.append(
            f"| {r['scenario']} | {r['plan_every_s']:g} s | {r['best']} | "
            f"{_time(r['policies'][r['best']], b)} | {_time(r['policies'][r['auto']], b)} | "
            f"{r['ratio']:.2f}{mark} | {switches_text(r['switches'])} |"
        )
    geo = doc["geomean_s"]
    auto_geo = geo["auto"]
    lines += [
        "",
        f"Geometric mean of the median TTA over {len(doc['scenarios'])} scenario(s):",
        "",
        "| policy | geometric mean | auto / it |",
        "|---|---|---|",
    ]
    for label, g in sorted(geo.items(), key=lambda kv: kv[1]):
        lines.append(f"| {label} | {g:.2f} s | {auto_geo / g:.2f} |")
    v = doc["verdict"]
    lines += [
        "",
        f"Targets: auto ≤ {doc['ratio_target']:.2f}× the best fixed policy on every scenario "
        f"({'met' if v['every_scenario'] else 'missed'}); auto's geometric mean below every fixed "
        f"policy's ({'met' if v['geomean'] else 'missed'}).",
        "",
        f"Verdict: {'pass' if v['pass'] else 'miss'}." + "".join(f"\n* {m}" for m in v["misses"]),
        "",
    ]
    return "\n".join(lines)


def write(out: Path, doc: Mapping[str, Any]) -> None:
    """``OUT/auto.json`` and ``OUT/auto.md``."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "auto.json").write_text(json.dumps(doc, indent=1) + "\n")
    (out / "auto.md").write_text(markdown(doc))
