"""The daemon's memory bound under a slow reader (docs/benchmark.md): a worker that stops reading
its socket keeps at most the one parameter frame being written to it, never a queue of older
snapshots; once it reads again it gets the newest parameters in full.

Real daemon on loopback, real websockets; live snapshot frames are counted with tracemalloc (the
frames the store packs, each a block of the frame's size allocated in the wire module)."""

from __future__ import annotations

import asyncio
import tracemalloc

import aiohttp
import pytest

from hetd.bench.system import make_daemon, n_params, synthetic_shapes
from hetd.bench.system_peers import PushFrame, ready_update
from hetd.protocol import wire

pytestmark = pytest.mark.slow  # a real daemon on loopback (and real worker processes)

PARAMS = 2_000_000  # 8 MB frames: a few fill the loopback socket buffers of a reader that stops


def _live_frames(min_bytes: int) -> int:
    """Blocks of at least ``min_bytes`` the wire module allocated and that are still alive."""
    snap = tracemalloc.take_snapshot()
    return sum(
        1
        for t in snap.traces
        if t.size >= min_bytes and t.traceback[0].filename.endswith("hetd/protocol/wire.py")
    )


def _hello(name: str) -> bytes:
    device = {"platform": "cpu", "kind": "test", "memory": 0}
    return wire.encode("hello", 1, name=name, device=device, codecs=["none"])


async def _next_params(ws: aiohttp.ClientWebSocketResponse) -> int:
    """Read until a ``params`` frame; its version."""
    while True:
        frame = await asyncio.wait_for(ws.receive(), 60.0)
        assert frame.type == aiohttp.WSMsgType.BINARY, frame
        msg = wire.decode(frame.data, 1 << 30)
        if msg.type == "params":
            return int(msg["version"])


async def _scenario() -> None:
    shapes = synthetic_shapes(PARAMS)
    frame_bytes = 4 * n_params(shapes)
    daemon = make_daemon(shapes, "none")
    await daemon.start()
    engine = daemon.engine
    tracemalloc.start(1)  # after the start-up (JAX's imports and compiles, untraced, go faster)
    url = f"ws://127.0.0.1:{daemon.port}/v1/ws"
    tensors = ready_update(shapes, "none", 0)
    try:
        async with aiohttp.ClientSession() as http:
            # The slow reader: it joins and pushes, and reads nothing until told.
            slow = await http.ws_connect(url, max_msg_size=1 << 30, compress=0)
            await slow.send_bytes(_hello("slow"))
            push = PushFrame(tensors)
            fast = await http.ws_connect(url, max_msg_size=1 << 30, compress=0)
            await fast.send_bytes(_hello("fast"))
            held = await _next_params(fast)
            fast_push = PushFrame(tensors)
            # Each slow push is applied and answered with a full frame, which its socket
            # cannot take; the fast worker moves the version on between them.
            for i in range(1, 9):
                await slow.send_bytes(bytes(push.frame(i, 0)))
                for j in range(2):
                    await fast.send_bytes(bytes(fast_push.frame(2 * i + j, held)))
                    held = await _next_params(fast)
            await asyncio.sleep(1.0)  # every release written or dropped
            version = await engine.queue.call(lambda: engine.store.version)
            assert version >= 16 + 8  # every push applied
            # the frame being written to the slow reader, and the current one (no queue)
            live = _live_frames(frame_bytes)
            assert 1 <= live <= 2, live
            stats = await engine.queue.call(lambda: dict(engine.members.stats))
            slow_id = next(w for w, st in stats.items() if st.pushes == 8)
            # The slow reader reads again: what it gets ends with the newest parameters in full.
            got = []
            while True:
                try:
                    frame = await asyncio.wait_for(slow.receive(), 5.0)
                except TimeoutError:
                    break
                msg = wire.decode(frame.data, 1 << 30)
                if msg.type == "params":
                    got.append((int(msg["version"]), bool(msg["full"])))
            assert got and got[-1][1], got
            newest = await engine.queue.call(lambda: engine.store.version)
            assert got[-1][0] == newest, (got, newest)
            assert len(got) < 8, got  # dropped frames were never sent
            facts = await engine.queue.call(lambda: engine.members.facts[slow_id])
            assert facts.version == newest  # what the engine thinks it holds, it holds
            await slow.close()
            await fast.close()
    finally:
        tracemalloc.stop()
        await daemon.stop(final_checkpoint=False)


def test_a_slow_reader_pins_one_snapshot_and_gets_the_newest_when_it_reads() -> None:
    asyncio.run(_scenario())
