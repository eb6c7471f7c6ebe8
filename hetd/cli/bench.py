"""The ``hetd sim`` and ``hetd bench`` commands: argument parsing only; the work is in
:mod:`hetd.sim.loop` and the bench's suites (:mod:`hetd.bench.suites` runs those of several steps).

``hetd.cli.main`` calls :func:`add_commands` with its sub-parsers; both commands run
:func:`run_command` with their parsed arguments.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hetd.bench.sweep import BenchOptions

COMMANDS = ("sim", "bench")

POLICY_HELP = (
    "policies by registered name with optional parameters, comma-separated: "
    "NAME[:KEY=VALUE[;KEY=VALUE...]], e.g. 'bsp,asp,ssp:staleness=3' or "
    "'ssp:staleness=2;weight=0.5' (quote ';' in the shell; 'ssp:staleness=2,weight=0.5' works too)"
)


SCENARIO_COST = """\
time charged per step: base_step_s x batch/base_batch x slowdown x straggle
                       + 2 x latency_s + (params bytes + push bytes) / bandwidth
                       + with a cost profile (--costs, hetd calibrate): the worker's encode,
                         decode and fixed overhead, and the daemon's queue (decode, apply,
                         publish, per message); evaluations recorded eval_s late
docs/benchmark.md ("Scenarios") describes the packaged scenarios and what each key means.
"""


def scenario_epilog() -> str:
    """Every key of a scenario file (from its validation rules, so the list is whole), then how
    the simulator charges a step."""
    from hetd.sim.scenario import keys_help

    head = "scenario files (TOML or JSON; an unknown key is an error that names it):"
    return "\n".join([head, *("  " + line for line in keys_help()), SCENARIO_COST])


def _scenario_help() -> str:
    from hetd.sim.scenario import scenario_names

    return (
        "a packaged scenario (" + ", ".join(scenario_names()) + "; case-insensitive) or the path "
        "of your own .toml/.json scenario file (default S1)"
    )


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--scenario", default="S1", help=_scenario_help())
    p.add_argument(
        "--budget",
        type=float,
        default=None,
        metavar="SECONDS",
        help="override the scenario's time budget (virtual s in sim mode, wall s in real mode)",
    )
    p.add_argument(
        "--lr",
        type=float,
        default=None,
        help="the daemon's learning rate for every policy (default: the scenario's lr)",
    )
    p.add_argument(
        "--costs",
        default=None,
        metavar="FILE",
        help="the simulator charges this cost profile (written by hetd calibrate; overrides the "
        "scenario's costs key); default: the scenario's, else none (docs/benchmark.md)",
    )
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def add_commands(sub: Any) -> None:
    """Add the ``sim`` and ``bench`` sub-commands to ``hetd``'s sub-parsers."""
    s = sub.add_parser(
        "sim",
        help="simulate one policy on a scenario in virtual time (real engine, real gradients)",
        description="Run the real engine and policy under a virtual clock with emulated workers "
        "that compute real JAX gradients; deterministic per seed. Writes results.json, "
        "summary.md and PNG plots to --out when given.",
        epilog=scenario_epilog(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _common(s)
    s.add_argument(
        "--policy", default="ssp", help="one policy, NAME[:KEY=VALUE[;...]] (default ssp)"
    )
    s.add_argument("--seed", type=int, default=0, help="the run's seed (default 0)")
    s.add_argument("--out", default=None, help="directory for results.json, summary.md, PNGs")
    s.set_defaults(run=run_command)

    b = sub.add_parser(
        "bench",
        help="run policies x seeds on a scenario; write results.json, summary.md and plots",
        description="Time-to-accuracy benchmark (docs/benchmark.md): every policy x seed on one "
        "scenario, same global batch and budget; writes OUT/results.json, OUT/summary.md, "
        "OUT/accuracy.png, OUT/timeline.png and OUT/batch_shares.png.",
        epilog=scenario_epilog(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _common(b)
    b.add_argument(
        "--suite",
        choices=("policies", "codecs", "system", "parity", "chaos", "soak", "dpmp", "auto"),
        default="policies",
        help="policies: time-to-accuracy of --policies on --scenario (docs/benchmark.md, the "
        "default); codecs: codec GB/s vs memcpy, written to OUT/codecs.json (hetd.bench.codec_speed; "
        "its other options: python -m hetd.bench.codec_speed --help); system: the daemon's updates/s "
        "against the loopback websocket limit, engine latency and start-up, written to "
        "OUT/system.json and OUT/system.md (hetd.bench.system; options below); parity: the "
        "policies suite in both modes (OUT/sim/, OUT/real/) compared: median TTA ratio real/sim, "
        "ranks, a verdict, written to OUT/parity.json, OUT/parity.md and OUT/parity.png "
        "(hetd.bench.parity; --mode is ignored; with --tune-lr the lrs are chosen in sim mode); "
        "chaos: a real daemon subprocess and hetd-worker processes under a seeded fault schedule "
        "(worker SIGKILL, stall, cut, one daemon SIGKILL and restart) against a fault-free run: "
        "goodput, duplicate applies, versions lost, recovery times, written to OUT/chaos.json and "
        "OUT/chaos.md (hetd.bench.chaos; options below, and --pservers S with --pserver-heads "
        "whole or headers); soak: a real daemon and --workers "
        "light protocol-v1 workers (no compute, no JAX) for --minutes: the daemon's memory "
        "growth after the first minute and every error, written to OUT/soak.json and OUT/soak.md "
        "(hetd.bench.soak); dpmp: the dpmp policy against lbbsp on the memory-poor scenarios B, "
        "C, D, E over --seeds, batch time side by side in the pipeline simulator (the planner's "
        "structure), the engine's simulator (the policies on the packaged scenarios) and, with "
        "--mode real (slow: a real daemon and worker processes, 20 s per run, seed 0 only), real "
        "mode; the budget run; against the targets, written to OUT/dpmp.json, OUT/dpmp.md and "
        "OUT/dpmp_budget.png (hetd.bench.dpmp); auto: every fixed policy "
        "(--policies, default auto's candidates) and auto on each of --scenarios over --seeds, "
        "auto planning every --plan-every s: each scenario's best fixed policy against auto, the "
        "geometric means and a verdict, written to OUT/auto.json, OUT/auto.md and each "
        "scenario's sweep to OUT/<scenario>/ (hetd.bench.auto_suite; options below)",
    )
    b.add_argument(
        "--mode",
        choices=("sim", "real"),
        default="sim",
        help="sim: virtual-time simulation (deterministic, fast); real: a real daemon and real "
        "hetd-worker processes on loopback slowed by emulation, for the budget in wall time "
        "(ignored by --suite parity, which runs both)",
    )
    b.add_argument(
        "--links",
        choices=("emulated", "netns"),
        default="emulated",
        help="real mode's links: emulated (the worker sleeps bytes / bandwidth, the default) or "
        "netns (as root: each worker in its own network namespace behind a veth pair shaped with "
        "tbf both ways to its bandwidth, 198.51.100.0/24 addresses, removed afterwards; without "
        "root or ip/tc: says so and uses emulated links); for --mode real and --suite parity; "
        "--suite chaos: unshaped links, and a cut sets the worker's link down",
    )
    b.add_argument(
        "--evals",
        choices=("deferred", "live"),
        default="deferred",
        help="real mode's evaluations: deferred (the default: the parameters at each evaluation "
        "are kept, 1 GiB in memory and the rest on disk, and evaluated after the run, so the "
        "probe takes no CPU from what it measures, as in the simulator) or live (the daemon "
        "evaluates in a thread during the run, as hetd serve does); a policy that reads Eval "
        "events (ashl) is always evaluated live. results.json says which each run used; for "
        "--mode real and --suite parity",
    )
    b.add_argument(
        "--policies",
        default=None,
        help=POLICY_HELP + " (default bsp,asp,ssp; --suite auto: auto's candidates "
        "bsp,ssp,asp,lbbsp,hps,adsp,ashl,dssp)",
    )
    b.add_argument("--seeds", type=int, default=3, help="run seeds 0..N-1 (default 3)")
    b.add_argument("--out", default="bench-out", help="output directory (default bench-out)")
    b.add_argument(
        "--tune-lr",
        action="store_true",
        help="pick each policy's lr on seed 0 from --lr-grid (soonest to target, then highest "
        "final accuracy) and freeze it for every seed; the chosen lr is in results.json",
    )
    b.add_argument(
        "--lr-grid",
        default=None,
        metavar="LR,LR,...",
        help="candidates for --tune-lr (default: the scenario's lr_grid, 0.05,0.1,0.2)",
    )
    b.add_argument(
        "--calibrate",
        action="store_true",
        help="--suite parity: run hetd calibrate first (OUT/costs.json) and charge that cost "
        "profile in the sim runs; parity.json records it",
    )
    from hetd.bench.system_options import add_options

    add_options(b)
    _chaos_options(b)
    _auto_options(b)
    b.set_defaults(run=run_command)


def _auto_options(p: argparse.ArgumentParser) -> None:
    from hetd.bench.auto_suite import DEFAULT_SCENARIOS, PLAN_FRACTION

    g = p.add_argument_group("--suite auto")
    g.add_argument(
        "--scenarios",
        default=",".join(DEFAULT_SCENARIOS),
        metavar="S,S,...",
        help="packaged scenarios or scenario files, comma-separated (default: "
        + ",".join(DEFAULT_SCENARIOS)
        + ")",
    )
    g.add_argument(
        "--plan-every",
        type=float,
        default=None,
        metavar="S",
        help="auto's planning rounds, seconds apart, a scenario override; auto's dwell_s is the "
        f"same unless --auto sets it (default: {PLAN_FRACTION:g} x each scenario's budget)",
    )
    g.add_argument(
        "--auto",
        default="",
        metavar="KEY=VALUE[;...]",
        help="auto's own parameters (e.g. 'margin=0.1;dwell_s=4'); by default its candidates are "
        "--policies and it starts on lbbsp when that is one of them",
    )


def _chaos_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("--suite chaos and --suite soak")
    g.add_argument(
        "--workers", type=int, default=None, help="worker processes (chaos: 4, soak: 64)"
    )
    g.add_argument(
        "--minutes", type=float, default=None, help="length of each run (chaos: 3, soak: 10)"
    )
    g.add_argument(
        "--fault-every", type=float, default=30.0, metavar="S", help="one fault every S s (30)"
    )
    g.add_argument("--seed", type=int, default=0, help="the fault schedule's seed (default 0)")


def _floats(text: str, what: str) -> tuple[float, ...]:
    try:
        values = tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ValueError(f"{what} must be comma-separated numbers, got {text!r}") from None
    if not values or any(v <= 0 for v in values):
        raise ValueError(f"{what} must be positive numbers, got {text!r}")
    return values


def _scenario(args: argparse.Namespace) -> Any:
    from hetd.sim.scenario import load_scenario, replace

    sc = load_scenario(args.scenario)
    if args.budget is not None:
        sc = replace(sc, budget_s=args.budget)
    if args.costs is not None:
        from hetd.sim.costs import load_costs

        load_costs(args.costs)  # a bad profile is refused now, not after the first run
        sc = replace(sc, costs=args.costs)
    return sc


def run_command(args: argparse.Namespace) -> int:
    """Run ``hetd sim`` or ``hetd bench``; returns the exit code. Bad input prints one line."""
    from policies.registry import PolicyError

    try:
        if args.lr is not None and not args.lr > 0:
            raise ValueError(f"--lr must be > 0, got {args.lr}")
        if args.command == "sim":
            return _sim(args)
        if args.command == "bench":
            return _bench(args)
    except (ValueError, PolicyError, OSError) as exc:  # ScenarioError is a ValueError
        print(f"hetd {args.command}: {exc}", file=sys.stderr)
        return 2
    print(f"hetd: unknown command {args.command!r}; this module runs {COMMANDS}", file=sys.stderr)
    return 2


def _sim(args: argparse.Namespace) -> int:
    from hetd.bench.sweep import ideal_tta, write_outputs
    from hetd.sim.loop import run_sim
    from hetd.sim.results import parse_policies, summarize

    sc = _scenario(args)
    specs = parse_policies(args.policy)
    if len(specs) != 1:
        raise ValueError(f"hetd sim runs one policy; got {len(specs)} (use hetd bench for more)")
    from tqdm import tqdm

    t0 = time.monotonic()
    with tqdm(total=sc.budget_s, unit="s", desc=f"{sc.name} sim", disable=args.quiet) as bar:
        run = run_sim(sc, specs[0], args.seed, args.lr, lambda t: bar.update(t - bar.n))
    wall = time.monotonic() - t0
    r = run.result
    reached = "not reached" if r.tta_s is None else f"reached at {r.tta_s:g} s"
    target = sc.target_text if sc.target_loss > 0 else f"{sc.target_accuracy:g}"
    print(
        f"{sc.name} {r.policy} seed {r.seed}: target {target} {reached}; "
        f"final accuracy {r.final_accuracy:.4f} at {run.virtual_s:g} virtual s; "
        f"{run.pushes} pushes, {r.samples_per_s:.0f} samples/s; simulated in {wall:.1f} s"
    )
    if args.out:
        ideal = ideal_tta(sc, [r.lr], [args.seed])
        doc = {"runs": [r.to_json()], "summary": summarize([r], {sc.name: ideal})}
        write_outputs(Path(args.out), doc, [r], sc, "sim")
        print(
            f"wrote {args.out}/results.json, summary.md, accuracy.png, timeline.png, "
            "batch_shares.png"
        )
    return 0


def _bench(args: argparse.Namespace) -> int:
    from hetd.bench.suites import run_policies
    from hetd.bench.sweep import BenchOptions
    from hetd.sim.results import parse_policies

    if args.links == "netns" and args.suite not in ("policies", "parity", "chaos"):
        raise ValueError(
            f"--links netns is for --mode real and --suites parity and chaos, not {args.suite}"
        )
    if args.suite == "codecs":
        from hetd.bench import codec_speed as bench_codecs

        return bench_codecs.main(["--out", args.out])
    if args.suite == "system":
        from hetd.bench import system as bench_system

        return bench_system.run_main(bench_system.options_from(args))
    if args.suite == "chaos":
        return _chaos(args)
    if args.suite == "soak":
        return _soak(args)
    if args.suite == "dpmp":
        return _dpmp(args)
    if args.suite == "auto":
        return _auto(args)

    if args.seeds < 1:
        raise ValueError(f"--seeds must be >= 1, got {args.seeds}")
    if args.calibrate and args.suite != "parity":
        raise ValueError("--calibrate belongs to --suite parity (else run hetd calibrate)")
    if args.calibrate and args.costs is not None:
        raise ValueError("--calibrate measures a cost profile; do not give --costs as well")
    if args.costs is not None and args.suite == "policies" and args.mode == "real":
        raise ValueError("--costs is for the simulator; --mode real pays the real costs")
    if args.evals == "live" and args.suite == "policies" and args.mode == "sim":
        raise ValueError("--evals is for real runs: add --mode real (or --suite parity)")
    sc = _scenario(args)
    links = _links(args, sc.n)
    opts = BenchOptions(
        scenario=sc,
        policies=tuple(parse_policies(args.policies or "bsp,asp,ssp")),
        out=Path(args.out),
        seeds=args.seeds,
        mode=args.mode,
        tune_lr=args.tune_lr,
        lr=args.lr,
        lr_grid=_floats(args.lr_grid, "--lr-grid") if args.lr_grid else None,
        quiet=args.quiet,
        links=links,
        evals=args.evals,
    )
    t0 = time.monotonic()
    if args.suite == "parity":
        return _parity(opts, t0, args.calibrate)
    doc = run_policies(opts)
    wall = time.monotonic() - t0
    print(f"{len(doc['runs'])} runs in {wall:.0f} s ({args.mode} mode); wrote {args.out}/")
    for row in doc["summary"]:
        tta, speed = row["tta_median_s"], row["speedup_vs_bsp"]
        ideal = row["tta_ideal_s"]
        print(
            f"  {row['policy']:<22} TTA median "
            + ("never" if tta is None else f"{tta:7.2f} s")
            + ("" if speed is None else f"  x{speed:.2f} vs BSP")
            + ("" if ideal is None or tta is None else f"  TTA/ideal {tta / ideal:.1f}")
            + f"  final acc {row['final_accuracy_median']:.4f}"
        )
    return 0


def _links(args: argparse.Namespace, workers: int) -> str:
    """The links real runs get: ``--links``, or emulated (saying so in one line) when netns links
    cannot be made here."""
    if args.links == "emulated":
        return "emulated"
    if args.suite == "policies" and args.mode != "real":
        raise ValueError("--links netns is for real runs: add --mode real (or --suite parity)")
    from hetd.bench.links import MAX_WORKERS, unavailable

    if workers > MAX_WORKERS:
        raise ValueError(
            f"--links netns gives each worker a /30 of 198.51.100.0/24: at most {MAX_WORKERS} "
            f"workers, and this run has {workers}"
        )

    why = unavailable()
    if why is not None:
        print(f"hetd bench: {why}; using emulated links", file=sys.stderr)
        return "emulated"
    return "netns"


def _dpmp(args: argparse.Namespace) -> int:
    """``--suite dpmp``: the tables on stdout; OUT/dpmp.json, dpmp.md and dpmp_budget.png."""
    from hetd.bench.dpmp import DpmpOptions, markdown, run_dpmp

    doc = run_dpmp(DpmpOptions(out=Path(args.out), seeds=args.seeds, real=args.mode == "real"))
    print(markdown(doc))
    print(f"dpmp: wrote {args.out}/dpmp.json, dpmp.md and dpmp_budget.png")
    return 0 if doc["verdict"] == "pass" else 1


def _auto(args: argparse.Namespace) -> int:
    """``--suite auto``: the table and verdict on stdout; OUT/auto.json, OUT/auto.md and each
    scenario's sweep in OUT/<scenario>/. Exits 1 when a target misses."""
    from hetd.bench.auto_suite import markdown
    from hetd.bench.suites import AutoOptions, run_auto
    from hetd.sim.results import parse_policies
    from policies.auto_choice import DEFAULT_CANDIDATES

    if args.costs is not None or args.calibrate or args.tune_lr:
        raise ValueError("--suite auto takes no --costs, --calibrate or --tune-lr")
    if args.plan_every is not None and not args.plan_every > 0:
        raise ValueError(f"--plan-every must be > 0 s, got {args.plan_every}")
    auto = parse_policies("auto:" + args.auto)[0] if args.auto.strip() else None
    opts = AutoOptions(
        out=Path(args.out),
        policies=tuple(parse_policies(args.policies or ",".join(DEFAULT_CANDIDATES))),
        scenarios=tuple(s.strip() for s in args.scenarios.split(",") if s.strip()),
        seeds=args.seeds,
        mode=args.mode,
        plan_every_s=args.plan_every,
        auto_params=() if auto is None else auto.params,
        budget_s=args.budget,
        lr=args.lr,
        quiet=args.quiet,
        evals=args.evals,  # real mode's links are emulated: --links netns is refused above
    )
    t0 = time.monotonic()
    doc = run_auto(opts)
    print(markdown(doc))
    print(
        f"auto: {len(doc['scenarios'])} scenario(s) in {time.monotonic() - t0:.0f} s "
        f"({args.mode} mode); wrote {args.out}/auto.json, auto.md and each scenario's sweep"
    )
    return 0 if doc["verdict"]["pass"] else 1


def _soak(args: argparse.Namespace) -> int:
    """``--suite soak``: OUT/soak.json and OUT/soak.md; the table on stdout."""
    import asyncio

    from hetd.bench.soak import SoakOptions, markdown, run_soak

    workers = 64 if args.workers is None else args.workers
    minutes = 10.0 if args.minutes is None else args.minutes
    if workers < 1 or not minutes > 0:
        raise ValueError(f"--workers must be >= 1 and --minutes > 0, got {workers}, {minutes}")
    doc = asyncio.run(run_soak(SoakOptions(out=Path(args.out), workers=workers, minutes=minutes)))
    print(markdown(doc))
    print(f"soak: wrote {args.out}/soak.json and soak.md")
    return 0


def _chaos(args: argparse.Namespace) -> int:
    """``--suite chaos``: the table on stdout; OUT/chaos.json and OUT/chaos.md."""
    from hetd.bench.chaos import ChaosOptions, run_chaos
    from hetd.sim.results import parse_policies

    workers = 4 if args.workers is None else args.workers
    try:  # --pservers is the system suite's axis too (1,2); the chaos suite takes one S
        servers = 0 if args.pservers is None else int(args.pservers)
    except ValueError:
        raise ValueError(
            f"--suite chaos takes --pservers S, one number, got {args.pservers!r}"
        ) from None
    heads = args.pserver_heads or "whole"  # the system suite's option: one value here
    if heads not in ("whole", "headers"):
        raise ValueError(f"--suite chaos takes --pserver-heads whole or headers, got {heads!r}")
    opts = ChaosOptions(
        policies=tuple(parse_policies(args.policies or "bsp,asp,ssp")),
        out=Path(args.out),
        workers=workers,
        minutes=3.0 if args.minutes is None else args.minutes,
        fault_every=args.fault_every,
        seed=args.seed,
        quiet=args.quiet,
        links=_links(args, workers),
        pservers=servers,
        headers=heads == "headers",
    )
    doc = run_chaos(opts)
    print(f"chaos: wrote {args.out}/chaos.json and chaos.md")
    for p in doc["policies"]:
        print(
            f"  {p['policy']:<22} goodput {p['goodput']}  dup/partial applies "
            f"{p['duplicate_or_partial_applies']}  hash mismatches {p['hash_mismatches']}  "
            f"versions lost {p['versions_lost']} (bound {p['lost_bound']})  daemon restarted "
            f"{p['daemon_restarted']}  {p['verdict']}" + "".join(f"; {x}" for x in p["failures"])
        )
        if "pserver_back_verdict" in p:
            print(f"  {p['policy']:<22} {p['pserver_back_verdict']}")
    print(f"chaos: verdict {doc['verdict']}")
    return 0 if doc["verdict"] == "pass" else 1


def _parity(opts: BenchOptions, t0: float, calibrate: bool = False) -> int:
    """``--suite parity``: both modes, then the comparison table and verdict on stdout."""
    from hetd.bench.suites import run_parity

    doc = run_parity(opts, calibrate=calibrate)
    out = opts.out
    print(
        f"parity: {len(doc['policies'])} policies x {opts.seeds} seed(s) in sim and real mode in "
        f"{time.monotonic() - t0:.0f} s; wrote {out}/parity.json, parity.md, parity.png, "
        f"{out}/sim/ and {out}/real/"
    )

    def fmt(x: float | None, none: str = "never") -> str:
        return none if x is None else f"{x:.2f}"

    print(f"  {'policy':<22} {'sim TTA':>8} {'real TTA':>8} {'real/sim':>8}  rank sim/real")
    for label, row in doc["policies"].items():
        print(
            f"  {label:<22} {fmt(row['sim']['tta_median_s']):>8} "
            f"{fmt(row['real']['tta_median_s']):>8} {fmt(row['ratio'], '–'):>8}  "
            f"{row['rank']['sim']}/{row['rank']['real']}"
        )
    print(doc["verdict"]["sentence"])
    return 0


def main(argv: list[str] | None = None) -> int:
    """A stand-alone runner (``python -m hetd.cli.bench bench ...``) until ``hetd`` wires these."""
    p = argparse.ArgumentParser(prog="hetd")
    add_commands(p.add_subparsers(dest="command", required=True))
    return run_command(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
