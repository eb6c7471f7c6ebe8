"""The pservers' frames on plain sockets (hetd.protocol.sockframes): the same wire as the streams'
(a peer on either side reads the other), every frame whole and in order whatever the reads cut,
the large-frame buffer handed back only when nothing still reads it, limits, a peer that goes
away, and a close while a read waits."""

from __future__ import annotations

import asyncio
import os
import socket
import tracemalloc

import numpy as np
import pytest

from hetd.protocol import pslink
from hetd.protocol.sockframes import SCRATCH, FrameServer, FrameSocket


async def _pair() -> tuple[FrameSocket, FrameSocket]:
    a, b = socket.socketpair()
    return FrameSocket(a), FrameSocket(b)


def _frame(body: bytes) -> bytes:
    return len(body).to_bytes(4, "big") + body


async def test_frames_of_every_size_come_whole_and_in_order() -> None:
    a, b = await _pair()
    bodies = [os.urandom(n) for n in (0, 1, 3, SCRATCH - 4, SCRATCH, SCRATCH + 1, 5 << 20, 7)]
    wire = b"".join(_frame(x) for x in bodies)
    # one write holding every frame, so reads cut frames anywhere (and read ahead of small ones)
    sending = asyncio.create_task(a.send(wire))
    for want in bodies:
        got = await b.recv()
        assert bytes(got) == want
    await sending
    a.close()
    b.close()


async def test_segments_go_out_as_given_without_copies_of_large_ones() -> None:
    a, b = await _pair()
    big = np.arange(3 << 20, dtype=np.float32)
    segments = pslink.slice_frame(5, 2, {"w": big})
    sending = asyncio.create_task(a.send(*segments))
    msg = await b.recv_msg()
    await sending
    assert msg["t"] == "slice" and msg["position"] == 5 and msg["version"] == 2
    np.testing.assert_array_equal(pslink.read_slice(msg, {"w": big.shape})["w"], big)
    a.close()
    b.close()


async def test_streams_and_sockets_speak_the_same_wire() -> None:
    async def echo(conn: FrameSocket) -> None:
        while True:
            msg = await conn.recv_msg()
            await conn.send_msg("back", got=msg["data"])

    server = await FrameServer.start(echo, "127.0.0.1", 0)
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    for n in (10, 2 << 20):
        data = os.urandom(n)
        writer.write(pslink.pack("part", data=data))
        await writer.drain()
        reply = await pslink.recv(reader)
        assert reply == {"t": "back", "got": data}
    writer.close()
    server.close()
    await server.wait_closed()


async def test_a_large_frame_buffer_is_read_into_again_only_once_nothing_refers_to_it() -> None:
    a, b = await _pair()
    bodies = [bytes([k]) * (SCRATCH * 4) for k in range(1, 6)]
    sending = asyncio.create_task(a.send(b"".join(_frame(x) for x in bodies)))
    assert bytes(await b.recv()) == bodies[0]
    assert bytes(await b.recv()) == bodies[1]  # (the first view is gone: its buffer again)
    assert b.allocated == 1
    kept = np.frombuffer(await b.recv(), np.uint8)  # an array still reads the third frame
    view = await b.recv()  # so the fourth gets a buffer of its own
    assert bytes(view) == bodies[3] and kept.tobytes() == bodies[2]
    held = view[10:20]  # a slice of the fourth, kept: the fifth gets another
    del view
    assert bytes(await b.recv()) == bodies[4]
    assert kept.tobytes() == bodies[2] and bytes(held) == bodies[3][10:20]
    assert b.allocated == 3
    await sending
    a.close()
    b.close()


async def test_a_frame_over_the_limit_is_refused() -> None:
    a, b = await _pair()
    await a.send((1 << 20).to_bytes(4, "big"))
    with pytest.raises(pslink.FrameError, match="over the limit"):
        await b.recv(max_bytes=1 << 16)
    a.close()
    b.close()


