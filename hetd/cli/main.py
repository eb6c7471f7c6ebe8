"""``hetd``: the daemon's command line. The logic lives in the library modules.

* ``serve`` runs the daemon and ``token`` makes a token for it (:mod:`hetd.cli.serve`), ``demo``
  the embedded demo (:mod:`hetd.cli.demo`), ``calibrate`` measures the simulator's cost profile
  (:mod:`hetd.cli.calibrate`), ``sim`` and ``bench`` run the simulator and the benchmark
  (:mod:`hetd.cli.bench`);
* ``status``, ``workers``, ``policy get|set|patch``, ``checkpoint`` and ``export``
  (:mod:`hetd.cli.admin`) talk to a running daemon's admin API through :mod:`hetd.cli.client` (URL
  from ``--admin-url``, ``HETD_ADMIN_URL`` or the config file; the admin token from
  ``HETD_ADMIN_TOKEN`` or the config file — never from the command line).

Each subcommand is one ``add_<name>(sub)`` function in its command group's module that builds its
parser and sets ``run`` to the function that executes it; adding a command is adding one such pair
(in a new module for a new group) and one line in :data:`COMMANDS`. This module names the command
modules and imports them by name when it builds the parser: it imports none of them itself, so the
entry point sits above no command's own imports (the bench's suites, the daemon).
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
from collections.abc import Callable

from hetd.cli.client import client_flags
from hetd.cli.common import EXIT_USAGE

# The subcommands in the order ``hetd --help`` lists them: (module in hetd.cli, its adder, whether
# the adder takes the admin client's flags).
COMMANDS: tuple[tuple[str, str, bool], ...] = (
    ("serve", "add_serve", False),
    ("serve", "add_token", False),
    ("cluster", "add_cluster", False),  # a head and its pservers on Ray
    ("demo", "add_demo", False),
    ("admin", "add_status", True),
    ("admin", "add_workers", True),
    ("replicas", "add_replicas", True),
    ("admin", "add_policy", True),
    ("admin", "add_checkpoint", True),
    ("admin", "add_export", True),
    ("calibrate", "add_calibrate", False),
    ("bench", "add_commands", False),  # sim and bench
)

# --- the parser -------------------------------------------------------------------------------------


def parser() -> argparse.ArgumentParser:
    """The command line of ``hetd``."""
    p = argparse.ArgumentParser(
        prog="hetd",
        description="hetd: a parameter server for heterogeneous workers. Tokens come from the "
        "config file or HETD_WORKER_TOKEN / HETD_ADMIN_TOKEN, never from the command line.",
        epilog="Run 'hetd COMMAND --help' for the flags of each command.",
    )
    loud = p.add_mutually_exclusive_group()
    loud.add_argument(
        "-v", "--verbose", action="store_true", help="debugging: every logger at DEBUG"
    )
    loud.add_argument(
        "-q",
        "--quiet-log",
        dest="quiet_log",
        action="store_true",
        help="only warnings and errors (hetd serve logs its events at INFO by default)",
    )
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    client = client_flags()
    for module, adder, takes_client in COMMANDS:
        add = getattr(importlib.import_module(f"hetd.cli.{module}"), adder)
        if takes_client:
            add(sub, client)
        else:
            add(sub)
    return p


# --- entry point ------------------------------------------------------------------------------------

# What an operator reads at the default level of ``hetd serve`` (the journal under systemd):
# listening, resumed from, joins and leaves, swaps, checkpoints, refusals, stage changes.
EVENT_LOGGERS = ("hetd",)


def setup_logging(command: str, verbose: bool, quiet: bool) -> None:
    """``hetd serve`` logs its events at INFO; other commands only warnings. ``-q``: warnings
    only; ``-v``: DEBUG everywhere (libraries included). Under systemd the journal stamps each
    line, so the line carries no time of its own."""
    journal = bool(os.environ.get("JOURNAL_STREAM"))
    fmt = "%(levelname)s %(name)s: %(message)s"
    if not journal:
        fmt = "%(asctime)s " + fmt
    root = logging.DEBUG if verbose else logging.WARNING
    logging.basicConfig(level=root, format=fmt)
    logging.getLogger().setLevel(root)  # also when something configured logging before us
    level = logging.INFO if command == "serve" and not quiet else logging.WARNING
    if verbose:
        level = logging.NOTSET  # the root's DEBUG
    for name in EVENT_LOGGERS:
        logging.getLogger(name).setLevel(level)
    # orbax (hetd export) warns through absl about its own internals at every export
    logging.getLogger("absl").setLevel(logging.NOTSET if verbose else logging.ERROR)


EXIT_BROKEN_PIPE = 128 + 13  # what a shell reports for a tool that SIGPIPE ended


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``hetd``. Output into a pipe that closed early (``hetd workers | head -2``)
    ends the command quietly, as it ends a Unix tool, with status 141 (128 + SIGPIPE)."""
    try:
        code = _main(argv)
        sys.stdout.flush()  # here, not at exit: a closed pipe is noticed while we can handle it
    except BrokenPipeError:
        # Python would flush stdout again at exit and print the error: point it at /dev/null.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return EXIT_BROKEN_PIPE
    return code


def _main(argv: list[str] | None) -> int:
    args = parser().parse_args(argv)
    setup_logging(args.command, args.verbose, args.quiet_log)
    from hetd.config import ConfigError

    run: Callable[[argparse.Namespace], int] = args.run
    try:
        return run(args)
    except ConfigError as exc:
        print(f"hetd: config: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except ValueError as exc:
        print(f"hetd: {exc}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
