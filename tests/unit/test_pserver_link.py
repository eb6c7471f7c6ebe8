"""The head's side of the pservers' link on loopback: what it sends a pserver, and what it does with
frames it cannot use (answers ``error``, closes that connection, goes on serving the others).

The engine is a real one on a small model; the pserver's side is this test, speaking the frames.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import numpy as np
import optax
import pytest

from hetd.core.engine import Engine
from hetd.core.entries import EngineConfig
from hetd.core.ingest import decode_hello
from hetd.core.store import Store
from hetd.protocol import wire
from hetd.protocol.messages import PushIn
from hetd.pserver import link
from hetd.pserver.log import ApplyEntry, DecisionLog, Record, from_dict
from hetd.pserver.partition import partition
from hetd.server.pserver_link import HeadLink, LinkSetup
from policies import make_policy
from tests.conftest import FakeClock, FakePeer

PARAMS = {"a/w": np.ones((4, 3), np.float32), "b/w": np.zeros(5, np.float32)}


@pytest.fixture
async def head() -> AsyncIterator[tuple[HeadLink, Engine]]:
    log = DecisionLog()
    engine = Engine(
        Store(PARAMS, optax.sgd(0.1)),
        make_policy("asp", {}),
        EngineConfig(guard_factor=0.0),
        FakeClock(),
        decisions=log,
    )
    pmap = partition({k: v.shape for k, v in PARAMS.items()}, 2, block_bytes=0)
    hl = HeadLink(engine, LinkSetup(pmap, "sgd:lr=0.1", PARAMS))
    await hl.start("127.0.0.1", 0)
    yield hl, engine
    await hl.close()


async def _connect(hl: HeadLink) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_connection("127.0.0.1", hl.port)


async def _refused(hl: HeadLink, data: bytes) -> str:
    """What the head answers ``data`` with (an error frame), the connection then closed."""
    reader, writer = await _connect(hl)
    writer.write(data)
    await writer.drain()
    reply = await asyncio.wait_for(link.recv(reader), 10)
    assert reply["t"] == "error"
    assert await asyncio.wait_for(reader.read(), 10) == b""  # closed
    writer.close()
    return str(reply["message"])


def _push(engine: Engine, wid: int, pid: int) -> None:
    grad = {k: np.full(v.shape, 0.5, np.float32) for k, v in PARAMS.items()}
    engine.push(PushIn(wid, pid, engine.store.version, "grad", grad, 8, 1, 1.0, None, None, 1))


async def test_a_pserver_is_welcomed_and_follows_the_log(head: tuple[HeadLink, Engine]) -> None:
    hl, engine = head
    fields = {"name": "w", "device": {"platform": "cpu"}, "codecs": ["none"]}
    wid = engine.join(decode_hello(wire.decode(wire.encode("hello", 1, **fields))), FakePeer())
    _push(engine, wid, 1)  # logged before the pserver comes: sent from its position on
    reader, writer = await _connect(hl)
    await link.send(writer, "hello", server=1, position=0, epoch="")
    welcome = await asyncio.wait_for(link.recv(reader), 10)
    assert welcome["t"] == "welcome" and welcome["start"] == 0 and welcome["epoch"] == hl.epoch
    shapes = hl.setup.pmap.slice_shapes(1)
    base = link.decode_tensors(welcome["base"], shapes)
    assert all(np.array_equal(base[k], PARAMS[k]) for k in shapes)
    got: list[Record] = []
    applies: list[ApplyEntry] = []
    while len(applies) < 2:
        msg = await asyncio.wait_for(link.recv(reader), 10)
        got += [from_dict(d) for d in msg["items"]]
        applies = [r.entry for r in got if isinstance(r.entry, ApplyEntry)]
        if len(applies) == 1 and applies[0].pid == 1 and engine.store.version == 1:
            _push(engine, wid, 2)  # written now: the link is woken and sends it
    assert [a.pid for a in applies] == [1, 2]
    assert [r.position for r in got] == list(range(1, len(got) + 1))  # in order, no gap
    await link.send(writer, "durable", position=2)
    for _ in range(100):
        if hl.durable[1] == 2:
            break
        await asyncio.sleep(0.01)
    assert hl.durable == [0, 2] and hl.floor() == 0  # slice 0 has saved nothing
    # the same slice again (a restarted process): the old connection is closed
    reader2, writer2 = await _connect(hl)
    await link.send(writer2, "hello", server=1, position=2, epoch=hl.epoch)
    assert (await asyncio.wait_for(link.recv(reader2), 10))["base"] is None
    assert await asyncio.wait_for(reader.read(), 10) == b""
    for w in (writer, writer2):
        w.close()


async def test_what_the_head_cannot_use_closes_that_connection_only(
    head: tuple[HeadLink, Engine],
) -> None:
    hl, _ = head
    assert "not a msgpack frame" in await _refused(hl, (3).to_bytes(4, "big") + b"\xc1\xc1\xc1")
    assert "over the limit" in await _refused(hl, (1 << 30).to_bytes(4, "big"))
    assert "must be a hello" in await _refused(hl, link.pack("durable", position=3))
    assert "slice 2 of 2" in await _refused(hl, link.pack("hello", server=2, position=0, epoch=""))
    assert "wrong type" in await _refused(hl, link.pack("hello", server=True, position=0, epoch=""))
    bad = link.pack("hello", server=0, position=9, epoch=hl.epoch)
    assert "not in the log" in await _refused(hl, bad)
    # a connection that sends a bad report after its hello is closed; the head goes on
    reader, writer = await _connect(hl)
    await link.send(writer, "hello", server=0, position=0, epoch="")
    assert (await asyncio.wait_for(link.recv(reader), 10))["t"] == "welcome"
    await link.send(writer, "durable", position="x")
    reply = await asyncio.wait_for(link.recv(reader), 10)
    assert reply["t"] == "error" and "wrong type" in reply["message"]
    writer.close()
    reader, writer = await _connect(hl)
    await link.send(writer, "hello", server=0, position=0, epoch="")
    assert (await asyncio.wait_for(link.recv(reader), 10))["t"] == "welcome"
    writer.close()
