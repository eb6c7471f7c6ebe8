"""The activation relay through a real daemon on loopback, spoken to by raw websocket clients:
``act``/``gact`` frames reach the neighbouring stage byte for byte (chunked when over the frame
cap), and every frame without a route is dropped with an error to its sender while the daemon and
the other sessions go on."""

from __future__ import annotations

from functools import partial
from typing import Any

import aiohttp
import numpy as np
import pytest

from hetd.codecs import registry as codecs
from hetd.protocol import wire
from policies.types import ReplicaShape
from tests.conftest import WORKER_AUTH

pytestmark = pytest.mark.slow  # a real daemon on loopback (and real worker processes)

CAP = 16 * 1024  # bytes: the big activation below is sent as chunks both ways


async def _join(http: aiohttp.ClientSession, url: str) -> tuple[Any, int]:
    ws = await http.ws_connect(url, headers=WORKER_AUTH, max_msg_size=CAP)
    # a raw client that says it runs pipeline stages (only such a worker is put in a replica)
    hello = dict(name="raw", device={"platform": "cpu"}, codecs=["none"], features=["stages"])
    await ws.send_bytes(wire.encode("hello", 1, **hello))
    msg = await _next(ws, "welcome")
    return ws, int(msg["worker_id"])


async def _next(ws: Any, type_: str) -> Any:
    """The next whole message of ``type_`` (chunks joined), skipping the others."""
    parts = wire.Reassembler(wire.MAX_MESSAGE)
    while True:
        frame = await ws.receive(timeout=20)
        assert frame.type == aiohttp.WSMsgType.BINARY, frame
        msg = wire.decode(frame.data, CAP)
        if msg.type == "chunk":
            whole = parts.feed(msg)
            if whole is None:
                continue
            msg = wire.decode(whole, wire.MAX_MESSAGE)
            msg.body["_frame"] = whole
        else:
            msg.body["_frame"] = frame.data
        if msg.type == type_:
            return msg


def _act(type_: str, x: np.ndarray, *, gen: int = 0, mb: int = 0) -> bytes:
    tensor = codecs.get_codec("none").encode(x)
    return wire.encode(type_, 0, replica=3, gen=gen, step=1, mb=mb, tensor=tensor)


async def _send_all(ws: Any, frame: bytes) -> None:
    for piece in wire.chunks(frame, CAP):
        await ws.send_bytes(piece)


