"""``hetd calibrate``: measure this machine's costs for the simulator."""

from __future__ import annotations

import argparse
import sys

from hetd import config as config_mod
from hetd.cli.common import Sub


def add_calibrate(sub: Sub) -> None:
    c = sub.add_parser(
        "calibrate",
        help="measure this machine's costs for the simulator (a cost profile, JSON)",
        description="Time, with the real code paths, what a real run pays that the simulator "
        "charges from a cost profile: decoding and applying pushes, publishing parameters, the "
        "workers' encode and decode, evaluations, the profile exchange, a fixed cost per message "
        "(docs/benchmark.md, 'The cost profile'). Use it with hetd sim/bench --costs FILE.",
    )
    c.add_argument("--out", required=True, help="the JSON file to write")
    c.add_argument("--scenario", default=None, help="measure for this scenario's model and run")
    c.add_argument("--model", default=None, help="or this model (default: [train] model's)")
    c.add_argument("--dataset", default=None, help="and data set (default: [train] dataset's)")
    c.add_argument("--repeats", type=int, default=15, help="timed runs per figure (median)")
    c.add_argument(
        "--no-cluster",
        action="store_true",
        help="skip the end-to-end terms (exchange_s, release_stagger_s), which --scenario fits "
        "from two short real runs (a real daemon with 1, then all, real workers)",
    )
    c.add_argument("--quiet", action="store_true", help="no progress lines")
    c.set_defaults(run=_calibrate)


def _calibrate(args: argparse.Namespace) -> int:
    """``--scenario`` or ``--model``/``--dataset``, ``--repeats``, ``--out``: the pieces timed, then
    (with ``--scenario``, unless ``--no-cluster``) the end-to-end terms fitted from real runs."""
    from hetd.bench.calibrate import Target, calibrate, describe, target_for
    from hetd.bench.cluster_costs import with_cluster
    from hetd.bench.real import run_real
    from hetd.sim.costs import write_costs
    from hetd.sim.scenario import load_scenario

    if args.scenario and (args.model or args.dataset):
        raise ValueError("give --scenario or --model/--dataset, not both")
    sc = None
    if args.scenario:
        sc = load_scenario(args.scenario)
        target = target_for(sc)
    else:
        train = config_mod.TrainConfig()
        target = Target(model=args.model or train.model, dataset=args.dataset or train.dataset)
    progress = None if args.quiet else (lambda m: print(f"calibrate: {m}", file=sys.stderr))
    profile = calibrate(target, args.repeats, progress)
    if sc is not None and not args.no_cluster:
        profile = with_cluster(profile, sc, run_real, progress)
    write_costs(args.out, profile)
    where = f"scenario {target.scenario}" if target.scenario else f"{target.model}"
    print(
        f"wrote {args.out}: the cost profile of {where} on {target.dataset} "
        f"({profile.about['n_params']} parameters), medians of {args.repeats}"
    )
    for line in describe(profile):
        print(f"  {line}")
    return 0