async def test_a_length_alone_reserves_no_memory() -> None:
    a, b = await _pair()
    tracemalloc.start()
    try:
        reading = asyncio.create_task(b.recv())
        await a.send((512 << 20).to_bytes(4, "big") + bytes(300_000))  # claims 512 MiB
        await asyncio.sleep(0.2)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert not reading.done() and peak < 8 << 20  # the buffer grows with the bytes that came
    a.close()
    with pytest.raises(asyncio.IncompleteReadError):
        await reading
    b.close()


async def test_a_peer_that_goes_away_mid_frame_ends_the_read() -> None:
    a, b = await _pair()
    await a.send((1 << 20).to_bytes(4, "big") + bytes(1000))
    a.close()
    with pytest.raises(asyncio.IncompleteReadError):
        await b.recv()
    c, d = await _pair()
    c.close()
    with pytest.raises(asyncio.IncompleteReadError):
        await d.recv()  # before any frame
    b.close()
    d.close()


async def test_close_while_a_read_waits_ends_that_read() -> None:
    a, b = await _pair()
    waiting = asyncio.create_task(b.recv())
    await asyncio.sleep(0.05)
    b.close()
    with pytest.raises((asyncio.IncompleteReadError, OSError)):
        await asyncio.wait_for(waiting, 10)
    assert b.sock.fileno() == -1  # closed once the read let go
    a.close()


async def test_skim_keeps_the_envelope_and_lets_the_rest_go() -> None:
    a, b = await _pair()
    big = os.urandom(3 << 20)
    sending = asyncio.create_task(a.send(_frame(big) + _frame(b"after")))
    n, head = await b.skim(100)
    assert n == len(big) and head == big[:100]
    assert bytes(await b.recv()) == b"after"
    await sending
    a.close()
    b.close()


async def test_a_closed_server_ends_its_connections_and_frees_its_port() -> None:
    served: list[FrameSocket] = []

    async def hold(conn: FrameSocket) -> None:
        served.append(conn)
        await conn.recv()

    server = await FrameServer.start(hold, "127.0.0.1", 0)
    client = await FrameSocket.connect("127.0.0.1", server.port)
    while not served:
        await asyncio.sleep(0.01)
    server.close()
    await server.wait_closed()
    assert served[0].closed
    with pytest.raises(asyncio.IncompleteReadError):
        await asyncio.wait_for(client.recv(), 10)  # the server's side went away
    again = await FrameServer.start(hold, "127.0.0.1", server.port)  # the port is free
    again.close()
    await again.wait_closed()
    client.close()


def _ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
    except OSError:
        return False
    return True


@pytest.mark.skipif(not _ipv6_loopback(), reason="this host has no IPv6 loopback")
async def test_a_server_listens_on_an_ipv6_address() -> None:
    async def echo(conn: FrameSocket) -> None:
        await conn.send(_frame(bytes(await conn.recv())))

    server = await FrameServer.start(echo, "::1", 0)
    client = await FrameSocket.connect("::1", server.port)
    await client.send(_frame(b"over v6"))
    assert bytes(await client.recv()) == b"over v6"
    client.close()
    server.close()
    await server.wait_closed()


def test_a_part_frame_as_segments_is_the_packed_frame_byte_for_byte() -> None:
    rng = np.random.default_rng(0)
    q = rng.integers(-127, 128, size=(40, 6), dtype=np.int8)
    f = rng.normal(size=(5, 4)).astype(np.float32)
    tensors = {
        "a#rows=10:30": (q[10:30], 0.0125),  # a block of rows: a view, sent uncopied
        "b": (np.asarray(np.float32(1.5)), None),  # 0-d stays 0-d
        "c": (f.T, None),  # not C-contiguous: copied once
        "d": (np.zeros((0, 3), np.float32), None),
    }
    segments = pslink.part_frame(3, 2**40, tensors)
    entries = {k: pslink.tensor_entry(v, s) for k, (v, s) in tensors.items()}
    assert b"".join(segments) == pslink.pack("part", worker=3, pid=2**40, tensors=entries)
    views = [s for s in segments if isinstance(s, memoryview)]
    assert any(np.shares_memory(np.frombuffer(v, np.int8), q) for v in views)
