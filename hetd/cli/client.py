"""The admin client of the commands that talk to a running daemon: their shared flags, one admin
call (URL and token from the flags, the environment and the config file), and the wrapper that
turns a failed call into a message and an exit code."""

from __future__ import annotations

import argparse
import json
import os
import ssl
import sys
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any

from hetd.cli.common import DEFAULT_ADMIN_URL, EXIT_REFUSED, EXIT_UNREACHABLE, EXIT_USAGE


def client_flags() -> argparse.ArgumentParser:
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


def admin_command(fn: Callable[[argparse.Namespace], Any]) -> Callable[[argparse.Namespace], int]:
    """Run an admin command: print its reply (as JSON with --json); errors to stderr."""

    def run(args: argparse.Namespace) -> int:
        try:
            fn(args)
        except AdminError as exc:
            print(f"hetd: {exc}", file=sys.stderr)
            return exc.code
        return 0

    return run


def emit(args: argparse.Namespace, reply: Any, text: Callable[[Any], str]) -> None:
    print(json.dumps(reply, indent=2, sort_keys=True) if args.json else text(reply))
