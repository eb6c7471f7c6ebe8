"""``hetd-worker URL``: join a hetd daemon and train on whatever device this machine has."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import socket
import sys
import tomllib

from workers.emulate import Emulation, parse_rate
from workers.loop import quiet_xla_threads


def parser() -> argparse.ArgumentParser:
    """The command line of ``hetd-worker``."""
    p = argparse.ArgumentParser(
        prog="hetd-worker",
        description="Join a hetd daemon and train. The worker token comes from HETD_WORKER_TOKEN "
        "or from a config file (--config, key [worker] token), never from the command line.",
    )
    p.add_argument("url", help="the daemon's worker endpoint, e.g. ws://head:7070")
    p.add_argument("--name", default=None, help="a name shown in status (default: host-pid)")
    p.add_argument("--config", default=None, help="TOML file with [worker] token = '...'")
    p.add_argument(
        "--device", default=None, help="JAX device: cpu, gpu, gpu:1 or an index (default: first)"
    )
    p.add_argument(
        "--max-frame-bytes",
        type=int,
        default=64 * 1024 * 1024,
        help="largest websocket frame accepted (match the daemon's max_frame_bytes)",
    )
    p.add_argument("--steps", type=int, default=0, help="stop after this many pushes (0: never)")
    p.add_argument(
        "--max-retries",
        type=int,
        default=-1,
        help="give up after this many failed reconnects (-1: never)",
    )
    p.add_argument(
        "--retry-max-delay",
        type=float,
        default=2.0,
        metavar="SECONDS",
        help="longest wait between reconnect attempts (exponential from 0.5 s, jittered); a "
        "worker started before its daemon joins at most this long after it listens (default 2)",
    )
    p.add_argument(
        "--emulate-slowdown",
        type=float,
        default=1.0,
        metavar="F",
        help="act F times slower than this hardware (F >= 1)",
    )
    p.add_argument(
        "--emulate-base-step",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="pad each step of 32 samples (scaled by the batch) to at least this long "
        "before the slow-down applies",
    )
    p.add_argument(
        "--emulate-bandwidth",
        default=None,
        metavar="RATE",
        help="cap the link both ways (pushes and parameters), e.g. 20MB/s",
    )
    p.add_argument(
        "--emulate-stragglers",
        type=float,
        default=0.0,
        metavar="P",
        help="chance per step of a x5 slow episode (mean 10 steps)",
    )
    p.add_argument(
        "--emulate-memory",
        type=int,
        default=None,
        metavar="BYTES",
        help="report this much free memory instead of the real figure",
    )
    p.add_argument(
        "--emulate-bad-pushes",
        type=float,
        default=0.0,
        metavar="P",
        help="fault injection: chance that a push carries NaN (the daemon refuses it; after 5 "
        "refusals in a row the worker gives up)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed for the emulated stragglers")
    p.add_argument("-v", "--verbose", action="store_true", help="log every connection event")
    return p


def read_token(path: str | None) -> str:
    """The worker token: HETD_WORKER_TOKEN, else ``[worker] token`` in the config file."""
    env = os.environ.get("HETD_WORKER_TOKEN")
    if env:
        return env
    if path is None:
        return ""
    with open(path, "rb") as fh:
        raw = tomllib.load(fh)
    worker = raw.get("worker", {})
    token = worker.get("token", "") if isinstance(worker, dict) else ""
    if not isinstance(token, str):
        raise ValueError(f"{path}: [worker] token must be a string")
    return token


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``hetd-worker``."""
    args = parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
    )
    quiet_xla_threads()
    # Imported after the XLA flags are set.
    from workers.client import FatalError, WorkerOptions, run_worker
    from workers.loop import pick_device

    try:
        emulation = Emulation(
            slowdown=args.emulate_slowdown,
            base_step_s=args.emulate_base_step,
            memory=args.emulate_memory,
            bandwidth=parse_rate(args.emulate_bandwidth) if args.emulate_bandwidth else None,
            stragglers=args.emulate_stragglers,
            bad_pushes=args.emulate_bad_pushes,
            seed=args.seed,
        )
        opts = WorkerOptions(
            url=args.url,
            token=read_token(args.config),
            name=args.name or f"{socket.gethostname()}-{os.getpid()}",
            device=pick_device(args.device),
            emulation=emulation,
            max_frame_bytes=args.max_frame_bytes,
            max_steps=args.steps,
            max_retries=args.max_retries,
            backoff_max_s=max(0.5, args.retry_max_delay),
        )
        steps = asyncio.run(run_worker(opts))
    except (ValueError, OSError, FatalError) as exc:
        print(f"hetd-worker: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    print(f"hetd-worker: done after {steps} pushes", file=sys.stderr)
    return 0


if __name__ == "__main__":  # python -m workers.cli: the environment comes from the parent
    # (a spawning ``hetd`` process set the malloc and JAX cache variables; ``hetd-worker`` sets them)
    sys.exit(main())
