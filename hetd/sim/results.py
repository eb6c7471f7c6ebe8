"""What a benchmark run produces: policy specs, one run's record, the summary over seeds, and the
``results.json`` schema with a checker.

Owns :class:`PolicySpec` and :func:`parse_policies` (``bsp,ssp:staleness=3,asp``),
:class:`RunResult` (one policy × scenario × seed, the same for ``--mode sim`` and ``--mode real``),
:class:`Trace` (timelines and batch shares for the plots; not written to ``results.json``),
:func:`summarize` and :func:`check_results`. Pure: no clock, no I/O.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from policies import make_policy

# --- policies by name ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class PolicySpec:
    """A registered policy name and its parameters."""

    name: str
    params: tuple[tuple[str, Any], ...] = ()

    @property
    def label(self) -> str:
        """``name`` or ``name:k=v;k=v`` — how the policy appears in results."""
        if not self.params:
            return self.name
        return self.name + ":" + ";".join(f"{k}={json.dumps(v)}" for k, v in self.params)

    def build_params(self) -> dict[str, Any]:
        """The parameters as a dict for ``make_policy``."""
        return dict(self.params)


def _value(text: str) -> Any:
    """``3`` -> 3, ``0.5`` -> 0.5, ``true``/``false``/``null`` -> JSON values, else the string."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def parse_policies(text: str) -> list[PolicySpec]:
    """Parse ``name[:key=value[;key=value...]]`` items separated by commas.

    ``bsp,ssp:staleness=3,asp:weight=0.25`` gives three policies; a comma-separated item that is
    ``key=value`` with no name continues the previous policy's parameters, so
    ``ssp:staleness=2,weight=0.5`` is one policy. Every policy is built once here, so an unknown
    name or a bad parameter fails before any run starts (listing the valid names).
    """
    specs: list[tuple[str, dict[str, Any]]] = []
    for raw in text.split(","):
        item = raw.strip()
        if not item:
            continue
        if ":" not in item and "=" in item:
            if not specs:
                raise ValueError(f"policy parameter {item!r} comes before any policy name")
            pairs = [item]
        else:
            name, _, rest = item.partition(":")
            specs.append((name.strip(), {}))
            pairs = [p for p in rest.replace(":", ";").split(";") if p.strip()]
        for pair in pairs:
            key, eq, value = pair.partition("=")
            if not eq or not key.strip():
                raise ValueError(f"policy parameter {pair!r} must look like key=value")
            specs[-1][1][key.strip()] = _value(value.strip())
    if not specs:
        raise ValueError("no policies given; e.g. --policies bsp,asp,ssp:staleness=3")
    out = [PolicySpec(name, tuple(sorted(params.items()))) for name, params in specs]
    for spec in out:
        make_policy(spec.name, spec.build_params())  # raises PolicyError naming what is valid
    labels = [s.label for s in out]
    if len(set(labels)) != len(labels):
        raise ValueError(f"a policy is listed twice: {labels}")
    return out


# --- one run -------------------------------------------------------------------------------------


@dataclass
class Trace:
    """Per-worker activity and batch shares over time, for the plots."""

    # worker -> [(t0 s, t1 s, "compute" | "comm" | "busy")]; the rest of the time it waits
    # ("busy": compute and transfers together, where they cannot be told apart: --mode real)
    timeline: dict[str, list[tuple[float, float, str]]] = field(default_factory=dict)
    # [(t s, {worker: batch share})] sampled at each evaluation
    shares: list[tuple[float, dict[str, float]]] = field(default_factory=list)