async def test_relay_forwards_between_neighbours_and_drops_what_has_no_route(cluster) -> None:  # type: ignore[no-untyped-def]
    c = await cluster("asp", server={"max_frame_bytes": CAP}, model="hetd.zoo.blocks:mlp_model")
    relay = c.daemon.relay
    url = c.url + "/v1/ws"
    async with aiohttp.ClientSession() as http:
        (s0, w0), (s1, w1), (other, w2) = [await _join(http, url) for _ in range(3)]
        with pytest.raises(ValueError, match=r"not 0\.\.S-1"):
            relay.install({(3, 0, 0): w0, (3, 0, 2): w1})
        with pytest.raises(ValueError, match="two stages"):
            relay.install({(3, 0, 0): w0, (3, 0, 1): w0})
        relay.install({(3, 0, 0): w0, (3, 0, 1): w1})

        # forward and backward, byte for byte; the big one travels in chunks both ways
        small = _act("act", np.arange(6, dtype=np.float32).reshape(2, 3), mb=0)
        xb = np.random.default_rng(0).normal(size=(64, 256)).astype(np.float32)
        big = _act("act", xb, mb=1)
        assert len(big) > 4 * CAP
        await _send_all(s0, small)
        await _send_all(s0, big)
        got = [await _next(s1, "act"), await _next(s1, "act")]
        assert [m.body.pop("_frame") for m in got] == [small, big]
        np.testing.assert_array_equal(codecs.decode_tensor(got[1]["tensor"], "h"), xb)
        back = _act("gact", np.ones((2, 3), np.float32))
        await _send_all(s1, back)
        assert (await _next(s0, "gact")).body["_frame"] == back

        # no route: each is dropped with an error naming why, and nothing reaches anyone
        cases = [
            (s0, _act("gact", np.ones(2, np.float32)), "no previous stage"),
            (s1, _act("act", np.ones(2, np.float32)), "no next stage"),
            (other, _act("act", np.ones(2, np.float32)), f"worker {w2} is no stage"),
            (s0, _act("act", np.ones(2, np.float32), gen=1), "generation 1"),
        ]
        for ws, frame, words in cases:
            await ws.send_bytes(frame)
            err = await _next(ws, "error")
            assert err["code"] == "no_route" and words in err["message"], err.body
        # a malformed header is refused by the wire and not forwarded
        bad = wire.encode("act", 5, replica=3, gen=0, step=1, mb=-1, tensor={"codec": "none"})
        await s0.send_bytes(bad)
        err = await _next(s0, "error")
        assert (err["code"], err.id) == ("malformed", 5)
        marker = _act("act", np.full(2, 7.0, np.float32), mb=9)
        await s0.send_bytes(marker)
        assert (await _next(s1, "act")).body[
            "_frame"
        ] == marker  # the first act since: nothing leaked

        # a stage's worker leaves: its neighbour's frames are dropped with an error, no crash
        await s1.close()
        await c.wait_for(lambda: w1 not in c.engine.members.facts, 20, "stage 1's session to end")
        await s0.send_bytes(small)
        err = await _next(s0, "error")
        assert err["code"] == "route_down" and f"worker {w1}" in err["message"]
        stats = relay.stats()
        assert (stats.frames, stats.dropped) == (4, 5)
        # the daemon and the other sessions go on
        await other.send_bytes(wire.encode("pull", 11, have=None))
        assert (await _next(other, "params"))["version"] == c.engine.store.version

        # the replica driver with raw clients as its stages: a bad slice aborts the step and a
        # new one is released; a stage that leaves dissolves the replica
        driver = c.daemon.replicas
        assert driver is not None
        with pytest.raises(ValueError, match="end at the model's 2 blocks"):
            await driver.form([w0, w2], [0, 1, 3], 8, 1)
        with pytest.raises(ValueError, match="not connected"):
            await driver.form([w0, w1], [0, 1, 2], 8, 1)
        await driver.form([w0, w2], [0, 1, 2], micro=8, micro_batches=1)
        assigned = await _next(s0, "stage")
        assert (assigned["stage"], assigned["next"], assigned["blocks"]) == (0, w2, [0, 1])
        step = await _next(s0, "step")
        held = await _next(other, "step")
        assert (held["step"], held["base"]) == (step["step"], step["base"])
        ids = {"replica": 0, "gen": step["gen"], "step": step["step"]}
        wrong = {"b00/Dense_0/kernel": codecs.get_codec("none").encode(np.ones((2, 2), np.float32))}
        bad = wire.encode(
            "push",
            50,
            base=step["base"],
            kind="grad",
            tensors=wrong,
            samples=8,
            steps=1,
            compute_s=0.1,
            stage=0,
            **ids,
        )
        await s0.send_bytes(bad)
        again = await _next(s0, "step")
        assert again["step"] == step["step"] + 1 and driver.aborted == 1
        assert "not a parameter of that shape" in driver.dropped[-1]
        await other.close()  # stage 1 leaves
        gone = await _next(s0, "abort")
        assert gone["dissolve"] is True and driver.members == () and driver.assembled == 0

        # a stage that hangs (it never sends its slice) does not hold the replica for ever:
        # the step is given up after the timeout, nothing of it applied, and the replica ends
        s3, w3 = await _join(http, url)
        driver.min_timeout_s = driver.first_timeout_s = 0.5
        version = c.engine.store.version
        await driver.form([w0, w3], [0, 1, 2], micro=8, micro_batches=1)
        await _next(s3, "step")
        hung = await _next(s3, "abort")
        assert hung["dissolve"] is True and "not complete" in hung["reason"]
        assert driver.timeouts == 1 and driver.members == () and c.engine.pipelines.view == {}
        assert c.engine.store.version == version
        await s3.close()

        # a policy's Regroup runs several replicas at once, each with its own id and routes,
        # and an empty one dissolves them all
        (sa, wa), (sb, wb), (sc, wc) = [await _join(http, url) for _ in range(3)]
        shapes = (
            ReplicaShape((w0, wa), (0, 1, 2), 8, 1),
            ReplicaShape((wb, wc), (0, 1, 2), 8, 2),
        )
        await c.engine.queue.call(partial(driver.regroup, shapes))
        assert c.engine.pipelines.view == {w0: (w0, wa), wb: (wb, wc)}
        got = {w: await _next(ws, "stage") for w, ws in ((wa, sa), (wc, sc))}
        assert (got[wa]["replica"], got[wc]["replica"]) == (0, 1)
        assert (await _next(sb, "step"))["micro_batches"] == 2
        ours = {(k[0], w) for k, w in relay.routes.items() if k[0] in (0, 1)}  # 3: the test's
        assert ours == {(0, w0), (0, wa), (1, wb), (1, wc)}
        await c.engine.queue.call(partial(driver.regroup, ()))
        for ws in (s0, sa, sb, sc):
            assert (await _next(ws, "abort"))["dissolve"] is True
        assert c.engine.pipelines.view == {} and all(k[0] == 3 for k in relay.routes)
        for ws in (sa, sb, sc):
            await ws.close()
        await s0.close()
