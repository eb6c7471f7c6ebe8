"""``hetd-worker URL``: join a hetd daemon and train on whatever device this machine has."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import socket
import ssl
import sys
import threading
import time
import tomllib
import urllib.parse
from collections.abc import Callable
from typing import TYPE_CHECKING, NoReturn

from workers.emulate import (
    Emulation,
    ScheduleClock,
    origin_from_wall,
    parse_origin,
    parse_rate,
    parse_shift,
)
from workers.imports import Allowed
from workers.loop import quiet_xla_threads

if TYPE_CHECKING:  # imported where it runs: the command line stays light until then
    from workers.state import WorkerOptions

log = logging.getLogger("hetd.worker")
PROGRESS_LOGGER = "hetd.worker.progress"  # workers.progress's (not imported here: it loads JAX)

ORIGIN_HELP = (
    "time 0 of --emulate-shift and of straggle episodes: first-step (default: the start of this "
    "worker's first step, right after its welcome), a Unix time in seconds (workers on several "
    "machines then share one origin, as far as their clocks agree), or stdin (the first line read "
    "on standard input is that Unix time; hetd bench --mode real writes it to every worker at the "
    "run's t = 0, which is only known once all workers have joined and compiled, so that all "
    "share the simulator's origin). Before the origin the worker runs at --emulate-slowdown, "
    "with no shift and no straggle episode"
)


class _Parser(argparse.ArgumentParser):
    """Errors in one line (and exit status 2), like the errors of bad values found later."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")


def parser() -> argparse.ArgumentParser:
    """The command line of ``hetd-worker``."""
    p = _Parser(
        prog="hetd-worker",
        description="Join a hetd daemon and train. The worker token comes from HETD_WORKER_TOKEN "
        "or from a config file (--config, key [worker] token), never from the command line.",
    )
    p.add_argument(
        "url", help="the daemon's worker endpoint, e.g. ws://head:7070 or wss://head:7070 (TLS)"
    )
    p.add_argument(
        "--ca",
        default=None,
        metavar="FILE",
        help="wss:// only: verify the daemon's certificate against this PEM CA file (default: "
        "the system's trust store)",
    )
    p.add_argument(
        "--task",
        default=None,
        metavar="SPEC",
        help="train your own hetd.Task, as the daemon does: pkg.module:attr (found from the "
        "working directory) or path/to/file.py:attr; it must be the daemon's task (name and "
        "parameter shapes are compared at the welcome). Without it: the bundled models only",
    )
    p.add_argument(
        "--model",
        default=None,
        metavar="SPEC",
        help="allow the daemon's model plug-in pkg.module:attr: this worker imports it (and calls "
        "it with the daemon's options) only when the daemon's model is exactly SPEC; the daemon "
        "must then train SPEC. Without it: the bundled models only (mlp, cnn, transformer, "
        "hetd.zoo.blocks:mlp_model). Also [worker] model in --config",
    )
    p.add_argument(
        "--dataset",
        default=None,
        metavar="SPEC",
        help="allow the daemon's data set plug-in pkg.module:attr, as --model does for the model; "
        "without it: the bundled data sets only (digits, mnist5k, mnist, synthetic, pydoc). Also "
        "[worker] dataset in --config",
    )
    p.add_argument("--name", default=None, help="a name shown in status (default: host-pid)")
    p.add_argument(
        "--config",
        default=None,
        help="TOML file with [worker] token = '...' (and optionally model, dataset)",
    )
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
        "--no-shm",
        action="store_true",
        help="never use shared memory with a daemon on this host (default: when it offers it)",
    )
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
        help="a step of 32 samples (scaled by the batch) lasts this long times the slow-down; "
        "the real compute only when that is longer",
    )
    p.add_argument(
        "--emulate-bandwidth",
        default=None,
        metavar="RATE",
        help="cap the link both ways (pushes and parameters), e.g. 20MB/s",
    )
    p.add_argument(
        "--emulate-latency",
        default="0",
        metavar="SECONDS",
        help="add this to every message on the link, both ways (each push and each parameter "
        "frame), as a scenario's latency_s",
    )
    p.add_argument(
        "--emulate-shift",
        action="append",
        default=[],
        metavar="T:X",
        help="regime shift: from T seconds after the origin (--emulate-origin) on, act X times "
        "slower than this hardware instead of --emulate-slowdown (X >= 1); repeatable, the last "
        "shift at or before a step's start applies",
    )
    p.add_argument(
        "--emulate-origin",
        default="first-step",
        metavar="WHEN",
        help=ORIGIN_HELP,
    )
    p.add_argument(
        "--emulate-join-at",
        default=None,
        metavar="T",
        help="connect first T seconds after the origin (which must then be stdin or a Unix "
        "time): the worker starts, fetches the daemon's setup and builds its trainer before, so "
        "a join at T costs what joining costs, not the start of Python and JAX (hetd bench "
        "--mode real starts a scenario's joiners so)",
    )
    p.add_argument(
        "--emulate-stragglers",
        type=float,
        default=0.0,
        metavar="P",
        help="chance per step (outside an episode) that a slow episode begins: "
        "--emulate-straggle-factor times slower for a geometric number of steps with mean "
        "--emulate-straggle-mean",
    )
    p.add_argument(
        "--emulate-straggle-factor",
        default="5",
        metavar="F",
        help="how much slower a straggle episode's steps are (F >= 1, default 5)",
    )
    p.add_argument(
        "--emulate-straggle-mean",
        default="10",
        metavar="STEPS",
        help="mean length of a straggle episode in steps (>= 1, default 10)",
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
    p.add_argument(
        "--emulate-seed",
        "--seed",
        dest="emulate_seed",
        type=int,
        default=0,
        help="seed of the straggle episodes (and of --emulate-bad-pushes); --seed is the old name",
    )
    p.add_argument(
        "--progress-every",
        type=float,
        default=30.0,
        metavar="SECONDS",
        help="log a progress line this often: pushes, samples/s, staleness, version (default "
        "30; 0: none)",
    )
    loud = p.add_mutually_exclusive_group()
    loud.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        help="also log every connection event (default: the join, progress every "
        "--progress-every seconds, plan and stage changes, warnings, and why the worker leaves)",
    )
    loud.add_argument(
        "-q", "--quiet", action="store_true", help="log only warnings and why the worker leaves"
    )
    return p


