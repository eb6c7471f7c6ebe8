"""Messages over the websocket frame cap travel as ``chunk`` frames, both ways: a real daemon whose
frame cap is far below one parameter frame, and real worker processes with the same cap."""

from __future__ import annotations

import aiohttp
import pytest

from hetd.protocol import wire
from tests.conftest import WORKER_AUTH, raw_hello

pytestmark = pytest.mark.slow

CAP = 4096  # bytes; the digits MLP's float32 frames are ~38 KB: ~10 chunks each


async def test_a_model_over_the_frame_cap_trains_in_chunks_both_ways(cluster) -> None:  # type: ignore[no-untyped-def]
    c = await cluster("asp", server={"max_frame_bytes": CAP})
    frame = 4 * c.engine.store.n_params
    assert frame > 8 * CAP, "the test needs frames well over the cap"
    for slowdown in (1, 2):
        await c.spawn(slowdown, 0.02, "--max-frame-bytes", str(CAP))
    await c.wait_for(lambda: len(c.engine.members.facts) == 2, 60, "2 workers to join")

    def trained() -> bool:
        acc = c.engine.evaluations.evals[-1][2] if c.engine.evaluations.evals else 0.0
        # both workers pushed (on a loaded machine the slower one may still be compiling when
        # the other alone has made 30 updates)
        both = all(c.engine.members.stats[w].pushes > 0 for w in c.engine.members.facts)
        return c.engine.applier.updates_applied >= 30 and acc > 0.8 and both

    await c.wait_for(trained, 120, "30 updates, accuracy > 0.8 and a push of each worker")
    stats = [c.engine.members.stats[w] for w in c.engine.members.facts]
    # every push (each ~38 KB, sent as chunks) was whole: applied exactly once, none refused
    assert sum(s.applied for s in stats) >= 30
    assert all(s.refused == 0 and s.duplicates == 0 for s in stats)
    assert all(s.bytes_in / max(1, s.pushes) > 4 * CAP for s in stats)  # the pushes were chunked
    # one version per applied update (under asp nothing is buffered); the figures if it fails
    applied = {
        w: (s.pushes, s.applied, s.dropped, s.refused, s.duplicates)
        for w, s in c.engine.members.stats.items()
    }
    assert c.engine.applier.updates_applied == c.engine.store.version, (
        c.engine.store.version,
        applied,
    )


async def test_a_chunked_message_over_the_model_bound_is_refused_and_the_session_goes_on(
    cluster,  # type: ignore[no-untyped-def]
) -> None:
    c = await cluster("asp", server={"max_frame_bytes": CAP})
    url = c.url + "/v1/ws"
    async with (
        aiohttp.ClientSession() as http,
        http.ws_connect(url, headers=WORKER_AUTH, max_msg_size=CAP) as ws,
    ):
        await ws.send_bytes(raw_hello())
        parts = wire.Reassembler(wire.MAX_MESSAGE)
        got = set()
        while "params" not in got:  # welcome, then the first parameters (in chunks)
            frame = await ws.receive(timeout=20)
            msg = wire.decode(frame.data, CAP)
            if msg.type == "chunk":
                whole = parts.feed(msg)
                if whole is None:
                    continue
                msg = wire.decode(whole, wire.MAX_MESSAGE)
            got.add(msg.type)
        huge = wire.encode("bye", 0, reason="x" * (4 * c.engine.store.n_params + (2 << 20)))
        for piece in wire.chunks(huge, CAP):
            await ws.send_bytes(piece)
        while True:
            msg = wire.decode((await ws.receive(timeout=20)).data, CAP)
            if msg.type == "error":
                break
        assert msg["code"] == "too_large", msg.body
        await ws.send_bytes(wire.encode("pull", 5, have=None))  # the session still serves
        while True:
            msg = wire.decode((await ws.receive(timeout=20)).data, CAP)
            if msg.type == "chunk" and msg["seq"] == 0:
                break
    assert len(c.engine.members.facts) <= 1
