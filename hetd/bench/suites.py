"""The bench's runs that take more than one step: each step is a module of its own, and this one runs
them in order and hands each result to the next.

Owns :func:`runner_for` (a mode's run function: :func:`hetd.sim.loop.run_sim` in virtual time, or
:func:`hetd.bench.real.run_real`, a real daemon and real worker processes), :func:`run_policies`
(``hetd bench --suite policies``), :func:`run_parity` (``hetd bench --suite parity``),
:func:`run_auto` (``hetd bench --suite auto``: the sweep on each scenario, judged by
:mod:`hetd.bench.auto_suite`) and the cost profile in two steps, :func:`calibrate_scenario` and
:func:`~hetd.bench.cluster_costs.with_cluster` (``hetd calibrate``).

The steps import none of each other: the sweep (:mod:`hetd.bench.sweep`) is given its runner, the
end-to-end fit (:mod:`hetd.bench.cluster_costs`) the real runner it times, the comparison
(:mod:`hetd.bench.parity`) the two sweeps' documents, auto's (:mod:`hetd.bench.auto_suite`) the
sweeps' documents and auto's switches, and the pieces' timings
(:mod:`hetd.bench.calibrate`) need no real run at all.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hetd.bench import auto_suite, parity
from hetd.bench import calibrate as pieces
from hetd.bench.cluster_costs import with_cluster
from hetd.bench.real import EvalOptions, check_real, run_real
from hetd.bench.sweep import BenchOptions, Runner, run_bench
from hetd.sim.costs import CostProfile, load_costs, write_costs
from hetd.sim.loop import run_sim
from hetd.sim.results import PolicySpec, RunResult
from hetd.sim.scenario import Scenario, load_scenario
from hetd.sim.scenario import replace as replace_scenario
from policies import make_policy
from policies.auto import AutoState


def runner_for(mode: str, links: str = "emulated", evals: str = "deferred") -> Runner:
    """The run function of a mode (real mode: with ``links`` and ``evals``)."""
    if mode == "sim":

        def sim(
            sc: Scenario, p: PolicySpec, seed: int, lr: float, on_time: Callable[[float], None]
        ) -> RunResult:
            return run_sim(sc, p, seed, lr, on_time).result

        return sim
    if mode == "real":
        return functools.partial(run_real, links=links, evals=EvalOptions(evals))
    raise ValueError(f"unknown mode {mode!r}; use sim or real")


def run_policies(opts: BenchOptions) -> dict[str, Any]:
    """Every policy × seed of ``opts`` in ``opts.mode``, written to ``opts.out``; the results
    document."""
    return run_bench(opts, runner_for(opts.mode, opts.links, opts.evals))


# --- the cost profile ---------------------------------------------------------------------------


def calibrate_scenario(
    sc: Scenario,
    out: Path,
    repeats: int = pieces.REPEATS,
    quiet: bool = False,
    cluster: bool = True,
) -> CostProfile:
    """Measure the profile of ``sc`` (``cluster``: with its end-to-end terms) and write it to
    ``out``."""
    progress = None if quiet else (lambda m: print(f"calibrate: {m}", file=sys.stderr))
    profile = pieces.calibrate(pieces.target_for(sc), repeats, progress)
    if cluster:
        profile = with_cluster(profile, sc, run_real, progress)
    write_costs(out, profile)
    return profile


# --- sim against real ---------------------------------------------------------------------------


def _real_runner(
    lrs: Mapping[str, float], links: str = "emulated", evals: str = "deferred"
) -> Runner:
    """The real runner (with ``links`` and ``evals``), each policy at the learning rate its sim
    runs used (``--tune-lr``)."""
    real = runner_for("real", links, evals)

    def run(
        sc: Scenario, p: PolicySpec, seed: int, lr: float, on_time: Callable[[float], None]
    ) -> RunResult:
        return real(sc, p, seed, lrs.get(p.label, lr), on_time)

    return run


def run_parity(opts: BenchOptions, calibrate: bool = False) -> dict[str, Any]:
    """Sweep ``opts`` in sim mode into ``opts.out/sim`` and in real mode into ``opts.out/real``
    (``opts.mode`` is ignored; with ``tune_lr`` the lrs are chosen in sim and reused in real),
    write ``parity.json``, ``parity.md`` and ``parity.png`` to ``opts.out``; return the document.

    ``calibrate``: first measure this machine's cost profile for the scenario
    (:func:`calibrate_scenario`, written to ``OUT/costs.json``) and charge it in the sim runs.
    The profile the sim runs charged (that one, or the scenario's ``costs``) is in
    ``parity.json`` under ``costs``."""
    try:
        check_real(opts.scenario)  # refuse before the sim sweep, not after it
    except ValueError as exc:
        raise ValueError(f"--suite parity also runs --mode real, which cannot: {exc}") from None
    sc = opts.scenario
    if calibrate:
        path = opts.out / "costs.json"
        calibrate_scenario(sc, path, quiet=opts.quiet)
        sc = replace_scenario(sc, costs=str(path))
    sim_opts = dataclasses.replace(opts, scenario=sc, mode="sim", out=opts.out / "sim")
    sim = run_bench(sim_opts, runner_for("sim"))
    lrs = {r["policy"]: r["lr"] for r in sim["runs"]}
    real_opts = dataclasses.replace(opts, mode="real", out=opts.out / "real", tune_lr=False)
    real = run_bench(real_opts, _real_runner(lrs, opts.links, opts.evals))
    doc = parity.compare(sim, real, opts.scenario, opts.seeds)
    doc["links"] = opts.links  # the real runs' links: emulated, or netns (hetd.bench.links)
    doc["evals"] = opts.evals  # the real runs' evaluations: deferred, or live (hetd.bench.real)
    if sc.costs:
        doc["costs"] = {"file": sc.costs, **load_costs(sc.costs).to_json()}
    parity.write_parity(opts.out, doc)
    return doc


# --- auto against the fixed policies -------------------------------------------------------------


@dataclass(frozen=True)
class AutoOptions:
    """What ``hetd bench --suite auto`` takes."""

    out: Path
    policies: tuple[PolicySpec, ...]  # the fixed policies; auto chooses among them
    scenarios: tuple[str, ...] = auto_suite.DEFAULT_SCENARIOS  # packaged names or files
    seeds: int = 3
    mode: str = "sim"  # sim | real
    plan_every_s: float | None = None  # None: each scenario's budget × PLAN_FRACTION
    auto_params: tuple[tuple[str, Any], ...] = ()  # --auto: auto's own parameters, overriding
    budget_s: float | None = None  # every scenario's budget (None: its own)
    lr: float | None = None
    quiet: bool = False
    links: str = "emulated"
    evals: str = "deferred"


def _recording_runner(mode: str, links: str, evals: str, switches: dict[int, list[Any]]) -> Runner:
    """The mode's runner; in sim mode it also keeps each auto run's switches by seed, read from
    the policy's final state (the real runner returns no state: nothing is kept)."""
    if mode != "sim":
        return runner_for(mode, links, evals)

    def sim(
        sc: Scenario, p: PolicySpec, seed: int, lr: float, on_time: Callable[[float], None]
    ) -> RunResult:
        run = run_sim(sc, p, seed, lr, on_time)
        state = run.engine.host.state
        if isinstance(state, AutoState):  # its last HISTORY (8) switches
            switches[seed] = state.describe()["switches"]
        return run.result

    return sim


def run_auto(opts: AutoOptions) -> dict[str, Any]:
    """Per scenario, the policies sweep of the fixed policies and auto (with a planning round
    every ``plan_every_s``, a scenario override) into ``opts.out/<scenario>/``; then
    ``auto.json`` and ``auto.md`` in ``opts.out``. Returns the suite's document."""
    if opts.seeds < 1:
        raise ValueError(f"--seeds must be >= 1, got {opts.seeds}")
    if not opts.scenarios:
        raise ValueError("no scenario given; e.g. --scenarios S1,S4")
    if any(p.name == "auto" for p in opts.policies):
        raise ValueError(
            "--policies are the fixed policies auto is compared with; give auto's "
            "own parameters with --auto"
        )
    loaded = []
    for name in opts.scenarios:  # a bad name or file is refused before any run
        sc = load_scenario(name)
        if opts.budget_s is not None:
            sc = replace_scenario(sc, budget_s=opts.budget_s)
        every = opts.plan_every_s or sc.budget_s * auto_suite.PLAN_FRACTION
        sc = replace_scenario(sc, plan_every_s=every)
        spec = auto_suite.auto_spec(opts.policies, every, dict(opts.auto_params))
        make_policy(spec.name, spec.build_params())  # bad parameters fail now, not after a sweep
        loaded.append((sc, spec))
    if opts.mode == "real":
        for sc, _ in loaded:
            check_real(sc)
    names = [sc.name for sc, _ in loaded]
    if len(set(names)) != len(names):
        raise ValueError(f"a scenario is listed twice: {names}")
    rows = []
    for sc, spec in loaded:
        switches: dict[int, list[Any]] = {}
        bench = BenchOptions(
            scenario=sc,
            policies=(*opts.policies, spec),
            out=opts.out / sc.name,
            seeds=opts.seeds,
            mode=opts.mode,
            lr=opts.lr,
            quiet=opts.quiet,
            links=opts.links,
            evals=opts.evals,
        )
        results = run_bench(bench, _recording_runner(opts.mode, opts.links, opts.evals, switches))
        rows.append(
            auto_suite.scenario_row(
                results,
                scenario=sc.name,
                budget_s=sc.budget_s,
                plan_every_s=sc.plan_every_s,
                auto=spec.label,
                switches=switches if opts.mode == "sim" else None,
            )
        )
    doc = auto_suite.judge(rows, seeds=opts.seeds, mode=opts.mode)
    auto_suite.write(opts.out, doc)
    return doc