@dataclass
class RunResult:
    """One policy × scenario × seed, in the units of ``results.json``."""

    policy: str
    scenario: str
    seed: int
    lr: float
    tta_s: float | None  # s to the target (time_to_target); None if never
    final_accuracy: float
    samples_per_s: float
    # worker -> fraction of the run its device did not compute (waiting for a release or its link)
    idle_fraction: dict[str, float]
    staleness_mean: float
    staleness_p95: float
    bytes_up: int  # push frames, worker -> daemon
    bytes_down: int  # params frames, daemon -> worker
    pushes: int  # updates received (bytes_up / pushes: bytes per update)
    releases: int  # parameter sends (bytes_down / releases: bytes per pull)
    curve: list[list[float]]  # [[t s, accuracy], ...]
    trace: Trace = field(default_factory=Trace)
    stages: list[list[Any]] = field(default_factory=list)  # [[t s, stage entered], ...]
    # real mode: the run's links ({"kind": "emulated"} or hetd.bench.links' description); None in
    # sim mode (the simulator charges bytes / bandwidth)
    links: dict[str, Any] | None = None
    # real mode: "deferred" (kept at each evaluation and evaluated after the run) or "live"
    # (evaluated during it); None in sim mode (hetd.bench.real's docstring)
    evals: str | None = None
    # [[t s, bytes pushed + pulled so far]] at each evaluation, on the curve's clock (the
    # simulator records it; empty where a runner does not, and bytes to target is then None)
    bytes_curve: list[list[float]] = field(default_factory=list)

    @property
    def bytes_to_target(self) -> int | None:
        """Bytes pushed plus pulled until the target was reached (None: never, or not recorded)."""
        at = bytes_at(self.bytes_curve, self.tta_s)
        return None if at is None else round(at)

    def to_json(self) -> dict[str, Any]:
        """The record written to ``results.json`` (the trace is left out)."""
        doc: dict[str, Any] = {
            "policy": self.policy,
            "scenario": self.scenario,
            "seed": self.seed,
            "lr": self.lr,
            "tta_s": self.tta_s,
            "final_accuracy": self.final_accuracy,
            "samples_per_s": self.samples_per_s,
            "idle_fraction": dict(self.idle_fraction),
            "staleness_mean": self.staleness_mean,
            "staleness_p95": self.staleness_p95,
            "bytes_up": self.bytes_up,
            "bytes_down": self.bytes_down,
            "bytes_to_target": self.bytes_to_target,
            "pushes": self.pushes,
            "releases": self.releases,
            "curve": [list(c) for c in self.curve],
            "stages": [list(x) for x in self.stages],
        }
        extra = {} if self.links is None else {"links": dict(self.links)}
        return doc | extra | ({} if self.evals is None else {"evals": self.evals})


def first_reach(curve: Sequence[Sequence[float]], target: float) -> float | None:
    """The time of the first evaluation at or above ``target``."""
    return next((float(t) for t, acc in curve if acc >= target), None)


def first_below(curve: Sequence[Sequence[float]], target: float) -> float | None:
    """When a ``[[t, loss], ...]`` curve first comes down to ``target``: linear between the last
    evaluation above it and the first at or below it (the first evaluation's time if that one
    already is). A loss target's TTA so moves with the run, not in steps of the evaluation
    interval; an evaluation is an estimate, and the line between two is the least we assume."""
    before: Sequence[float] | None = None
    for point in curve:
        t, loss = float(point[0]), float(point[1])
        if loss <= target:
            if before is None:
                return t
            t0, l0 = float(before[0]), float(before[1])
            return t0 + (t - t0) * (l0 - target) / (l0 - loss)
        before = point
    return None


def first_above(curve: Sequence[Sequence[float]], target: float) -> float | None:
    """When a ``[[t, accuracy], ...]`` curve first comes up to ``target``: linear between the last
    evaluation below it and the first at or above it (the first evaluation's time if that one
    already is), the rule :func:`first_below` applies to a loss. :func:`first_reach` is the
    evaluation-grid reading, which moves in steps of the evaluation interval."""
    before: Sequence[float] | None = None
    for point in curve:
        t, acc = float(point[0]), float(point[1])
        if acc >= target:
            if before is None:
                return t
            t0, a0 = float(before[0]), float(before[1])
            return t0 + (t - t0) * (target - a0) / (acc - a0)
        before = point
    return None


