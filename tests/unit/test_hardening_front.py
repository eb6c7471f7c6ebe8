"""The front's pure parts: the per-address count of wrong tokens (bounded, never waiting), the
address a limit is kept per, strings a peer sent cut for the log, and the start-up checks of the
tokens (long enough, an empty worker token only when asked for)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from hetd import config
from hetd.config import Config, ConfigError
from hetd.protocol import wire
from hetd.protocol.text import clip
from hetd.server.throttle import AuthThrottle, client_key


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_an_address_is_held_back_after_its_failures_until_its_window_ends() -> None:
    clock = Clock()
    throttle = AuthThrottle(3, 60.0, now=clock)
    assert throttle.retry_after("10.0.0.1") is None
    assert [throttle.failed("10.0.0.1") for _ in range(3)] == [False, False, True]
    assert throttle.retry_after("10.0.0.1") == 60
    assert throttle.retry_after("10.0.0.2") is None  # another address is not
    clock.t += 59.5
    assert throttle.retry_after("10.0.0.1") == 1
    clock.t += 0.5
    assert throttle.retry_after("10.0.0.1") is None  # the window ended
    assert throttle.failed("10.0.0.1") is False  # a new window


def test_the_table_is_bounded_under_a_scan_of_many_addresses() -> None:
    clock = Clock()
    throttle = AuthThrottle(2, 60.0, max_entries=100, now=clock)
    for i in range(1000):
        throttle.failed(f"10.0.{i // 256}.{i % 256}")
    assert len(throttle._seen) <= 100
    throttle.failed("192.0.2.1")
    throttle.failed("192.0.2.1")
    assert throttle.retry_after("192.0.2.1") == 60  # the newest is kept


def test_limits_are_kept_per_address_and_per_ipv6_64() -> None:
    assert client_key("127.0.0.1") == "127.0.0.1"
    assert client_key("::ffff:10.1.2.3") == "10.1.2.3"
    assert client_key("2001:db8:1:2:aaaa::1") == client_key("2001:db8:1:2:bbbb::2")
    assert client_key("2001:db8:1:2::1") != client_key("2001:db8:1:3::1")
    assert client_key(None) == "?"


def test_a_peers_string_is_cut_and_so_is_every_protocol_error() -> None:
    assert clip("short") == "short"
    assert len(clip("x" * 10_000)) == 200 and clip("x" * 10_000).endswith("\u2026")
    import msgpack

    with pytest.raises(wire.ProtocolError) as err:
        wire.decode(msgpack.packb({"v": 1, "type": "t" * 100_000, "id": 1}))
    assert err.value.code == "unknown_type" and len(err.value.message) <= 500
    hello = {"name": "w", "device": {"k" * 1000: 1}, "codecs": ["none"]}
    with pytest.raises(wire.ProtocolError, match="short names"):
        wire.decode(msgpack.packb({"v": 1, "type": "hello", "id": 1, **hello}))


@pytest.mark.parametrize("key", ["worker_token", "admin_token"])
def test_a_short_token_stops_start_up_saying_how_to_make_one(key: str) -> None:
    tokens = {"worker_token": "w" * 16, "admin_token": "a" * 16, key: "x" * 15}
    cfg = config.replace(Config(), "server", **tokens)  # an admin client may read it
    with pytest.raises(ConfigError, match=f"{key} is 15 characters") as err:
        config.check_serving(cfg)
    assert "hetd token" in str(err.value) and "secrets.token_urlsafe" in str(err.value)


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("header_timeout_s", 0.0),
        ("max_pending", 0),
        ("max_pending_per_address", 0),
        ("max_auth_failures", 0),
        ("auth_window_s", 0.5),
        ("open_workers", "yes"),
    ],
)
def test_the_front_limits_are_checked(key: str, value: object) -> None:
    with pytest.raises(ConfigError, match=f"\\[server\\] {key}"):
        config.replace(Config(), "server", **{key: value})


def test_hetd_token_prints_a_token_the_daemon_takes() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "hetd", "token"], capture_output=True, text=True, check=True
    ).stdout.strip()
    assert len(out) >= config.MIN_TOKEN and out.isascii() and " " not in out
    cfg = config.replace(Config(), "server", worker_token=out)
    config.check_serving(cfg)
