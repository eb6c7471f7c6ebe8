"""``hetd serve``: run the daemon (what systemd runs)."""

from __future__ import annotations

import argparse
import asyncio
import sys
from typing import TYPE_CHECKING

from hetd.cli.common import EXIT_USAGE, Sub

if TYPE_CHECKING:
    from hetd.config import Config


def add_serve(sub: Sub) -> None:
    s = sub.add_parser(
        "serve",
        help="run the daemon (what systemd runs)",
        description="Run the daemon until SIGTERM/SIGINT; then stop taking pushes, say bye to "
        "workers, write a last checkpoint (with a state directory) and exit 0. Resumes from the "
        "newest valid checkpoint in the state directory (the highest version). Exit status 2: a "
        "bad config, a port in use, a state directory another daemon holds, a checkpoint of "
        "another model.",
    )
    s.add_argument("--config", default=None, help="TOML config file; every key has a default")
    s.add_argument("--host", default=None, help="override [server] host (worker endpoint)")
    s.add_argument("--port", type=int, default=None, help="override [server] port")
    s.add_argument(
        "--admin-port",
        type=int,
        default=None,
        help="override [server] admin_port (-1 turns the admin API off, 0 picks a free port)",
    )
    s.add_argument(
        "--state-dir",
        default=None,
        help="override [store] dir: where checkpoints are written and resumed from, locked "
        "while this daemon runs (default: none, nothing is checkpointed)",
    )
    s.add_argument(
        "--task",
        default=None,
        help="override [train] task: your own hetd.Task as pkg.module:attr or path/to/file.py:attr "
        "(a Task, or a function returning one); every worker names the same one with "
        "hetd-worker --task",
    )
    s.add_argument(
        "--model",
        default=None,
        help="override [train] model: mlp, cnn, or your own as pkg.module:attr (a hetd.zoo.models.Model "
        "or a factory returning one; workers must be able to import it too)",
    )
    s.add_argument(
        "--dataset",
        default=None,
        help="override [train] dataset: digits, mnist5k, mnist, synthetic, or your own as "
        "pkg.module:attr (a hetd.zoo.data.Dataset or a factory (seed, **kwargs) returning one)",
    )
    s.add_argument("--policy", default=None, help="override [policy] name (its default params)")
    s.add_argument(
        "--pservers",
        type=int,
        default=None,
        metavar="S",
        help="S >= 2: S pserver processes hold the model's slices and apply its updates "
        '([pservers] log = true, servers = S, and backend = "local" unless the config names '
        "one; needs --state-dir); 1: the daemon alone, with none (the default)",
    )
    s.add_argument(
        "--headers",
        action="store_true",
        default=None,
        help="set [pservers] headers: the daemon takes each push's header only and holds no "
        "parameters, its pservers do (no shared memory, downlink deltas or pipeline replicas)",
    )
    s.add_argument(
        "--open-workers",
        action="store_true",
        default=None,
        help="set [server] open_workers: run without a worker token on loopback, so that any "
        "process on this machine joins as a worker and reads the model (demos only)",
    )
    # the same switches as before the command: `hetd serve -q` reads naturally
    s.add_argument(
        "-q",
        "--quiet",
        dest="quiet_log",
        action="store_true",
        default=argparse.SUPPRESS,
        help="log only warnings and errors (default: one INFO line per event)",
    )
    s.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        default=argparse.SUPPRESS,
        help="debugging: every logger at DEBUG",
    )
    s.set_defaults(run=_serve)
    from hetd.cli.pserver import add_pserver  # its own module; listed beside serve

    add_pserver(sub)


def _serve(args: argparse.Namespace) -> int:
    from hetd import config
    from hetd.server.daemon import StartupError, serve  # light: JAX loads after the listening

    cfg = config.load(args.config)
    server = {
        k: v
        for k, v in (
            ("host", args.host),
            ("port", args.port),
            ("admin_port", args.admin_port),
            ("open_workers", args.open_workers),
        )
        if v is not None
    }
    if server:
        cfg = config.replace(cfg, "server", **server)
    if args.state_dir is not None:
        cfg = config.replace(cfg, "store", dir=args.state_dir)
    train = {
        k: v
        for k, v in (("task", args.task), ("model", args.model), ("dataset", args.dataset))
        if v is not None
    }
    if train:
        cfg = config.replace(cfg, "train", **train)
    if args.policy is not None:
        cfg = config.replace(cfg, "policy", name=args.policy, params={})
    cfg = pservers_from_args(cfg, args.pservers, args.headers)
    config.check_serving(cfg)  # before JAX is imported: a refused start is quick
    try:
        asyncio.run(serve(cfg))
    except StartupError as exc:  # a port in use, a state directory another daemon's: exit 2, so
        print(f"hetd: {exc}", file=sys.stderr)  # systemd's unit does not restart it in a loop
        return EXIT_USAGE
    except OSError as exc:
        print(f"hetd: {exc}", file=sys.stderr)
        return 1
    except Exception as exc:
        from hetd.server.checkpoint import CheckpointError  # loaded by now: the daemon built

        if not isinstance(exc, CheckpointError):
            raise
        print(f"hetd: checkpoint: {exc}", file=sys.stderr)
        return EXIT_USAGE
    return 0


def add_token(sub: Sub) -> None:
    t = sub.add_parser(
        "token",
        help="print a new random token (for HETD_WORKER_TOKEN or HETD_ADMIN_TOKEN)",
        description="Print a new random token: 32 URL-safe characters (192 bits) from the "
        "system's secure random source. Run it twice for the worker and the admin token (they "
        "must differ); the daemon refuses tokens under 16 characters.",
    )
    t.set_defaults(run=_token)


def _token(args: argparse.Namespace) -> int:
    import secrets

    print(secrets.token_urlsafe(24))
    return 0


def pservers_from_args(cfg: Config, servers: int | None, headers: bool | None) -> Config:
    """``--pservers S`` and ``--headers`` over the config's ``[pservers]``: S = 1 is the daemon
    alone (no pserver process), S >= 2 that many processes following its log (started by the
    config's backend, ``"local"`` when it names none). ConfigError for S < 1."""
    from hetd import config

    if servers is not None:
        if servers < 1:
            raise config.ConfigError(
                f"--pservers must be >= 1 (1: the daemon alone), got {servers}"
            )
        if servers == 1:
            cfg = config.replace(cfg, "pservers", servers=0, backend="none", headers=False)
        else:
            backend = cfg.pservers.backend if cfg.pservers.backend != "none" else "local"
            cfg = config.replace(cfg, "pservers", log=True, servers=servers, backend=backend)
    if headers:
        cfg = config.replace(cfg, "pservers", headers=True)
    return cfg