def _worker_section(path: str | None) -> dict[str, object]:
    """The ``[worker]`` table of the config file (empty without one)."""
    if path is None:
        return {}
    with open(path, "rb") as fh:
        raw = tomllib.load(fh)
    worker = raw.get("worker", {})
    return worker if isinstance(worker, dict) else {}


def _config_string(path: str | None, key: str) -> str | None:
    value = _worker_section(path).get(key)
    if value is not None and not isinstance(value, str):
        raise ValueError(f"{path}: [worker] {key} must be a string")
    return value


def read_token(path: str | None) -> str:
    """The worker token: HETD_WORKER_TOKEN, else ``[worker] token`` in the config file."""
    env = os.environ.get("HETD_WORKER_TOKEN")
    if env:
        return env
    return _config_string(path, "token") or ""


def read_allowed(args: argparse.Namespace) -> Allowed:
    """The model and data set plug-ins this worker's operator named: ``--model`` and
    ``--dataset``, else ``[worker] model`` and ``dataset`` in ``--config``; ValueError when they
    are combined with ``--task`` (the daemon then trains the task, not a model)."""
    try:
        model = args.model or _config_string(args.config, "model")
        dataset = args.dataset or _config_string(args.config, "dataset")
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ValueError(f"--config {args.config}: {exc}") from None
    if args.task and (model or dataset):
        raise ValueError(
            "--task and --model/--dataset do not go together: a daemon trains either a task "
            "(hetd serve --task) or a model on a data set"
        )
    return Allowed(model or None, dataset or None)


URL_SHAPE = (
    "a worker URL is ws://HOST:PORT, or wss://HOST:PORT when the daemon has a TLS certificate; "
    "PORT is the daemon's worker port, [server] port (7070 unless configured), e.g. "
    "ws://127.0.0.1:7070"
)


def check_url(url: str) -> None:
    """ValueError, saying what a worker URL looks like, unless ``url`` is ``ws://`` or ``wss://``
    with a host (and a valid port when one is given). Checked before anything connects: a bad
    URL would otherwise be retried as a lost connection, forever."""
    try:
        parts = urllib.parse.urlsplit(url)
        parts.port  # noqa: B018 (raises ValueError for a port that is no number or out of range)
    except ValueError:
        raise ValueError(f"{url!r} is not a worker URL: {URL_SHAPE}") from None
    if parts.scheme not in ("ws", "wss") or not parts.hostname:
        hint = ""
        if parts.scheme in ("http", "https") and parts.hostname:
            ws = "wss" if parts.scheme == "https" else "ws"
            hint = f" (the worker endpoint speaks websockets: {ws}://{parts.netloc})"
        raise ValueError(f"{url!r} is not a worker URL{hint}: {URL_SHAPE}")


def tls_context(url: str, ca: str | None) -> ssl.SSLContext | None:
    """The context that verifies a ``wss://`` daemon: against ``ca`` (a PEM file) or the system's
    trust store; None for ``ws://``. A bad ``--ca`` raises ValueError naming it."""
    if not url.startswith("wss://"):
        if ca is not None:
            raise ValueError(f"--ca is for wss:// URLs; {url!r} is not TLS")
        return None
    try:
        return ssl.create_default_context(cafile=ca)
    except (OSError, ValueError) as exc:  # ssl.SSLError is an OSError
        reason = getattr(exc, "strerror", None) or getattr(exc, "reason", None) or exc
        raise ValueError(f"--ca {ca}: not a readable PEM CA file ({reason})") from None


def _number(text: str, flag: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"{flag} must be a number, got {text!r}") from None


