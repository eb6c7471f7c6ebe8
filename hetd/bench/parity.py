"""``hetd bench --suite parity``: the same scenario in ``--mode sim`` and ``--mode real``, compared.

Owns the pure comparison of the two sweeps' documents: :func:`rank_key`, :func:`ranks`,
:func:`kendall_distance`, :func:`compare`; and :func:`write_parity` (``OUT/parity.json``,
``OUT/parity.md`` and ``OUT/parity.png``). :func:`hetd.bench.suites.run_parity` runs the two sweeps
(into ``OUT/sim`` and ``OUT/real``) and hands their documents here. Medians over seeds and ranks
are compared, never single runs.

Ranking rule: a policy's key is its median TTA over seeds; a policy whose median never reaches the
target comes after every one that does, those ordered by higher median final accuracy. Two
policies with equal keys are tied. The distance between the two modes' orders is Kendall's tau
distance: the number of pairs strictly ordered one way in sim and the other way in real (tied
pairs never count). Without ties it is the number of adjacent swaps that turn one order into the
other, so the ranking *agrees* when the distance is at most :data:`MAX_SWAPS` (= 1): identical, or
one adjacent swap. The printed ranks (1..n) break ties by final accuracy, then by the order the
policies were given, so they are always a permutation.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from hetd.sim.results import grid_time_to_target
from hetd.sim.scenario import Scenario

BAND = 1.3  # real/sim TTA ratios within [1/BAND, BAND] count as agreeing
MAX_SWAPS = 1  # Kendall tau distance allowed between the two modes' rankings
MODES = ("sim", "real")
MAX_LISTED = 3  # discordant pairs named in the verdict sentence

Standing = tuple[float | None, float]
"""(median TTA in s or None if never reached, median final accuracy) of one policy in one mode."""


def rank_key(standing: Standing) -> tuple[int, float]:
    """Smaller is better: reached sooner; never reached after all reached, higher accuracy first."""
    tta, acc = standing
    return (0, tta) if tta is not None else (1, -acc)


def ranks(standings: Mapping[str, Standing]) -> dict[str, int]:
    """1-based ranks by :func:`rank_key`; ties broken by final accuracy, then insertion order."""
    order = sorted(
        enumerate(standings.items()), key=lambda e: (rank_key(e[1][1]), -e[1][1][1], e[0])
    )
    return {label: i + 1 for i, (_, (label, _)) in enumerate(order)}


def discordant_pairs(a: Mapping[str, Standing], b: Mapping[str, Standing]) -> list[list[str]]:
    """Pairs of policies (in ``a``'s order) that ``a`` and ``b`` order strictly oppositely."""
    labels = list(a)
    out = []
    for i, x in enumerate(labels):
        for y in labels[i + 1 :]:
            da = (rank_key(a[x]) > rank_key(a[y])) - (rank_key(a[x]) < rank_key(a[y]))
            db = (rank_key(b[x]) > rank_key(b[y])) - (rank_key(b[x]) < rank_key(b[y]))
            if da * db < 0:
                out.append([x, y] if da < 0 else [y, x])  # [better in a, better in b]
    return out


def kendall_distance(a: Mapping[str, Standing], b: Mapping[str, Standing]) -> int:
    """Kendall's tau distance between the orders of ``a`` and ``b`` (same policies)."""
    return len(discordant_pairs(a, b))


def _spread(ttas: Sequence[float | None]) -> dict[str, float | None]:
    """min, max and IQR over seeds; a seed that never reached counts as +inf (max/IQR None)."""
    arr = np.array([math.inf if t is None else t for t in ttas], dtype=np.float64)
    with np.errstate(invalid="ignore"):
        q25, q75 = np.percentile(arr, [25, 75])

    def fin(x: float) -> float | None:
        return float(x) if math.isfinite(x) else None

    return {"min": fin(arr.min()), "max": fin(arr.max()), "iqr": fin(float(q75 - q25))}


def _median(values: Sequence[float | None]) -> float | None:
    """Median where None (never reached) counts as +inf; an infinite median is None."""
    if not values:
        return None
    m = float(np.median([math.inf if v is None else v for v in values]))
    return m if math.isfinite(m) else None


def _mode(doc: Mapping[str, Any], label: str, target: float | None = None) -> dict[str, Any]:
    """One policy's numbers in one mode's ``results.json`` document. ``tta_s`` is read between
    evaluations (:func:`hetd.sim.results.time_to_target`); with an accuracy ``target`` the
    evaluation-grid reading (the first evaluation at or above it, as older tables read TTA) is
    there too, as ``tta_grid_s`` and ``tta_grid_median_s``."""
    row = next(r for r in doc["summary"] if r["policy"] == label)
    runs = [r for r in doc["runs"] if r["policy"] == label]
    ttas = [r["tta_s"] for r in runs]
    grid = (
        {}
        if target is None or not all("curve" in r for r in runs)
        else {
            "tta_grid_s": (g := [grid_time_to_target(r["curve"], target) for r in runs]),
            "tta_grid_median_s": _median(g),
        }
    )
    return {
        "tta_s": ttas,
        **grid,
        "reached": sum(t is not None for t in ttas),
        "tta_median_s": row["tta_median_s"],
        **{f"tta_{k}_s": v for k, v in _spread(ttas).items()},
        "final_accuracy_median": row["final_accuracy_median"],
        "speedup_vs_bsp": row["speedup_vs_bsp"],
        "lr": sorted({r["lr"] for r in doc["runs"] if r["policy"] == label}),
    }


def compare(
    sim: Mapping[str, Any], real: Mapping[str, Any], sc: Scenario, seeds: int
) -> dict[str, Any]:
    """The ``parity.json`` document from the two modes' ``results.json`` documents."""
    labels = [r["policy"] for r in sim["summary"]]
    target = None if sc.target_loss > 0 else sc.target_accuracy
    policies: dict[str, dict[str, Any]] = {
        p: {m: _mode(d, p, target) for m, d in zip(MODES, (sim, real), strict=True)} for p in labels
    }
    stand = {
        m: {p: (v[m]["tta_median_s"], v[m]["final_accuracy_median"]) for p, v in policies.items()}
        for m in MODES
    }
    rank = {m: ranks(stand[m]) for m in MODES}
    one_mode: list[str] = []
    for p, v in policies.items():
        s, r = v["sim"]["tta_median_s"], v["real"]["tta_median_s"]
        v["ratio"] = r / s if s and r is not None else None
        v["rank"] = {m: rank[m][p] for m in MODES}
        if (s is None) != (r is None):
            one_mode.append(p)
    ratios = {p: v["ratio"] for p, v in policies.items() if v["ratio"] is not None}
    pairs = discordant_pairs(stand["sim"], stand["real"])
    largest = max(ratios, key=lambda p: ratios[p], default=None)
    smallest = min(ratios, key=lambda p: ratios[p], default=None)
    within = not one_mode and all(1 / BAND <= x <= BAND for x in ratios.values())
    verdict: dict[str, Any] = {
        "scenario": sc.name,
        "budget_s": sc.budget_s,
        "seeds": seeds,
        "band": BAND,
        "largest_ratio": None if largest is None else {"policy": largest, "ratio": ratios[largest]},
        "smallest_ratio": (
            None if smallest is None else {"policy": smallest, "ratio": ratios[smallest]}
        ),
        "within_band": within,
        "reached_in_one_mode_only": one_mode,
        "rank_distance": len(pairs),
        "discordant_pairs": pairs,
        "max_swaps": MAX_SWAPS,
        "ranking_agrees": len(pairs) <= MAX_SWAPS,
        "rank_rule": "Kendall tau distance between the modes' orders by median TTA (never reached "
        "last, by final accuracy; ties never count) <= max_swaps, i.e. at most one adjacent swap",
    }
    verdict["sentence"] = sentence(verdict, len(labels))
    return {"policies": policies, "verdict": verdict}


def sentence(v: Mapping[str, Any], n: int) -> str:
    """The verdict in one sentence."""
    lo, hi = v["smallest_ratio"], v["largest_ratio"]
    if hi is None:
        ratio = "no policy reached the target in both modes, so no TTA ratio"
    else:
        ratio = (
            f"real/sim median TTA ratios from {lo['ratio']:.2f} ({lo['policy']}) to "
            f"{hi['ratio']:.2f} ({hi['policy']}), "
            + ("within" if v["within_band"] else "not within")
            + f" x{v['band']:g}"
        )
    if v["reached_in_one_mode_only"]:
        ratio += "; reached the target in one mode only: " + ", ".join(
            v["reached_in_one_mode_only"]
        )
    shown = v["discordant_pairs"][:MAX_LISTED]
    pairs = "; ".join(f"{a} before {b} in sim, after in real" for a, b in shown)
    if len(v["discordant_pairs"]) > len(shown):
        pairs += f"; {len(v['discordant_pairs']) - len(shown)} more in parity.json"
    agree = "agrees" if v["ranking_agrees"] else "disagrees"
    return (
        f"{v['scenario']} ({n} policies, {v['seeds']} seed(s), budget {v['budget_s']:g} s): "
        f"{ratio}; the ranking {agree} (Kendall distance {v['rank_distance']}, at most "
        f"{v['max_swaps']} allowed" + (f": {pairs})." if pairs else ").")
    )


def _fmt(x: float | None, spec: str = ".2f", none: str = "never") -> str:
    return none if x is None else format(x, spec)


def parity_markdown(doc: Mapping[str, Any]) -> str:
    """``parity.md``: the table a person reads and the verdict."""
    v = doc["verdict"]
    lines = [
        f"# hetd bench parity: {v['scenario']}",
        "",
        "Simulator (virtual s) vs real daemon and `hetd-worker` processes "
        + (
            "each in its own network namespace behind a tbf-shaped veth (`--links netns`)"
            if doc.get("links") == "netns"
            else "on loopback, links emulated"
        )
        + " (wall s); "
        + (
            "real evaluations live (the daemon pays their CPU during the run; the simulator "
            "charges none); "
            if doc.get("evals") == "live"
            else "real evaluations deferred (kept during the run, evaluated after it; the "
            "simulator charges none either); "
        )
        + f"budget {v['budget_s']:g} s, {v['seeds']} seed(s); medians over seeds. TTA is read "
        "between evaluations (linear), the same rule in both modes; the last column is the "
        "first evaluation at or above the target (the evaluation grid). Outputs of each "
        "mode: `sim/` and `real/`.",
        "",
        "| policy | sim TTA (s) | real TTA (s) median [min–max] | real / sim | speed-up vs BSP "
        "sim / real | rank sim / real | on the eval grid sim / real |",
        "|---|---|---|---|---|---|---|",
    ]
    for p, x in doc["policies"].items():
        s, r = x["sim"], x["real"]
        spread = f"[{_fmt(r['tta_min_s'])}–{_fmt(r['tta_max_s'])}]" if len(r["tta_s"]) > 1 else ""
        lines.append(
            f"| {p} | {_fmt(s['tta_median_s'])} | {_fmt(r['tta_median_s'])} {spread} ".rstrip()
            + f" | {_fmt(x['ratio'], none='–')} "
            f"| {_fmt(s['speedup_vs_bsp'], none='–')} / {_fmt(r['speedup_vs_bsp'], none='–')} "
            f"| {x['rank']['sim']} / {x['rank']['real']} "
            f"| {_fmt(s.get('tta_grid_median_s'), none='–')} / "
            f"{_fmt(r.get('tta_grid_median_s'), none='–')} |"
        )
    costs = doc.get("costs")
    if costs:
        c = costs["costs"]

        def none(table: str) -> float:
            return float(c[table].get("none", 0.0)) * 1e9

        lines += [
            "",
            f"The sim runs charged the cost profile `{costs['file']}` (docs/benchmark.md): "
            f"message {c['message_s'] * 1e3:.3f} ms, apply (grad) "
            f"{c['apply_s'].get('grad', 0.0) * 1e3:.3f} ms, evaluation {c['eval_s'] * 1e3:.2f} "
            f"ms, worker step overhead {c['worker_step_s'] * 1e3:.3f} ms, round trip "
            f"(exchange) {c.get('exchange_s', 0.0) * 1e3:.2f} ms per step, release stagger "
            f"{c.get('release_stagger_s', 0.0) * 1e3:.2f} ms; per parameter (none): "
            f"push decode {none('push_decode_s_per_param'):.2f} ns, publish "
            f"{none('publish_s_per_param'):.2f} ns, worker encode "
            f"{none('worker_encode_s_per_param'):.2f} ns, worker decode "
            f"{none('worker_decode_s_per_param'):.2f} ns.",
        ]
    lines += [
        "",
        f"**Verdict.** {v['sentence']}",
        "",
        f"Ranking rule: {v['rank_rule']}. Ratios within x{v['band']:g} either way count as agreeing.",
        "",
    ]
    return "\n".join(lines)


def plot_parity(path: Path, doc: Mapping[str, Any]) -> None:
    """Sim TTA (x) vs real TTA (y) per policy: medians, seed min–max as error bars, y = x and
    the ×/÷ :data:`BAND` lines. Policies that never reached in a mode are named in the title."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 5.0))
    top, missing = 0.0, []
    for p, x in doc["policies"].items():
        s, r = x["sim"], x["real"]
        if s["tta_median_s"] is None or r["tta_median_s"] is None:
            missing.append(p)
            continue
        xs, ys = s["tta_median_s"], r["tta_median_s"]
        err = [
            [[max(0.0, m["tta_median_s"] - (m["tta_min_s"] or m["tta_median_s"]))],
             [max(0.0, (m["tta_max_s"] or m["tta_median_s"]) - m["tta_median_s"])]]
            for m in (s, r)
        ]  # fmt: skip
        ax.errorbar(xs, ys, xerr=err[0], yerr=err[1], fmt="o", capsize=3)
        ax.annotate(p, (xs, ys), textcoords="offset points", xytext=(5, 4), fontsize=8)
        top = max(top, xs, ys, s["tta_max_s"] or xs, r["tta_max_s"] or ys)
    top = (top or 1.0) * 1.15
    line = np.array([0.0, top])
    ax.plot(line, line, color="black", lw=0.8, label="y = x")
    for f, label in ((BAND, f"y = {BAND:g}x"), (1 / BAND, f"y = x/{BAND:g}")):
        ax.plot(line, f * line, color="grey", ls="--" if f > 1 else ":", lw=0.9, label=label)
    ax.set_xlim(0, top)
    ax.set_ylim(0, top)
    ax.set_xlabel("sim TTA (virtual s, median over seeds)")
    ax.set_ylabel("real TTA (wall s, median; bars: seed min–max)")
    v = doc["verdict"]
    title = f"{v['scenario']}: real vs sim time to accuracy"
    if missing:
        title += "\nnot reached in a mode: " + ", ".join(missing)
    ax.set_title(title, fontsize=9)
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_parity(out: Path, doc: Mapping[str, Any]) -> None:
    """``parity.json``, ``parity.md`` and ``parity.png`` in ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "parity.json").write_text(json.dumps(doc, indent=1) + "\n")
    (out / "parity.md").write_text(parity_markdown(doc))
    plot_parity(out / "parity.png", doc)
