"""Same-host shared memory: a real worker on loopback trains through the daemon's ring and its
own; a worker that does not name ``shm`` keeps the socket; a forged reference is refused with
the push's id and loses nothing; and no segment is left in /dev/shm once the daemon stops."""

from __future__ import annotations

import asyncio
import contextlib
import os

import aiohttp
import numpy as np
import pytest

from hetd.cli.admin_text import workers_text
from hetd.codecs import registry as codecs
from hetd.local.procs import stop_processes
from hetd.protocol import shm, wire
from hetd.protocol.frames import as_params
from hetd.protocol.params import apply_params, hash_matches
from hetd.server.daemon import Daemon
from tests.conftest import WORKER_AUTH, make_config, recv_type, start_worker

pytestmark = pytest.mark.slow


def _hello(features: list[str], name: str = "raw") -> bytes:
    return wire.encode(
        "hello", 1, name=name, device={"platform": "cpu"}, codecs=["none"], features=features
    )


def _gone(name: str) -> bool:
    return not os.path.exists(os.path.join(shm.SHM_DIR, name))


async def _next(ws: aiohttp.ClientWebSocketResponse) -> wire.Message:
    frame = await ws.receive(timeout=20)
    assert frame.type == aiohttp.WSMsgType.BINARY, frame
    return wire.decode(frame.data)


async def _reply_to(ws: aiohttp.ClientWebSocketResponse, id_: int) -> wire.Message:
    """The ack or error answering request ``id_`` (other frames skipped)."""
    while True:
        msg = await _next(ws)
        if msg.type in ("ack", "error") and msg.id == id_:
            return msg


async def test_shared_memory_both_ways_and_nothing_left() -> None:
    daemon = Daemon(make_config("asp"))
    procs: list[asyncio.subprocess.Process] = []
    names: list[str] = []
    try:
        port = await daemon.start()
        url = f"http://127.0.0.1:{port}/v1/ws"
        async with aiohttp.ClientSession() as http:
            # A worker that names only "hash" is never offered shared memory: params come whole.
            plain = await http.ws_connect(url, headers=WORKER_AUTH)
            await plain.send_bytes(_hello(["hash"], name="plain"))
            # A raw same-host worker that takes it: offer, proof, then references.
            raw = await http.ws_connect(url, headers=WORKER_AUTH)
            await raw.send_bytes(_hello(["hash", "shm"]))
            first = await recv_type(raw, "params")  # before the offer: the socket
            offer = await recv_type(raw, "shm_offer")
            down = shm.RingReader(offer["segment"])
            up = shm.Ring("up", 2, down.slot_bytes)
            names += [down.name, up.name]
            # A wrong nonce proves nothing: refused, and the socket stays.
            await raw.send_bytes(wire.encode("shm_ready", 5, nonce="0" * 16, segment=up.name))
            assert (await _reply_to(raw, 5))["code"] == "bad_nonce"
            await raw.send_bytes(wire.encode("shm_ready", 6, nonce=down.nonce, segment=up.name))

            shapes = {k: v.shape for k, v in codecs.decode_tree(first["tensors"]).items()}
            grads = {k: np.full(s, 1e-3, np.float32) for k, s in shapes.items()}

            def push(id_: int, base: int) -> bytes:
                return wire.encode(
                    "push",
                    id_,
                    base=base,
                    kind="grad",
                    tensors=codecs.encode_tree(grads, codecs.none_codec()),
                    samples=32,
                    steps=1,
                    compute_s=0.01,
                )

            ref = up.write(push(77, first["version"]))
            forged = {
                "a segment that is not the worker's": {**ref.fields(), "segment": down.name},
                "out of bounds": {**ref.fields(), "offset": up.size + 16},
                "another length": {**ref.fields(), "length": ref.length + 1},
                "a generation not written": {**ref.fields(), "gen": ref.gen + 1},
            }
            for i, fields in enumerate(forged.values()):
                await raw.send_bytes(wire.encode("push_ref", 70 + i, **fields))
                refused = await _reply_to(raw, 70 + i)
                assert refused.type == "error", (list(forged)[i], refused)
                assert f"push_ref {70 + i}" in refused["message"], refused
            assert daemon.engine.applier.updates_applied == 0  # nothing of them was applied
            await raw.send_bytes(wire.encode("push_ref", 77, **ref.fields()))  # the real one
            assert (await _reply_to(raw, 77))["status"] == "applied"
            # ... and the parameters it made come as a reference to the daemon's ring.
            params_ref = await recv_type(raw, "params_ref")
            params = as_params(wire.decode(down.read(shm.ref_of(params_ref.body))))
            assert params.version == params_ref["version"] >= 1
            held = apply_params(None, params)
            assert held is not None and hash_matches(held, params) is True
            assert daemon.shm.frames_packed >= 1  # the store packed it there, nothing copied
            assert (await recv_type(plain, "params"))["full"]  # the plain worker: the socket
            # /v1/workers (and `hetd workers`) names each one's path
            paths = {row["name"]: row["path"] for row in daemon.engine.workers()}
            assert paths == {"plain": "ws", "raw": "shm"}, paths
            assert "PATH" in workers_text({"workers": daemon.engine.workers()})

            # A real hetd-worker on loopback trains through shared memory.
            proc = await start_worker(port, 4)
            procs.append(proc)
            assert proc.stderr is not None
            log = (await asyncio.wait_for(proc.stderr.read(), 180)).decode(errors="replace")
            assert await asyncio.wait_for(proc.wait(), 60) == 0, log[-2000:]
            assert "shared memory on" in log, log[-2000:]
            # the raw one's and the worker's 4 (its first may beat its shm_ready to the daemon)
            assert daemon.shm.pushes_read >= 4, log[-2000:]
            await raw.close()  # the daemon unlinks the ring of a worker that left
            for _ in range(100):
                if _gone(up.name):
                    break
                await asyncio.sleep(0.05)
            assert _gone(up.name)
            up.close()
            down.close()
            await plain.close()
    finally:
        await stop_processes(procs)
        with contextlib.suppress(Exception):
            await daemon.stop()
    assert names and all(_gone(n) for n in names)
    leftover = [n for n in os.listdir(shm.SHM_DIR) if n.startswith(f"hetd-dl-{os.getpid():08x}")]
    assert leftover == []