def build_emulation(
    args: argparse.Namespace,
    monotonic: Callable[[], float] = time.monotonic,
    wall: Callable[[], float] = time.time,
) -> Emulation:
    """The emulation the ``--emulate-*`` flags ask for; a bad value raises ValueError naming it.
    With ``--emulate-origin stdin`` the origin is left unknown (see :func:`follow_stdin`)."""
    origin = parse_origin(args.emulate_origin)
    join_at = (
        None if args.emulate_join_at is None else _number(args.emulate_join_at, "--emulate-join-at")
    )
    if join_at is not None and origin == "first-step":
        raise ValueError(
            "--emulate-join-at counts from an origin the worker knows before it connects: pass "
            "--emulate-origin stdin or a Unix time"
        )
    clock = ScheduleClock(monotonic, first_step=origin == "first-step")
    if isinstance(origin, float):
        clock.set_origin(origin_from_wall(origin, wall(), monotonic()))
    return Emulation(
        slowdown=args.emulate_slowdown,
        base_step_s=args.emulate_base_step,
        memory=args.emulate_memory,
        bandwidth=parse_rate(args.emulate_bandwidth) if args.emulate_bandwidth else None,
        latency_s=_number(args.emulate_latency, "--emulate-latency"),
        stragglers=args.emulate_stragglers,
        straggle_factor=_number(args.emulate_straggle_factor, "--emulate-straggle-factor"),
        straggle_mean=_number(args.emulate_straggle_mean, "--emulate-straggle-mean"),
        shifts=[parse_shift(s) for s in args.emulate_shift],
        bad_pushes=args.emulate_bad_pushes,
        seed=args.emulate_seed,
        join_at_s=join_at,
        clock=clock,
    )


def follow_stdin(clock: ScheduleClock, fd: int = 0) -> None:
    """Read lines from ``fd`` until one is a Unix time, and make it ``clock``'s origin. Runs in
    a daemon thread; reads the raw descriptor, so no lock of ``sys.stdin`` is held at exit."""
    buf = b""
    while True:
        try:
            chunk = os.read(fd, 4096)
        except OSError as exc:
            log.warning("cannot read the schedule's origin from standard input: %s", exc)
            return
        if not chunk:
            log.warning("standard input closed before the origin: no shift or straggle applies")
            return
        buf += chunk
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            text = line.decode(errors="replace").strip()
            try:
                epoch = parse_origin(text)
            except ValueError:
                epoch = text
            if isinstance(epoch, float):
                clock.set_origin(origin_from_wall(epoch, time.time(), time.monotonic()))
                return
            log.warning("ignored %r on standard input: the origin is a Unix time", text)


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``hetd-worker``."""
    args = parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
    )
    # what an operator reads by default: join, progress, plan and stage changes (workers.progress)
    logging.getLogger(PROGRESS_LOGGER).setLevel(logging.WARNING if args.quiet else logging.INFO)
    try:  # before anything is built or connected: a bad flag is reported at once
        check_url(args.url)
        emulation = build_emulation(args)
        ssl_context = tls_context(args.url, args.ca)
        allowed = read_allowed(args)
    except ValueError as exc:
        print(f"hetd-worker: {exc}", file=sys.stderr)
        return 2
    if args.emulate_origin == "stdin" and emulation.clock is not None:
        threading.Thread(target=follow_stdin, args=(emulation.clock,), daemon=True).start()
    quiet_xla_threads()
    # Imported after the XLA flags are set.
    from hetd.zoo.task import Bound, TaskError, load_task
    from workers.client import FatalError, WorkerOptions
    from workers.loop import pick_device

    try:  # the task loads before anything connects: a wrong one is reported at once
        task = Bound(load_task(args.task)) if args.task else None
    except TaskError as exc:
        print(f"hetd-worker: {exc}", file=sys.stderr)
        return 2
    try:
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
            ssl_context=ssl_context,
            shm=not args.no_shm,
            task=task,
            allowed=allowed,
        )
        steps = asyncio.run(_until_stopped(opts, args.progress_every))
    except (ValueError, OSError, FatalError) as exc:
        print(f"hetd-worker: {exc}", file=sys.stderr)
        return 2
    except asyncio.CancelledError:  # SIGTERM before it trained, or a stop past its grace
        print("hetd-worker: stopped", file=sys.stderr)
        return 128 + signal.SIGTERM
    except KeyboardInterrupt:
        print("hetd-worker: interrupted", file=sys.stderr)
        return 130
    print(f"hetd-worker: done after {steps} pushes", file=sys.stderr)
    return 0


async def _until_stopped(opts: WorkerOptions, progress_s: float) -> int:
    """``run_worker`` with SIGTERM as its stop: the step in progress is sent, then bye."""
    from workers.client import run_worker

    stop = asyncio.Event()
    if threading.current_thread() is threading.main_thread():
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    # (else an embedding program's thread runs us: signals are the program's to handle)
    return await run_worker(opts, progress_s=progress_s, stop=stop)


if __name__ == "__main__":  # python -m workers.cli: the environment comes from the parent
    # (a spawning ``hetd`` process set the malloc and JAX cache variables; ``hetd-worker`` sets them)
    sys.exit(main())
