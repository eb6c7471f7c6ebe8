"""TLS end to end with a throw-away CA (``trustme``): a real daemon on loopback serving ``wss://``
and ``https://``; a real ``hetd-worker`` that trusts the CA joins and its pushes are applied, one
that trusts another CA is refused with a clear error while the daemon serves on; ``hetd status
--ca`` over https; and a certificate that cannot be used stops ``hetd serve`` in one line."""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
import trustme

from hetd import config
from tests.conftest import ADMIN_TOKEN, Cluster

HETD = Path(sys.executable).with_name("hetd")


def write_cert(ca: trustme.CA, where: Path) -> tuple[str, str]:
    """A certificate for the loopback address and localhost, signed by ``ca``: (cert, key) PEMs."""
    cert = ca.issue_cert("127.0.0.1", "localhost")
    cert_path, key_path = where / "cert.pem", where / "key.pem"
    cert.private_key_pem.write_to_path(str(key_path))
    cert_path.write_bytes(b"".join(blob.bytes() for blob in cert.cert_chain_pems))
    return str(cert_path), str(key_path)


def write_ca(ca: trustme.CA, path: Path) -> str:
    ca.cert_pem.write_to_path(str(path))
    return str(path)


async def run(*args: str, env: dict[str, str] | None = None) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(
        *args,
        env={**os.environ, **(env or {})},
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


def test_config_checks_the_certificate_and_key(tmp_path: Path) -> None:
    cert, key = write_cert(trustme.CA(), tmp_path)
    other = tmp_path / "other"
    other.mkdir()
    _, other_key = write_cert(trustme.CA(), other)
    assert config.server_ssl_context(config.ServerConfig(tls_cert=cert, tls_key=key)) is not None
    assert config.server_ssl_context(config.ServerConfig()) is None
    cases = {
        (cert, other_key): "does not match the certificate",
        (cert, str(tmp_path / "missing.pem")): "tls_key = .*cannot read it",
        (str(tmp_path / "missing.pem"), key): "tls_cert = .*cannot read it",
        (key, key): "not a PEM certificate",
    }
    for (c, k), message in cases.items():
        with pytest.raises(config.ConfigError, match=message):
            config.check_serving(config.replace(config.Config(), "server", tls_cert=c, tls_key=k))
    with pytest.raises(config.ConfigError, match="go together"):
        config.replace(config.Config(), "server", tls_cert=cert)


async def test_serve_with_a_key_that_does_not_match_stops_in_one_line(tmp_path: Path) -> None:
    cert, _ = write_cert(trustme.CA(), tmp_path)
    other = tmp_path / "other"
    other.mkdir()
    _, other_key = write_cert(trustme.CA(), other)
    toml = tmp_path / "hetd.toml"
    toml.write_text(f'[server]\ntls_cert = "{cert}"\ntls_key = "{other_key}"\n')
    code, _, err = await run(str(HETD), "serve", "--config", str(toml), "--port", "0")
    assert code == 2, err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert "does not match the certificate" in err, err


async def test_worker_ca_flag_errors_are_one_line(tmp_path: Path) -> None:
    worker = str(Path(sys.executable).with_name("hetd-worker"))
    ca_file = write_ca(trustme.CA(), tmp_path / "ca.pem")
    for url, ca, message in (
        ("ws://127.0.0.1:9", ca_file, "--ca is for wss:// URLs"),
        ("wss://127.0.0.1:9", str(tmp_path / "missing.pem"), "not a readable PEM CA file"),
    ):
        code, _, err = await run(worker, url, "--ca", ca)
        assert code == 2 and message in err and "Traceback" not in err, err


# A worker process's start (JAX's import, its first compile) took over 30 s at load 21: the bounds
# below are for a hang, not a speed.
WAIT_S = 120


@pytest.mark.slow
async def test_workers_and_admin_over_tls(
    cluster: Callable[..., Awaitable[Cluster]], tmp_path: Path
) -> None:
    ca = trustme.CA()
    cert, key = write_cert(ca, tmp_path)
    ca_file = write_ca(ca, tmp_path / "ca.pem")
    wrong_ca = write_ca(trustme.CA(), tmp_path / "wrong-ca.pem")
    c = await cluster("asp", server={"tls_cert": cert, "tls_key": key})
    c.url = f"wss://127.0.0.1:{c.daemon.port}"
    admin_url = f"https://127.0.0.1:{c.daemon.admin_port}"

    wrong = await c.spawn(1.0, 0.0, "--ca", wrong_ca)
    right = await c.spawn(1.0, 0.0, "--ca", ca_file, "--steps", "5")
    # The wrong CA is refused at once, not retried: a certificate error exits the worker.
    assert await asyncio.wait_for(wrong.wait(), WAIT_S) == 2
    assert wrong.stderr is not None
    err = (await wrong.stderr.read()).decode()
    assert "certificate was not accepted" in err and "--ca" in err, err
    assert "Traceback" not in err, err

    await c.wait_for(lambda: c.engine.applier.updates_applied >= 5, WAIT_S, "5 updates over wss://")
    assert await asyncio.wait_for(right.wait(), WAIT_S) == 0
    assert not c.daemon._stopped

    env = {"HETD_ADMIN_TOKEN": ADMIN_TOKEN}
    code, out, err = await run(
        str(HETD), "status", "--admin-url", admin_url, "--ca", ca_file, env=env
    )
    assert code == 0, err
    assert "asp" in out, out
    code, _, err = await run(
        str(HETD), "status", "--admin-url", admin_url, "--ca", wrong_ca, env=env
    )
    assert code == 3 and "certificate" in err and "--ca" in err, err
