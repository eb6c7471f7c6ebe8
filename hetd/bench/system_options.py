"""The command-line options of ``hetd bench --suite system`` (kept apart from
:mod:`hetd.bench.system` so that building ``hetd``'s parser imports nothing heavy)."""

from __future__ import annotations

import argparse

PARTS = ("throughput", "big", "latency", "startup")


def add_options(p: argparse.ArgumentParser) -> None:
    """Add the system suite's options to a parser (``hetd bench`` or ``python -m``)."""
    g = p.add_argument_group("--suite system")
    g.add_argument(
        "--params", default=None, help="model sizes, e.g. 200000,1e6 (default 0.2M,1M,10M)"
    )
    g.add_argument("--codecs", default=None, help="codecs among none,bf16,int8 (default all)")
    g.add_argument("--senders", default=None, help="sender counts (default 1,4,8)")
    g.add_argument(
        "--big-params",
        default=None,
        help="parameters of the big-model rows (part big: 1 sender, int8 and none; default 1e8)",
    )
    g.add_argument(
        "--seconds",
        type=float,
        default=2.0,
        help="measured window of each hetd run and of each limit run (default 2)",
    )
    g.add_argument(
        "--parts",
        default=",".join(PARTS),
        help="parts to run, among " + ",".join(PARTS) + " (default all)",
    )
    g.add_argument(
        "--no-shm",
        action="store_true",
        help="senders keep the websocket (default: a row for each path, websocket and the "
        "shared memory the daemon offers same-host workers)",
    )
    g.add_argument(
        "--pservers",
        default=None,
        help="the pservers axis, e.g. 1,2: 1 is the daemon alone; S >= 2 a daemon with S pserver "
        "processes, the senders sending each its part of every push; every S of a cell runs side "
        "by side, windows alternated, and the pservers' targets are printed (default 1); "
        "--suite chaos: S local pservers behind each run's daemon, one killed (default 0)",
    )
    g.add_argument(
        "--pserver-backends",
        default=None,
        help="who starts the pservers at S >= 2, among local,ray (default local; ray needs "
        "pip install 'hetd[ray]' and starts a Ray instance on this host)",
    )
    g.add_argument(
        "--pserver-heads",
        default=None,
        help="what the daemon takes of each push at S >= 2, among whole,headers: whole, the "
        "push as today (the head applies it too); headers, its header only (the head holds no "
        "parameters, [pservers] headers = true); each is a variant of its own (default whole); "
        "--suite chaos: headers gives each run's daemon [pservers] headers = true",
    )
    g.add_argument(
        "--latency-workers",
        type=int,
        default=256,
        help="connected workers in the latency run, 4 of them pushing (default 256; 0: skip)",
    )
    g.add_argument(
        "--startup-workers",
        type=int,
        default=4,
        help="local hetd-worker processes in the start-up run (default 4; 0: skip)",
    )
