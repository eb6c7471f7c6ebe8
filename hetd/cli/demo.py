"""``hetd demo``: a daemon and local workers of different speeds, in one command."""

from __future__ import annotations

import argparse
import asyncio
from typing import Any

from hetd.cli.common import Sub, json_params


def add_demo(sub: Sub) -> None:
    d = sub.add_parser("demo", help="a daemon and 4 local workers of different speeds on mnist5k")
    d.add_argument("--out", default=None, help="write summary.json and accuracy.png here")
    d.add_argument(
        "--policy",
        default="auto",
        help="policy name (default auto: the daemon picks among the synchronization policies)",
    )
    d.add_argument(
        "--policy-params",
        type=json_params,
        default=None,
        help="JSON object of policy parameters (default: the policy's own; ssp's staleness 3)",
    )
    d.add_argument(
        "--slowdowns", default="1,1,2,4", help="one emulated slow-down per worker (default 1,1,2,4)"
    )
    d.add_argument(
        "--model",
        choices=("mlp", "transformer"),
        default="mlp",
        help="mlp (default, on mnist5k) or transformer: the 0.5M byte-level language model on the "
        "standard library's documentation (pydoc), Adam, to a test loss of 2.7 nats per byte; it "
        "writes text from a prompt at the end",
    )
    d.add_argument("--dataset", default=None, help="data set (default mnist5k; pydoc for an LM)")
    d.add_argument(
        "--task",
        default=None,
        metavar="SPEC",
        help="train your own hetd.Task instead (pkg.module:attr or path/file.py:attr; every "
        "worker loads the same one) and stop at its target",
    )
    d.add_argument(
        "--target",
        type=float,
        default=None,
        help="stop at this test accuracy (default 0.92), or test loss for --model transformer",
    )
    d.add_argument("--budget", type=float, default=150.0, help="stop after this many seconds")
    d.add_argument(
        "--lr", type=float, default=None, help="the daemon's learning rate (default 0.2; LM 0.003)"
    )
    d.add_argument("--prompt", default=None, help='the LM writes after this (default "The ")')
    d.add_argument("--quiet", action="store_true", help="no progress bar")
    d.set_defaults(run=_demo)


def _demo(args: argparse.Namespace) -> int:
    from hetd.local.demo import TRANSFORMER, DemoOptions, result_text, run_demo
    from hetd.local.demo import replace as replace_opts

    params = args.policy_params
    if params is None:
        params = {"staleness": 3} if args.policy == "ssp" else {}
    base = TRANSFORMER if args.model == "transformer" else DemoOptions()
    changes: dict[str, Any] = {
        "policy": args.policy,
        "policy_params": tuple(sorted(params.items())),
        "slowdowns": tuple(float(s) for s in args.slowdowns.split(",")),
        "budget_s": args.budget,
        "out": args.out,
        "quiet": args.quiet,
    }
    if args.dataset is not None:
        changes["dataset"] = args.dataset
    if args.task is not None:
        changes["task"] = args.task
    if args.lr is not None:
        changes["lr"] = args.lr
    if args.target is not None:
        changes["target_loss" if base.target_loss > 0 else "target"] = args.target
    if args.prompt is not None:
        changes["prompt"] = args.prompt
    opts = replace_opts(base, **changes)
    summary = asyncio.run(run_demo(opts))
    print(result_text(summary))
    if args.out:
        print(f"wrote {args.out}/summary.json and {args.out}/accuracy.png")
    return 0
