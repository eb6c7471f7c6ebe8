"""``hetd``: the daemon's command line (serve, demo). The logic lives in the library modules."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
from typing import Any


def _json_params(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("policy parameters must be a JSON object")
    return value


def parser() -> argparse.ArgumentParser:
    """The command line of ``hetd``."""
    p = argparse.ArgumentParser(
        prog="hetd",
        description="hetd: a parameter server for heterogeneous workers. Tokens come from the "
        "config file or HETD_WORKER_TOKEN / HETD_ADMIN_TOKEN, never from the command line.",
    )
    p.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("serve", help="run the daemon (what systemd runs)")
    s.add_argument("--config", default=None, help="TOML config file; every key has a default")
    s.add_argument("--host", default=None, help="override [server] host")
    s.add_argument("--port", type=int, default=None, help="override [server] port")

    d = sub.add_parser("demo", help="a daemon and 4 local workers of different speeds on mnist5k")
    d.add_argument("--out", default=None, help="write summary.json and accuracy.png here")
    d.add_argument("--policy", default="ssp", help="policy name (default ssp)")
    d.add_argument(
        "--policy-params",
        type=_json_params,
        default=None,
        help='JSON object of policy parameters (default {"staleness": 3} for ssp)',
    )
    d.add_argument(
        "--slowdowns", default="1,1,2,4", help="one emulated slow-down per worker (default 1,1,2,4)"
    )
    d.add_argument("--dataset", default="mnist5k", help="data set (default mnist5k)")
    d.add_argument("--target", type=float, default=0.92, help="stop at this test accuracy")
    d.add_argument("--budget", type=float, default=150.0, help="stop after this many seconds")
    d.add_argument("--lr", type=float, default=0.2, help="the daemon's SGD learning rate")
    d.add_argument("--quiet", action="store_true", help="no progress bar")
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``hetd``."""
    args = parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
    )
    from hetd.config import ConfigError

    try:
        if args.command == "serve":
            return _serve(args)
        if args.command == "demo":
            return _demo(args)
    except ConfigError as exc:
        print(f"hetd: config: {exc}", file=sys.stderr)
        return 2
    except ValueError as exc:
        print(f"hetd: {exc}", file=sys.stderr)
        return 2
    return 2


def _serve(args: argparse.Namespace) -> int:
    from hetd import config
    from hetd.daemon import serve

    cfg = config.load(args.config)
    overrides = {k: v for k, v in (("host", args.host), ("port", args.port)) if v is not None}
    if overrides:
        cfg = config.replace(cfg, "server", **overrides)
    asyncio.run(serve(cfg))
    return 0


def _demo(args: argparse.Namespace) -> int:
    from hetd.demo import DemoOptions, run_demo

    params = args.policy_params
    if params is None:
        params = {"staleness": 3} if args.policy == "ssp" else {}
    opts = DemoOptions(
        policy=args.policy,
        policy_params=tuple(sorted(params.items())),
        slowdowns=tuple(float(s) for s in args.slowdowns.split(",")),
        dataset=args.dataset,
        target=args.target,
        budget_s=args.budget,
        lr=args.lr,
        out=args.out,
        quiet=args.quiet,
    )
    summary = asyncio.run(run_demo(opts))
    reached = summary["time_to_target_s"]
    print(
        f"final test accuracy {summary['final_accuracy']:.4f} after {summary['elapsed_s']:.1f}s "
        f"({summary['updates_applied']} updates, {summary['pushes_per_s']:.0f} pushes/s); "
        + (
            f"target {summary['target_accuracy']} reached at {reached:.1f}s"
            if reached
            else f"target {summary['target_accuracy']} not reached"
        )
    )
    if args.out:
        print(f"wrote {args.out}/summary.json and {args.out}/accuracy.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
