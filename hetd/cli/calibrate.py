"""``hetd calibrate``: measure this machine's costs for the simulator."""

from __future__ import annotations

import argparse

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
    from hetd.bench.calibrate import run_command

    return run_command(args)
