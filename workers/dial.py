"""A worker URL of the wrong scheme for its port: ``wss://`` to a daemon without TLS, or ``ws://``
to one with it. Retrying either never helps, so the worker exits saying which scheme to use.

* ``wss://`` to a plain port: the TLS handshake reads an HTTP reply where a TLS record should be
  (OpenSSL: ``WRONG_VERSION_NUMBER``, or another of :data:`NOT_TLS_REASONS`).
* ``ws://`` to a TLS port: the daemon reads a plain request where a TLS ``ClientHello`` should be
  and drops the connection, as a daemon going away would. So then, and only then, the worker
  tries a TLS handshake with the same port (certificate unchecked: it only asks whether the port
  speaks TLS, and sends nothing over it); one that completes means the URL wants ``wss://``.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
import urllib.parse

import aiohttp

PROBE_TIMEOUT_S = 3.0

NOT_TLS_REASONS = frozenset(
    {
        "WRONG_VERSION_NUMBER",  # OpenSSL up to 3.1: an HTTP reply where a TLS record should be
        "RECORD_LAYER_FAILURE",  # OpenSSL 3.2 and later, the same
        "PACKET_LENGTH_TOO_LONG",
        "UNKNOWN_PROTOCOL",
        "HTTP_REQUEST",
    }
)


def _address(url: str) -> tuple[str, int, str]:
    parts = urllib.parse.urlsplit(url)
    tls = parts.scheme == "wss"
    return parts.hostname or "", parts.port or (443 if tls else 80), parts.netloc


def plain_port_message(url: str, exc: BaseException) -> str | None:
    """Why ``wss://`` failed, when the port answered without TLS; None for any other failure."""
    if not url.startswith("wss://"):
        return None
    cause = getattr(exc, "os_error", None) or exc.__cause__ or exc
    if not isinstance(cause, ssl.SSLError) or cause.reason not in NOT_TLS_REASONS:
        return None
    _, _, netloc = _address(url)
    return (
        f"{url} asks for TLS but the daemon at {netloc} answered without it ({cause.reason}): "
        f"use ws://{netloc} (wss:// is for a daemon with a certificate, [server] tls_cert)"
    )


async def speaks_tls(host: str, port: int, timeout_s: float = PROBE_TIMEOUT_S) -> bool:
    """Whether a TLS handshake with ``host:port`` completes (the certificate is not checked;
    nothing is sent after the handshake)."""
    probe = ssl.create_default_context()
    probe.check_hostname = False
    probe.verify_mode = ssl.CERT_NONE
    try:
        async with asyncio.timeout(timeout_s):
            _, writer = await asyncio.open_connection(host, port, ssl=probe)
    except (OSError, TimeoutError, EOFError):
        return False
    writer.close()
    with contextlib.suppress(Exception):
        await writer.wait_closed()
    return True


def maybe_tls_port(url: str, exc: BaseException) -> bool:
    """Whether a failed ``ws://`` handshake looks like a TLS port's answer (dropped at once,
    reset, or a reply that is no HTTP) and is worth a probe."""
    if not url.startswith("ws://") or isinstance(exc, aiohttp.ClientConnectorError):
        return False
    if isinstance(exc, aiohttp.WSServerHandshakeError):
        return False
    return isinstance(
        exc, aiohttp.ServerDisconnectedError | aiohttp.ClientOSError | aiohttp.ClientResponseError
    )


async def tls_port_message(url: str, exc: BaseException) -> str | None:
    """Why ``ws://`` failed, when the port speaks TLS; None otherwise (retry as before)."""
    if not maybe_tls_port(url, exc):
        return None
    host, port, netloc = _address(url)
    if not await speaks_tls(host, port):
        return None
    return (
        f"{url} is a plain connection but the daemon at {netloc} speaks TLS: use wss://{netloc} "
        "(with --ca FILE when its certificate is not in the system's trust store)"
    )
