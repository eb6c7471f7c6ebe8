"""``hetd``: the daemon's command line. The logic lives in the library modules.

* ``serve`` runs the daemon, ``demo`` the embedded demo, ``calibrate`` measures the simulator's
  cost profile;
* ``status``, ``workers``, ``policy get|set|patch`` and ``checkpoint`` talk to a running daemon's
  admin API (URL from ``--admin-url``, ``HETD_ADMIN_URL`` or the config file; the admin token from
  ``HETD_ADMIN_TOKEN`` or the config file — never from the command line).

Each subcommand is one ``_add_<name>(sub)`` function that builds its parser and sets ``run`` to the
function that executes it; adding a command is adding one such pair and one line in :func:`parser`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import ssl
import sys
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from typing import Any

DEFAULT_ADMIN_URL = "http://127.0.0.1:7071"

# Exit codes of the admin commands.
EXIT_REFUSED = 1  # the daemon answered with an error (bad token, bad policy, ...)
EXIT_USAGE = 2  # bad arguments or config
EXIT_UNREACHABLE = 3  # no daemon at the admin URL


def _json_params(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("policy parameters must be a JSON object")
    return value


def _key_value(text: str) -> tuple[str, Any]:
    """``k=v``; ``v`` is read as JSON when it parses (3, 0.5, true, null, [1,2]), else a string."""
    key, sep, raw = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    try:
        value = json.loads(raw)
    except json.JSONDecodeError:
        value = raw
    return key, value


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
    _add_serve(sub)
    _add_demo(sub)
    client = _client_flags()
    _add_status(sub, client)
    _add_workers(sub, client)
    _add_policy(sub, client)
    _add_checkpoint(sub, client)
    _add_export(sub, client)
    _add_calibrate(sub)
    from hetd.cli import bench as bench_cli

    bench_cli.add_commands(sub)
    return p


Sub = Any  # argparse's private _SubParsersAction


def _add_serve(sub: Sub) -> None:
    s = sub.add_parser(
        "serve",
        help="run the daemon (what systemd runs)",
        description="Run the daemon until SIGTERM/SIGINT; then stop taking pushes, say bye to "
        "workers, write a last checkpoint (with a state directory) and exit 0. Resumes from the "
        "newest valid checkpoint in the state directory.",
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
        help="override [store] dir: where checkpoints are written and resumed from",
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


def _add_demo(sub: Sub) -> None:
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


def _add_calibrate(sub: Sub) -> None:
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


def _client_flags() -> argparse.ArgumentParser:
    """Flags shared by the commands that talk to a running daemon."""
    c = argparse.ArgumentParser(add_help=False)
    g = c.add_argument_group("admin API")
    g.add_argument(
        "--admin-url",
        default=None,
        help=f"the daemon's admin API (default: $HETD_ADMIN_URL, else [server] admin_host and "
        f"admin_port of --config, else {DEFAULT_ADMIN_URL})",
    )
    g.add_argument(
        "--config",
        default=None,
        help="the daemon's TOML config: admin URL and [server] admin_token "
        "(HETD_ADMIN_TOKEN overrides the token)",
    )
    g.add_argument(
        "--ca",
        default=None,
        metavar="FILE",
        help="https:// admin URLs: verify the daemon's certificate against this PEM CA file "
        "(default: the system's trust store)",
    )
    g.add_argument(
        "--timeout", type=float, default=15.0, help="seconds to wait for the daemon (default 15)"
    )
    g.add_argument("--json", action="store_true", help="print the daemon's JSON reply as is")
    return c


def _add_status(sub: Sub, client: argparse.ArgumentParser) -> None:
    s = sub.add_parser(
        "status",
        parents=[client],
        help="version, stage, policy, workers, accuracy of a running daemon",
        description="GET /v1/status of a running daemon.",
    )
    s.set_defaults(run=_status)


def _add_workers(sub: Sub, client: argparse.ArgumentParser) -> None:
    s = sub.add_parser(
        "workers",
        parents=[client],
        help="one row per active worker",
        description="GET /v1/workers: device, clock, speed, batch, codec, staleness, idle "
        "fraction and last sign of life of every active worker.",
    )
    s.set_defaults(run=_workers)


def _add_policy(sub: Sub, client: argparse.ArgumentParser) -> None:
    p = sub.add_parser(
        "policy",
        help="show or hot-swap the running policy",
        description="Show or hot-swap the policy of a running daemon. A refused change (unknown "
        "name, bad parameters) leaves the running policy in place and says why.",
    )
    ps = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    g = ps.add_parser(
        "get", parents=[client], help="the running policy and the known names (GET /v1/policy)"
    )
    g.set_defaults(run=_policy_get)
    s = ps.add_parser(
        "set",
        parents=[client],
        help="replace the policy (PUT /v1/policy)",
        description="Replace the running policy by NAME with the given parameters (the factory's "
        "defaults for any not given).",
    )
    s.add_argument("name", help="policy name, e.g. bsp, asp, ssp (see 'hetd policy get')")
    _param_flags(s)
    s.set_defaults(run=_policy_set)
    m = ps.add_parser(
        "patch",
        parents=[client],
        help="change parameters of the running policy (PATCH /v1/policy)",
        description="Change some parameters of the running policy, keeping the others; "
        "a null value (--param k=null) removes a parameter so its default applies.",
    )
    _param_flags(m)
    m.set_defaults(run=_policy_patch)


def _param_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--params",
        type=_json_params,
        default=None,
        metavar="JSON",
        help="parameters as a JSON object, e.g. '{\"staleness\": 5}'",
    )
    p.add_argument(
        "--param",
        type=_key_value,
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="one parameter (repeatable; VALUE is JSON when it parses, else a string); "
        "applied after --params",
    )


def _add_checkpoint(sub: Sub, client: argparse.ArgumentParser) -> None:
    s = sub.add_parser(
        "checkpoint",
        parents=[client],
        help="write a checkpoint now (POST /v1/checkpoint)",
        description="Ask a running daemon to write a checkpoint into its state directory now.",
    )
    s.set_defaults(run=_checkpoint)


def _add_export(sub: Sub, client: argparse.ArgumentParser) -> None:
    s = sub.add_parser(
        "export",
        parents=[client],
        help="write the model for the JAX ecosystem (POST /v1/export)",
        description="Ask a running daemon to write its current model into DIR on the daemon's "
        "machine: an orbax CheckpointManager directory (step = version; items params, opt_state, "
        "meta) and a bare params.msgpack that flax.serialization.msgpack_restore reads.",
    )
    s.add_argument("--out", required=True, metavar="DIR", help="directory to write (created)")
    s.set_defaults(run=_export)


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


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``hetd``."""
    args = parser().parse_args(argv)
    setup_logging(args.command, args.verbose, args.quiet_log)
    from hetd.cli import bench as bench_cli
    from hetd.config import ConfigError

    if args.command in bench_cli.COMMANDS:
        return bench_cli.run_command(args)
    run: Callable[[argparse.Namespace], int] = args.run
    try:
        return run(args)
    except ConfigError as exc:
        print(f"hetd: config: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except ValueError as exc:
        print(f"hetd: {exc}", file=sys.stderr)
        return EXIT_USAGE


def _serve(args: argparse.Namespace) -> int:
    from hetd import config
    from hetd.server.daemon import serve  # light: JAX loads after the sockets listen

    cfg = config.load(args.config)
    server = {
        k: v
        for k, v in (("host", args.host), ("port", args.port), ("admin_port", args.admin_port))
        if v is not None
    }
    if server:
        cfg = config.replace(cfg, "server", **server)
    if args.state_dir is not None:
        cfg = config.replace(cfg, "store", dir=args.state_dir)
    train = {k: v for k, v in (("model", args.model), ("dataset", args.dataset)) if v is not None}
    if train:
        cfg = config.replace(cfg, "train", **train)
    if args.policy is not None:
        cfg = config.replace(cfg, "policy", name=args.policy, params={})
    config.check_serving(cfg)  # before JAX is imported: a refused start is quick
    try:
        asyncio.run(serve(cfg))
    except OSError as exc:  # the port is taken, the state directory is not writable, ...
        print(f"hetd: {exc}", file=sys.stderr)
        return 1
    except Exception as exc:
        from hetd.server.checkpoint import CheckpointError  # loaded by now: the daemon built

        if not isinstance(exc, CheckpointError):
            raise
        print(f"hetd: checkpoint: {exc}", file=sys.stderr)
        return EXIT_USAGE
    return 0


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


# --- the admin client -------------------------------------------------------------------------------


class AdminError(Exception):
    """The admin call failed; ``code`` is the exit code."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


def admin_target(args: argparse.Namespace) -> tuple[str, str]:
    """(admin URL, admin token) from the flags, the environment and the config file."""
    from hetd import config

    cfg = config.load(args.config) if args.config else None  # HETD_ADMIN_TOKEN applied by load
    url = args.admin_url or os.environ.get("HETD_ADMIN_URL")
    if not url:
        if cfg is not None and cfg.server.admin_port > 0:
            host = cfg.server.admin_host
            host = "127.0.0.1" if host in ("0.0.0.0", "") else "[::1]" if host == "::" else host
            scheme = "https" if cfg.server.tls_cert else "http"
            url = f"{scheme}://{host}:{cfg.server.admin_port}"
        else:
            url = DEFAULT_ADMIN_URL
    token = cfg.server.admin_token if cfg is not None else os.environ.get("HETD_ADMIN_TOKEN", "")
    return url.rstrip("/"), token


def admin_request(
    args: argparse.Namespace, method: str, path: str, body: dict[str, Any] | None = None
) -> Any:
    """One admin call; returns the decoded JSON reply or raises :class:`AdminError`."""
    url, token = admin_target(args)
    headers = {"Accept": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    data = None
    if body is not None:
        data = json.dumps(body).encode()
        headers["Content-Type"] = "application/json"
    req = urllib.request.Request(url + path, data=data, method=method, headers=headers)
    tls = _tls_context(url, getattr(args, "ca", None))
    try:
        with urllib.request.urlopen(req, timeout=args.timeout, context=tls) as resp:
            return json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        raw = exc.read()
        try:
            reply = json.loads(raw)
            message = f"{exc.code} {reply.get('error')}: {reply.get('message')}"
        except (ValueError, AttributeError):
            message = f"{exc.code} {exc.reason}"
        if exc.code == 401 and not token:
            message += " (set HETD_ADMIN_TOKEN or pass --config with [server] admin_token)"
        raise AdminError(EXIT_REFUSED, message) from None
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        if isinstance(reason, ssl.SSLCertVerificationError):
            raise AdminError(
                EXIT_UNREACHABLE,
                f"the admin API's TLS certificate at {url} was not accepted: "
                f"{reason.verify_message or reason} (pass --ca FILE with the CA that signed it)",
            ) from None
        raise AdminError(
            EXIT_UNREACHABLE,
            f"cannot reach the admin API at {url}: {reason} (is 'hetd serve' running? "
            "see --admin-url)",
        ) from None


def _tls_context(url: str, ca: str | None) -> ssl.SSLContext | None:
    """How an ``https://`` admin URL is verified: against ``--ca`` or the system's trust store."""
    if not url.startswith("https://"):
        if ca is not None:
            raise AdminError(EXIT_USAGE, f"--ca is for https:// admin URLs; {url} is not TLS")
        return None
    try:
        return ssl.create_default_context(cafile=ca)
    except (OSError, ValueError) as exc:  # ssl.SSLError is an OSError
        reason = getattr(exc, "strerror", None) or getattr(exc, "reason", None) or exc
        raise AdminError(EXIT_USAGE, f"--ca {ca}: not a readable PEM CA file ({reason})") from None


def _client(fn: Callable[[argparse.Namespace], Any]) -> Callable[[argparse.Namespace], int]:
    """Run an admin command: print its reply (as JSON with --json); errors to stderr."""

    def run(args: argparse.Namespace) -> int:
        try:
            fn(args)
        except AdminError as exc:
            print(f"hetd: {exc}", file=sys.stderr)
            return exc.code
        return 0

    return run


def _emit(args: argparse.Namespace, reply: Any, text: Callable[[Any], str]) -> None:
    print(json.dumps(reply, indent=2, sort_keys=True) if args.json else text(reply))


def _params_of(args: argparse.Namespace) -> dict[str, Any]:
    params = dict(args.params or {})
    params.update(dict(args.param))
    return params


def _policy_text(p: dict[str, Any]) -> str:
    return f"{p['name']} {json.dumps(p.get('params', {}), sort_keys=True)}"


def _duration(seconds: float) -> str:
    s = int(seconds)
    h, rem = divmod(s, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else f"{m}m{s:02d}s" if m else f"{seconds:.1f}s"


def _throughput_text(rates: dict[str, Any] | None) -> str:
    if not rates or not rates.get("window_s"):
        return "-"
    return (
        f"{rates['updates_per_s']:.1f} updates/s, {rates['mb_in_per_s']:.1f} MB/s in, "
        f"{rates['mb_out_per_s']:.1f} MB/s out (last {rates['window_s']:.0f}s)"
    )


def _latency_text(lat: dict[str, Any] | None) -> str:
    if not lat or lat.get("p50_ms") is None:
        return "-"
    return f"p50 {lat['p50_ms']:.3f} ms, p99 {lat['p99_ms']:.3f} ms ({lat['events']} events)"


def status_text(st: dict[str, Any]) -> str:
    """A readable /v1/status."""
    acc = st.get("accuracy")
    ck = st.get("checkpoint") or {}
    last = ck.get("last")
    rows: list[tuple[str, str]] = [
        ("version", str(st["version"])),
        ("stage", str(st["stage"])),
        ("policy", _policy_text(st["policy"])),
        ("uptime", _duration(float(st["uptime_s"]))),
        ("workers", str(st["workers"])),
        ("updates applied", str(st["updates_applied"])),
        ("buffered", str(st.get("buffered", 0))),
        ("accuracy", "-" if acc is None else f"{acc:.4f} (loss {st.get('loss', 0.0):.4f})"),
        ("throughput", _throughput_text(st.get("throughput"))),
        ("engine latency", _latency_text(st.get("engine_latency"))),
        (
            "checkpoints",
            "off"
            if not ck.get("dir")
            else f"{ck['dir']}, last: "
            + (f"version {last['version']} ({os.path.basename(last['path'])})" if last else "none"),
        ),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """Left-aligned columns."""
    widths = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(headers)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)).rstrip()]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    return "\n".join(lines)