def time_to_target(
    evals: Sequence[Sequence[float]], target_accuracy: float, target_loss: float = 0.0
) -> float | None:
    """TTA from ``[(t, loss, accuracy), ...]`` evaluations (as ``Evaluations.evals``), read between
    evaluations in both cases, in sim and real mode alike: with a loss target (> 0) the
    interpolated time the loss comes down to it (:func:`first_below`), otherwise the
    interpolated time the accuracy comes up to ``target_accuracy`` (:func:`first_above`). TTA
    so never moves in steps of the evaluation interval; :func:`grid_time_to_target`
    is the evaluation-grid reading older tables used."""
    if target_loss > 0:
        return first_below([(e[0], e[1]) for e in evals], target_loss)
    return first_above([(e[0], e[2]) for e in evals], target_accuracy)


def grid_time_to_target(curve: Sequence[Sequence[float]], target_accuracy: float) -> float | None:
    """The first evaluation at or above ``target_accuracy`` on a ``[[t, accuracy], ...]`` curve:
    TTA on the evaluation grid, as tables before interpolated accuracy TTA read it."""
    return first_reach(curve, target_accuracy)


def bytes_at(curve: Sequence[Sequence[float]], t: float | None) -> float | None:
    """The cumulative bytes at time ``t`` from ``[[t, bytes], ...]`` marks: linear between the
    marks around it (the first mark's before it, the last's after it); None without ``t`` or
    marks. TTA may fall between two evaluations, so the bytes are read the same way."""
    if t is None or not curve:
        return None
    prev_t, prev_b = float(curve[0][0]), float(curve[0][1])
    if t <= prev_t:
        return prev_b
    for ct, cb in curve[1:]:
        ct, cb = float(ct), float(cb)
        if t <= ct:
            return prev_b + (cb - prev_b) * (t - prev_t) / (ct - prev_t) if ct > prev_t else cb
        prev_t, prev_b = ct, cb
    return prev_b


def staleness_stats(values: Sequence[int]) -> tuple[float, float]:
    """Mean and 95th percentile of push staleness (0, 0 without pushes)."""
    if not values:
        return 0.0, 0.0
    arr = np.asarray(values, dtype=np.float64)
    return float(arr.mean()), float(np.percentile(arr, 95))


# --- summary over seeds ----------------------------------------------------------------------------


def _median_iqr(values: Sequence[float | None]) -> tuple[float | None, float | None]:
    """Median and IQR where ``None`` (never reached) counts as +inf; inf results become None."""
    if not values:
        return None, None
    arr = np.array([math.inf if v is None else v for v in values], dtype=np.float64)
    with np.errstate(invalid="ignore"):  # inf - inf inside the interpolation is nan: None below
        med = float(np.median(arr))
        q25, q75 = np.percentile(arr, [25, 75])
    iqr = float(q75 - q25)
    return (med if math.isfinite(med) else None), (iqr if math.isfinite(iqr) else None)


def _as_float(x: int | None) -> float | None:
    return None if x is None else float(x)


def summarize(
    runs: Sequence[RunResult], tta_ideal_s: Mapping[str, float | None]
) -> list[dict[str, Any]]:
    """One row per (policy, scenario): median/IQR of TTA over seeds, speed-up vs BSP (BSP's median
    TTA over the policy's, same benchmark), median final accuracy, the ideal lower bound, and the
    median bytes to target (pushed plus pulled; a seed that never reached it counts as infinite)."""
    keys: list[tuple[str, str]] = []
    for r in runs:
        if (r.policy, r.scenario) not in keys:
            keys.append((r.policy, r.scenario))
    medians: dict[tuple[str, str], float | None] = {}
    rows: list[dict[str, Any]] = []
    for policy, scenario in keys:
        mine = [r for r in runs if r.policy == policy and r.scenario == scenario]
        med, iqr = _median_iqr([r.tta_s for r in mine])
        bytes_med, _ = _median_iqr([_as_float(r.bytes_to_target) for r in mine])
        medians[(policy, scenario)] = med
        rows.append(
            {
                "policy": policy,
                "scenario": scenario,
                "tta_median_s": med,
                "tta_iqr_s": iqr,
                "speedup_vs_bsp": None,
                "final_accuracy_median": float(np.median([r.final_accuracy for r in mine])),
                "tta_ideal_s": tta_ideal_s.get(scenario),
                "bytes_to_target_median": bytes_med,
            }
        )
    for row in rows:
        bsp = medians.get(("bsp", row["scenario"]))
        mine_med = row["tta_median_s"]
        if bsp is not None and mine_med:
            row["speedup_vs_bsp"] = bsp / mine_med
    return rows


