"""Bad frames from a worker get an error and change nothing; the daemon carries on."""

from __future__ import annotations

import contextlib

import aiohttp
import msgpack
import numpy as np
import pytest

from hetd.codecs import registry as codecs
from hetd.local.procs import stop_processes
from hetd.protocol import wire
from tests.conftest import SHARED_LOOP, Cluster
from tests.conftest import WORKER_AUTH as AUTH
from tests.conftest import raw_hello as hello
from tests.conftest import recv_type as recv


def push(params: dict[str, np.ndarray], base: int, **overrides: object) -> bytes:
    tensors = codecs.encode_tree(params, codecs.get_codec("none"))
    fields = dict(base=base, kind="grad", tensors=tensors, samples=8, steps=1, compute_s=0.01)
    fields.update(overrides)
    return wire.encode("push", 7, **fields)


async def test_each_bad_frame_gets_its_error_and_nothing_is_applied(cluster) -> None:  # type: ignore[no-untyped-def]
    c = await cluster("asp", server={"max_frame_bytes": 4 * 1024 * 1024})
    async with aiohttp.ClientSession() as http:
        ws = await http.ws_connect(c.url + "/v1/ws", headers=AUTH, max_msg_size=0)
        await ws.send_bytes(hello())
        await recv(ws, "welcome")
        params_msg = await recv(ws, "params")
        params = codecs.decode_tree(params_msg["tensors"])
        zeros = {k: np.zeros_like(v) for k, v in params.items()}
        version = c.engine.store.version
        first = next(iter(zeros))

        nan = dict(zeros)
        nan[first] = np.full_like(zeros[first], np.nan)
        wrong_shape = dict(zeros)
        wrong_shape[first] = np.zeros((3, 3), np.float32)
        missing = dict(zeros)
        del missing[first]
        short = codecs.encode_tree(zeros, codecs.get_codec("none"))
        short[first] = dict(short[first], data=b"\0" * 8)
        cases = [
            (b"\xc1 not msgpack", "malformed"),
            (msgpack.packb([1, 2, 3]), "malformed"),
            (msgpack.packb({"v": 2, "type": "push", "id": 1}), "bad_version"),
            (msgpack.packb({"v": 1, "type": "teleport", "id": 1}), "unknown_type"),
            (push(zeros, version, kind="hessian"), "malformed"),
            (push(zeros, version, samples="many"), "malformed"),
            (push(nan, version), "not_finite"),
            (push(wrong_shape, version), "bad_tensor"),
            (push(missing, version), "bad_tensor"),
            (
                wire.encode(
                    "push",
                    9,
                    base=version,
                    kind="grad",
                    tensors=short,
                    samples=8,
                    steps=1,
                    compute_s=0.01,
                ),
                "bad_tensor",
            ),
            (
                wire.encode(
                    "welcome",
                    3,
                    worker_id=1,
                    model={},
                    dataset={},
                    shard={},
                    plan={},
                    heartbeat_s=1.0,
                    train={},
                ),
                "unexpected",
            ),
        ]
        for frame, code in cases:
            await ws.send_bytes(frame)
            err = await recv(ws, "error")
            assert err["code"] == code, (code, err.body)
            assert err["message"]
            if code in ("not_finite", "bad_tensor"):
                assert repr(first) in err["message"] or "missing" in err["message"]
        await ws.send_str("text frame")
        assert (await recv(ws, "error"))["code"] == "malformed"

        # Paths of mixed kinds (text and bytes) are refused like any bad tensor, and the error
        # names the push it answers.
        mixed = codecs.encode_tree(zeros, codecs.get_codec("none"))
        mixed[b"raw"] = mixed[first]  # type: ignore[index]
        await ws.send_bytes(push({}, version, tensors=mixed))
        err = await recv(ws, "error")
        assert (err["code"], err.id) == ("bad_tensor", 7), err.body
        assert "strings" in err["message"]
        assert c.engine.store.version == version, "a bad frame changed the model"

        # The same session still works: a good push is applied.
        await ws.send_bytes(push(zeros, version))
        ack = await recv(ws, "ack")
        assert ack["status"] == "applied"
        assert c.engine.store.version == version + 1

        # An oversize frame closes the socket with 1009 and applies nothing.
        # The daemon may close while the frame is still being written.
        with contextlib.suppress(ConnectionError):
            await ws.send_bytes(b"\0" * (5 * 1024 * 1024))
        closing = await ws.receive(timeout=20)
        while closing.type == aiohttp.WSMsgType.BINARY:  # replies queued before the close
            closing = await ws.receive(timeout=20)
        assert closing.type in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSED)
        # 1009 when the close frame arrives before the reset of the half-sent frame, else 1006.
        assert ws.close_code in (1009, 1006)
        await c.wait_for(lambda: bool(c.engine.members.departures), 10, "the session to end")
        assert "cap (1009)" in c.engine.members.departures[-1][2]
        assert c.engine.store.version == version + 1

        # The daemon is still up: a new session joins and gets parameters.
        ws2 = await http.ws_connect(c.url + "/v1/ws", headers=AUTH)
        await ws2.send_bytes(hello())
        assert (await recv(ws2, "welcome"))["worker_id"] >= 1
        assert (await recv(ws2, "params"))["version"] == version + 1
        await ws2.close()