def workers_text(reply: dict[str, Any]) -> str:
    """A readable /v1/workers."""
    rows = []
    for w in reply["workers"]:
        dev = w.get("device") or {}
        device = ":".join(str(dev[k]) for k in ("platform", "kind") if dev.get(k)) or "-"
        rows.append(
            [
                str(w["worker"]),
                str(w["name"]),
                device,
                str(w["clock"]),
                f"{w.get('samples_per_s', 0.0):.0f}",
                str(w.get("batch_size", "-")),
                str(w.get("codec", "-")),
                f"{w.get('staleness_mean', 0.0):.2f}",
                f"{100 * w.get('idle_fraction', 0.0):.0f}%",
                f"{w.get('last_seen_s', 0.0):.1f}s",
            ]
        )
    if not rows:
        return "no active workers"
    headers = [
        "ID",
        "NAME",
        "DEVICE",
        "CLOCK",
        "SAMPLES/S",
        "BATCH",
        "CODEC",
        "STALENESS",
        "IDLE",
        "SEEN",
    ]
    return table(headers, rows)


@_client
def _status(args: argparse.Namespace) -> None:
    _emit(args, admin_request(args, "GET", "/v1/status"), status_text)


@_client
def _workers(args: argparse.Namespace) -> None:
    _emit(args, admin_request(args, "GET", "/v1/workers"), workers_text)