# --- schema ----------------------------------------------------------------------------------------

RUN_KEYS = {
    "policy": (str,),
    "scenario": (str,),
    "seed": (int,),
    "lr": (float, int),
    "tta_s": (float, int, type(None)),
    "final_accuracy": (float, int),
    "samples_per_s": (float, int),
    "idle_fraction": (dict,),
    "staleness_mean": (float, int),
    "staleness_p95": (float, int),
    "bytes_up": (int,),
    "bytes_down": (int,),
    "bytes_to_target": (int, type(None)),
    "pushes": (int,),
    "releases": (int,),
    "curve": (list,),
    "stages": (list,),
}
SUMMARY_KEYS = {
    "policy": (str,),
    "scenario": (str,),
    "tta_median_s": (float, int, type(None)),
    "tta_iqr_s": (float, int, type(None)),
    "speedup_vs_bsp": (float, int, type(None)),
    "final_accuracy_median": (float, int),
    "tta_ideal_s": (float, int, type(None)),
    "bytes_to_target_median": (float, int, type(None)),
}


def check_results(doc: Any) -> None:
    """Raise ValueError naming the first place where ``doc`` breaks the ``results.json`` schema."""
    if not isinstance(doc, dict) or set(doc) != {"runs", "summary"}:
        raise ValueError("results.json must be an object with exactly 'runs' and 'summary'")
    for part, keys in (("runs", RUN_KEYS), ("summary", SUMMARY_KEYS)):
        if not isinstance(doc[part], list):
            raise ValueError(f"{part} must be a list")
        for i, rec in enumerate(doc[part]):
            optional = {"links", "evals"} if part == "runs" else set()  # real mode only
            if not isinstance(rec, dict) or set(rec) - optional != set(keys):
                got = sorted(rec) if isinstance(rec, dict) else type(rec).__name__
                raise ValueError(f"{part}[{i}] must have exactly keys {sorted(keys)}, got {got}")
            for key, types in keys.items():
                value = rec[key]
                if isinstance(value, bool) or not isinstance(value, types):
                    raise ValueError(f"{part}[{i}].{key} has type {type(value).__name__}")
    for i, rec in enumerate(doc["runs"]):
        if not isinstance(rec.get("links", {}), dict):  # real mode: which links the run had
            raise ValueError(f"runs[{i}].links must be an object, got {rec['links']!r}")
        if rec.get("evals", "live") not in ("live", "deferred"):
            raise ValueError(f"runs[{i}].evals must be live or deferred, got {rec['evals']!r}")
        for w, f in rec["idle_fraction"].items():
            if not isinstance(f, float | int) or not 0 <= f <= 1:
                raise ValueError(f"runs[{i}].idle_fraction[{w!r}] must be in [0, 1], got {f!r}")
        for point in rec["curve"]:
            if not (isinstance(point, list) and len(point) == 2):
                raise ValueError(f"runs[{i}].curve points must be [t, accuracy], got {point!r}")
        for switch in rec["stages"]:
            if not (isinstance(switch, list) and len(switch) == 2 and isinstance(switch[1], str)):
                raise ValueError(f"runs[{i}].stages items must be [t, stage], got {switch!r}")