@SHARED_LOOP
async def test_push_before_hello_is_refused(raw_asp: Cluster) -> None:
    c = raw_asp
    async with aiohttp.ClientSession() as http:
        ws = await http.ws_connect(c.url + "/v1/ws", headers=AUTH)
        await ws.send_bytes(push({}, 0))
        err = await recv(ws, "error")
        assert err["code"] == "no_hello"
        assert c.engine.store.version == 0  # no test on this daemon pushes anything it applies
        assert not c.engine.members.facts


@pytest.mark.parametrize("offered", [["int9"], []])
@SHARED_LOOP
async def test_no_usable_codec(raw_asp: Cluster, offered: list[str]) -> None:
    c = raw_asp
    async with aiohttp.ClientSession() as http:
        ws = await http.ws_connect(c.url + "/v1/ws", headers=AUTH)
        await ws.send_bytes(wire.encode("hello", 1, name="x", device={}, codecs=offered))
        err = await recv(ws, "error")
        assert err["code"] == "no_codec"
        assert "none" in err["message"]


async def test_refused_pushes_do_not_stall_bsp(cluster) -> None:  # type: ignore[no-untyped-def]
    """A real worker whose pushes are sometimes NaN: each is refused with an error naming it, the
    worker computes again from the parameters it holds, and BSP rounds go on for both."""
    c = await cluster("bsp")
    await c.spawn(1.0, 0.01)
    bad = await c.spawn(1.0, 0.01, "--emulate-bad-pushes", "0.25")
    await c.wait_for(lambda: c.engine.store.version >= 40, 90, "40 BSP rounds past refused pushes")
    assert len(c.engine.members.facts) == 2 and not c.engine.members.departures
    await stop_processes([bad])
    assert bad.stderr is not None
    log = (await bad.stderr.read()).decode()
    assert "daemon error not_finite" in log, log[-2000:]


async def test_a_publish_that_cannot_be_encoded_drops_the_session_not_the_worker(cluster) -> None:  # type: ignore[no-untyped-def]
    """Fault injection: encoding one publish raises. The released worker is not left waiting for
    parameters that never come: its session is dropped with a reason, it reconnects as itself and
    gets parameters in full, and training goes on."""
    c = await cluster("asp")
    await c.spawn(1.0, 0.01)
    await c.wait_for(lambda: c.engine.store.version >= 10, 60, "10 updates")
    downlink = c.engine.publisher.downlink
    real = downlink.frames
    failures = []

    def flaky(*args, **kwargs):  # type: ignore[no-untyped-def]
        if not failures:
            failures.append(1)
            raise RuntimeError("injected encoding failure")
        return real(*args, **kwargs)

    downlink.frames = flaky  # type: ignore[method-assign]
    await c.wait_for(lambda: bool(c.engine.members.departures), 30, "the session to be dropped")
    wid = c.engine.members.departures[-1][1]
    assert "could not encode parameters" in c.engine.members.departures[-1][2]
    version = c.engine.store.version
    await c.wait_for(
        lambda: wid in c.engine.members.facts and c.engine.store.version >= version + 10,
        60,
        "the worker back as itself and 10 more updates",
    )
    assert len(c.engine.members.departures) == 1
