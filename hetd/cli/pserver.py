"""``hetd pserver``: run one pserver process, following a head's decision log."""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path

from hetd.cli.common import Sub


def add_pserver(sub: Sub) -> None:
    p = sub.add_parser(
        "pserver",
        help="run one pserver: a slice of the model following the head's decision log",
        description="Run one pserver: it connects to the head's link ([pservers] host and port "
        "of a daemon with [pservers] log = true and servers >= 1), holds slice SLICE of the "
        "parameters with its own optimizer state, takes push parts on its own port (written to "
        "DIR/port) and saves its slice in DIR at each checkpoint. Restarted on the same DIR it "
        "goes on from its newest saved slice and the parts it had taken. Exit status 3: the "
        "slice cannot go on (it disagrees with the log, or has nothing to start from).",
    )
    p.add_argument("--head", required=True, help="the head's link, HOST:PORT")
    p.add_argument("--slice", type=int, required=True, help="which slice (0 .. servers-1)")
    p.add_argument("--dir", required=True, help="this pserver's state directory")
    p.add_argument(
        "--listen",
        default="127.0.0.1:0",
        help="HOST:PORT for push parts (default: a free port on loopback, written to DIR/port)",
    )
    p.add_argument(
        "--parent",
        type=int,
        default=0,
        help="stop (as on SIGTERM) when the process PARENT ends (Linux; set by a daemon that "
        "supervises its pservers)",
    )
    p.set_defaults(run=_pserver)


def _address(text: str, what: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"{what} must be HOST:PORT, got {text!r}")
    return host or "127.0.0.1", int(port)


def _pserver(args: argparse.Namespace) -> int:
    from hetd.server.pserver_proc import exit_with_parent, run

    head = _address(args.head, "--head")
    listen = _address(args.listen, "--listen")
    if args.slice < 0:
        raise ValueError(f"--slice must be >= 0, got {args.slice}")
    if args.parent:
        exit_with_parent(args.parent)
    return asyncio.run(run(head, args.slice, Path(args.dir), listen))