@_client
def _policy_get(args: argparse.Namespace) -> None:
    _emit(
        args,
        admin_request(args, "GET", "/v1/policy"),
        lambda r: f"{_policy_text(r)}\nknown: {', '.join(r.get('known', []))}",
    )


def _swapped(reply: dict[str, Any]) -> str:
    return f"policy {_policy_text(reply['previous'])} -> {_policy_text(reply)}"


@_client
def _policy_set(args: argparse.Namespace) -> None:
    body = {"name": args.name, "params": _params_of(args)}
    _emit(args, admin_request(args, "PUT", "/v1/policy", body), _swapped)


@_client
def _policy_patch(args: argparse.Namespace) -> None:
    params = _params_of(args)
    if not params:
        raise AdminError(EXIT_USAGE, "policy patch: give --params JSON or --param KEY=VALUE")
    _emit(args, admin_request(args, "PATCH", "/v1/policy", {"params": params}), _swapped)


@_client
def _export(args: argparse.Namespace) -> None:
    out = os.path.abspath(args.out)  # the daemon's working directory is not ours
    _emit(
        args,
        admin_request(args, "POST", "/v1/export", {"out": out}),
        lambda r: (
            f"exported version {r['version']} to {r['dir']} (orbax step {r['step']}"
            f"{'' if r['written'] else ', already there'}) and {r['params_msgpack']}"
        ),
    )


@_client
def _checkpoint(args: argparse.Namespace) -> None:
    _emit(
        args,
        admin_request(args, "POST", "/v1/checkpoint"),
        lambda r: f"checkpoint {r['path']} (version {r['version']}, {r['nbytes']} bytes)",
    )


if __name__ == "__main__":
    sys.exit(main())
