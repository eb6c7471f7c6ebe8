"""The clients of the system benchmark, each run in its own process: what they send and count.

Owns :class:`Job` and :class:`Report` (what the parent asks a peer process to do and what it says
back), the three client loops, and :class:`PeerPool`, the ``spawn``-started processes that run them:

``hetd``
    A no-compute worker speaking protocol v1 to the real daemon: ``hello``, then for every
    ``params`` frame it receives, one ``push`` of a ready-made update (encoded once with the codec,
    packed once) based on that version — the real worker's message flow with the compute left out.
    Decoding the parameters is the worker's compute too: it reads a ``params`` frame's envelope
    and not its tensors, so it costs the CPU that the bare client does (both share 2 cores with
    the server).
``bare``
    The physical limit: the same frame sizes over a bare aiohttp websocket, no hetd code on the
    path. It sends a frame of the push's size and waits for the server's replies (an ack-sized and
    a params-sized frame, :mod:`hetd.bench.system_limit`) before it sends the next.
``idle``
    Many connected workers that only say ``hello`` and send heartbeats (the engine-latency run).

This module imports no JAX (a peer process starts in well under a second). Frames are counted on
the server side by the parent; a peer's :class:`Report` gives the frame sizes the limit run copies
and the pushes it made, so a test can check that every push was applied.
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing as mp
import struct
import time
import traceback
from collections.abc import Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any, cast

import aiohttp
import msgpack
import numpy as np

from hetd.bench.system_parts import PartFrames, PartsLinks, PullLinks
from hetd.codecs import registry as codecs
from hetd.protocol import shm, wire
from hetd.protocol.params import params_envelope

Shapes = tuple[tuple[str, tuple[int, ...]], ...]
"""A model's tensors as ``(path, shape)`` pairs, in order."""

READY = "ready"
STOP = "stop"


@dataclass(frozen=True, slots=True)
class Job:
    """One peer's part of a benchmark cell."""

    kind: str  # "hetd" | "bare" | "idle"
    url: str  # ws://host:port/path
    codec: str = "none"
    shapes: Shapes = ()
    push_bytes: int = 0  # bare: size of each frame sent
    replies: int = 2  # bare: frames the server answers each one with
    connections: int = 1  # idle: websockets to hold open
    heartbeat_s: float = 2.0
    token: str = ""
    cap: int = wire.DEFAULT_MAX_FRAME  # the largest websocket message taken
    frame_cap: int = wire.DEFAULT_MAX_FRAME  # hetd: larger pushes go (and params come) in chunks
    seed: int = 0
    shm: bool = False  # hetd: name "shm" in hello and take shared memory when offered


@dataclass(slots=True)
class Report:
    """What a peer did between its first exchange and ``stop``."""

    pushes: int = 0  # push frames sent (hetd), or frames sent (bare)
    applied: int = 0  # acks with status applied (hetd)
    push_frame_bytes: int = 0  # size of one push frame
    # size of the update's whole push frame (a push that goes as a header: what its parts carry)
    update_bytes: int = 0
    params_frames: int = 0  # params frames that answered a push
    params_bytes: int = 0  # their total size
    ack_bytes: int = 0  # size of one ack frame
    connected: int = 0  # websockets that completed the handshake
    error: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def ready_update(shapes: Shapes, codec: str, seed: int) -> bytes:
    """A gradient of small normal values, encoded with ``codec`` and packed once: the ``tensors``
    map of a push, as msgpack bytes."""
    rng = np.random.default_rng(seed)
    tensors = {
        path: rng.standard_normal(shape, dtype=np.float32) * np.float32(1e-3)
        for path, shape in shapes
    }
    encoded = codecs.encode_tree(tensors, codecs.from_spec(codec))
    packed: bytes = msgpack.packb(encoded, use_bin_type=True)
    return packed


class PushFrame:
    """A protocol-v1 ``push`` of a ready-made update, built once: the envelope's ``id`` and
    ``base`` are packed as fixed-width uint64 and patched in place for each push, and the
    ``tensors`` map was packed once, so a push costs what the bare client's frame costs (the
    websocket client copies the frame when it masks it, so reusing the buffer is safe)."""

    def __init__(self, tensors_packed: bytes) -> None:
        fields: dict[str, Any] = {
            "v": wire.PROTOCOL_VERSION,
            "type": "push",
            "id": _U64,
            "base": _U64,
            "kind": "grad",
            "samples": 32,
            "steps": 1,
            "compute_s": 0.0,
            "sent_at": _F64,  # as a worker stamps it: the daemon measures the link from it
        }
        packer = msgpack.Packer(use_bin_type=True)
        head = bytearray(packer.pack_map_header(len(fields) + 1))
        self._at: dict[str, int] = {}
        for key, value in fields.items():
            head += packer.pack(key)
            if value is _U64:
                self._at[key] = len(head) + 1
                head += b"\xcf" + bytes(8)  # msgpack uint64: 0xcf + 8 big-endian bytes
            elif value is _F64:
                self._at[key] = len(head) + 1
                head += b"\xcb" + bytes(8)  # msgpack float64: 0xcb + 8 big-endian bytes
            else:
                head += packer.pack(value)
        head += packer.pack("tensors")
        self.buffer = head + tensors_packed

    def frame(self, request_id: int, base: int) -> bytearray:
        """The frame for this push (the same buffer, patched)."""
        struct.pack_into(">Q", self.buffer, self._at["id"], request_id)
        struct.pack_into(">Q", self.buffer, self._at["base"], base)
        struct.pack_into(">d", self.buffer, self._at["sent_at"], time.time())
        return self.buffer


_U64 = object()  # placeholder for a fixed-width uint64 field
_F64 = object()  # placeholder for a float64 field


def params_version(frame: bytes) -> int | None:
    """The ``version`` of a daemon ``params`` frame, read from its envelope alone; None for any
    other frame. The no-compute sender does not apply parameters, so it does not unpack their
    tensors (as the bare client does not) — the worker's decoding is part of its compute."""
    env = params_envelope(frame)
    return None if env is None or env[0].get("v") != wire.PROTOCOL_VERSION else env[1]


def chunk_head(frame: bytes) -> tuple[int, bool, int] | None:
    """A ``chunk`` frame's ``seq``, ``last`` and where its ``data`` starts (the last field, as
    :func:`hetd.protocol.wire.chunks` packs it), read from the envelope alone; None for any other
    frame. The sender reads the params frame's version from the first chunk and counts the rest
    without joining them (it does not apply parameters)."""
    unpacker = msgpack.Unpacker(raw=False, max_buffer_size=1024)
    unpacker.feed(frame[:128])
    fields: dict[str, Any] = {}
    try:
        for _ in range(unpacker.read_map_header()):
            key = unpacker.unpack()
            if key == "data":
                at = unpacker.tell()
                width = {0xC4: 1, 0xC5: 2, 0xC6: 4}.get(frame[at])
                if width is None or fields.get("type") != "chunk":
                    return None
                seq, last = fields.get("seq"), fields.get("last")
                if not isinstance(seq, int) or not isinstance(last, bool):
                    return None
                return seq, last, at + 1 + width
            fields[key] = unpacker.unpack()
    except (msgpack.OutOfData, ValueError, IndexError):
        return None
    return None


def _hello(name: str, codec: str, shm_too: bool = False) -> bytes:
    device = {"platform": "cpu", "kind": "bench", "memory": 0}
    offered = sorted({codecs.spec_name(codec), "none"})
    # the features a real worker names: the daemon's cost per update includes the hash it pays
    features = [*wire.WORKER_FEATURES, *((shm.FEATURE,) if shm_too else ())]
    return wire.encode("hello", 1, name=name, device=device, codecs=offered, features=features)


class _Shm:
    """A sender's shared memory with the daemon: its ring read-only, ours for the pushes."""

    def __init__(self, segment: str) -> None:
        self.down = shm.RingReader(segment, populate=True)
        self.up = shm.Ring("up", 2, self.down.slot_bytes)

    def ready(self) -> bytes:
        return wire.encode("shm_ready", 0, nonce=self.down.nonce, segment=self.up.name)

    def params(self, msg: wire.Message) -> int:
        """Copy the referenced frame out (as a worker does before it decodes); its size."""
        return len(self.down.read(shm.ref_of(msg.body)))

    def push(self, frame: bytearray, request: int) -> bytes:
        return wire.encode("push_ref", request, **self.up.write(frame).fields())

    def close(self) -> None:
        self.down.close()
        self.up.close()


async def _watch_stop(conn: Connection, stop: asyncio.Event) -> None:
    while not conn.poll():
        await asyncio.sleep(0.02)
    conn.recv()
    stop.set()


async def _run_hetd(job: Job, conn: Connection, http: aiohttp.ClientSession) -> Report:
    """The no-compute worker: a push for every ``params`` frame, until ``stop``."""
    report = Report()
    tensors = ready_update(job.shapes, job.codec, job.seed)
    headers = {"Authorization": f"Bearer {job.token}"} if job.token else {}
    stop = asyncio.Event()
    async with http.ws_connect(job.url, headers=headers, max_msg_size=job.cap, compress=0) as ws:
        await ws.send_bytes(_hello(f"bench-{job.seed}", job.codec, job.shm))
        link: _Shm | None = None
        watcher: asyncio.Task[None] | None = None
        request = 0
        push = PushFrame(tensors)
        report.update_bytes = len(push.buffer)
        parts: PartsLinks | None = None  # the pservers' connections, when the welcome names them
        pulls: PullLinks | None = None  # and the ones full releases are pulled over
        sent: dict[int, float] = {}  # request id -> when its push went out
        latencies: list[float] = []  # s from a push's sending to its ack
        chunked_version: int | None = None  # the params message coming in chunks
        chunked_bytes = 0
        version: int | None
        async for frame in ws:
            if frame.type != aiohttp.WSMsgType.BINARY:
                report.error = f"connection ended: {frame.type!r} {ws.close_code}"
                break
            size = len(frame.data)
            head = chunk_head(frame.data)
            if head is not None:  # a piece of a params message over the frame cap
                seq, last, start = head
                if seq == 0:
                    chunked_version = params_version(frame.data[start : start + 256])
                    chunked_bytes = 0
                chunked_bytes += size - start
                if not last or chunked_version is None:
                    continue
                version, size = chunked_version, chunked_bytes
                chunked_version = None
            else:
                version = params_version(frame.data) if size > 4096 else None
            msg = wire.decode(frame.data, job.cap) if version is None else None
            if msg is not None and msg.type == "params":
                version = msg["version"]
            elif msg is not None and msg.type == "params_at" and pulls is not None:
                size_or_none = await pulls.fetch(msg["position"], msg["version"])
                if size_or_none is None:  # no longer held: the newest, named again
                    await ws.send_bytes(wire.encode("pull", 0))
                    continue
                version, size = msg["version"], size_or_none
                report.extra["pulled"] = report.extra.get("pulled", 0) + 1
            elif msg is not None and msg.type == "params_ref" and link is not None:
                version, size = msg["version"], link.params(msg)
            elif msg is not None and msg.type == "shm_offer" and job.shm and link is None:
                link = _Shm(msg["segment"])
                await ws.send_bytes(link.ready())
                continue
            elif msg is not None and msg.type == "welcome" and msg.get("pservers") is not None:
                parts = PartsLinks(
                    PartFrames(msg["pservers"], msg["worker_id"], bytes(push.frame(0, 0)))
                )
                if msg["pservers"].get("headers"):  # the daemon takes the header, no tensors
                    push = PushFrame(msgpack.packb({}))
                await parts.open()
                pulls = PullLinks(parts.frames.addrs)
                await pulls.open()
                continue
            if version is not None:
                if watcher is None:  # the first parameters: joined and released
                    report.connected = 1
                    conn.send(READY)
                    watcher = asyncio.create_task(_watch_stop(conn, stop))
                elif request:
                    report.params_frames += 1
                    report.params_bytes += size
                if stop.is_set():
                    break
                request += 1
                if parts is not None:  # the parts first: the push is decided once they are in
                    await parts.send(request)
                out = push.frame(request, version)
                report.push_frame_bytes = len(out)
                sent[request] = time.perf_counter()
                if link is not None:
                    await ws.send_bytes(link.push(out, request))
                elif len(out) <= job.frame_cap:
                    await ws.send_bytes(cast(bytes, out))  # aiohttp sends any bytes-like as is
                else:
                    for piece in wire.chunks(bytes(out), job.frame_cap):
                        await ws.send_bytes(piece)
                report.pushes += 1
            elif msg is not None and msg.type == "ack":
                report.ack_bytes = len(frame.data)
                report.applied += msg["status"] == "applied"
                began = sent.pop(msg.id, None)
                if began is not None:
                    latencies.append(time.perf_counter() - began)
            elif msg is not None and msg.type == "error":
                report.error = f"{msg['code']}: {msg['message']}"
                break
        # Collect the acks of pushes still in flight, so ``applied`` counts every push.
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(5.0):
                while report.applied < report.pushes and not ws.closed:
                    frame = await ws.receive()
                    if frame.type != aiohttp.WSMsgType.BINARY:
                        break
                    msg = wire.decode(frame.data, job.cap)
                    if msg.type == "ack":
                        report.applied += msg["status"] == "applied"
        if not ws.closed:
            await ws.send_bytes(wire.encode("bye", 0, reason="benchmark cell done"))
        if watcher is not None:
            watcher.cancel()
        if link is not None:
            link.close()
        report.extra["shm"] = link is not None
        report.extra["push_s"] = latencies
        if pulls is not None:
            await pulls.close()
        if parts is not None:
            await parts.close()
            report.extra["parts_held"] = parts.held
            report.error = report.error or parts.error
    return report


async def _run_bare(job: Job, conn: Connection, http: aiohttp.ClientSession) -> Report:
    """The limit: one frame of the push's size, then wait for the server's replies."""
    report = Report(push_frame_bytes=job.push_bytes)
    payload = bytes(job.push_bytes)
    stop = asyncio.Event()
    async with http.ws_connect(job.url, max_msg_size=job.cap, compress=0) as ws:
        report.connected = 1
        conn.send(READY)
        watcher = asyncio.create_task(_watch_stop(conn, stop))
        while not stop.is_set():
            await ws.send_bytes(payload)
            report.pushes += 1
            for _ in range(job.replies):
                frame = await ws.receive()
                if frame.type != aiohttp.WSMsgType.BINARY:
                    report.error = f"connection ended: {frame.type!r}"
                    stop.set()
                    break
                report.params_bytes += len(frame.data)
            report.params_frames += 1
        watcher.cancel()
    return report


async def _hold_one(
    job: Job, index: int, http: aiohttp.ClientSession, stop: asyncio.Event, joined: list[int]
) -> None:
    headers = {"Authorization": f"Bearer {job.token}"} if job.token else {}
    async with http.ws_connect(job.url, headers=headers, max_msg_size=job.cap, compress=0) as ws:
        await ws.send_bytes(_hello(f"idle-{job.seed}-{index}", job.codec))
        beat = wire.encode("heartbeat", 0)
        counted = False
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(job.heartbeat_s):
                    frame = await ws.receive()
                    if frame.type != aiohttp.WSMsgType.BINARY:
                        return
                    if not counted and wire.decode(frame.data, job.cap).type == "params":
                        counted = True
                        joined.append(index)
                    continue
            await ws.send_bytes(beat)
        await ws.send_bytes(wire.encode("bye", 0, reason="benchmark done"))


async def _run_idle(job: Job, conn: Connection, http: aiohttp.ClientSession) -> Report:
    """Hold ``connections`` joined workers that never push; heartbeats keep them alive."""
    stop = asyncio.Event()
    joined: list[int] = []
    holders = [
        asyncio.create_task(_hold_one(job, i, http, stop, joined)) for i in range(job.connections)
    ]
    while len(joined) < job.connections and not all(h.done() for h in holders):
        await asyncio.sleep(0.05)
    conn.send(READY)
    await _watch_stop(conn, stop)
    results = await asyncio.gather(*holders, return_exceptions=True)
    errors = [repr(r) for r in results if isinstance(r, BaseException)]
    return Report(connected=len(joined), error=errors[0] if errors else None)


async def _run(job: Job, conn: Connection) -> Report:
    runner = {"hetd": _run_hetd, "bare": _run_bare, "idle": _run_idle}.get(job.kind)
    if runner is None:
        return Report(error=f"unknown job kind {job.kind!r}")
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as http:
        return await runner(job, conn, http)


def _serve_jobs(conn: Connection) -> None:
    """A peer process: run jobs until the parent sends None."""
    while True:
        job = conn.recv()
        if job is None:
            return
        try:
            report = asyncio.run(_run(job, conn))
        except Exception as exc:  # reported to the parent, which fails the cell with it
            report = Report(error=f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}")
        conn.send(report)


class PeerPool:
    """``count`` peer processes started with ``spawn`` (the parent holds JAX; fork would copy it).

    :meth:`run` hands one job to each of the first ``len(jobs)`` processes, waits until each says it
    is exchanging, lets the caller measure, then stops them and returns their reports.
    """

    def __init__(self, count: int) -> None:
        ctx = mp.get_context("spawn")
        self._conns: list[Connection] = []
        self._procs: list[Any] = []
        for i in range(count):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_serve_jobs, args=(child,), name=f"hetd-bench-peer-{i}")
            proc.daemon = True
            proc.start()
            child.close()
            self._conns.append(parent)
            self._procs.append(proc)

    @property
    def size(self) -> int:
        """Processes in the pool."""
        return len(self._conns)

    async def start(self, jobs: Sequence[Job], timeout: float = 60.0) -> None:
        """Hand out the jobs; return once every peer is exchanging (or raise saying which not)."""
        if len(jobs) > len(self._conns):
            raise ValueError(f"{len(jobs)} jobs for a pool of {len(self._conns)} processes")
        for conn, job in zip(self._conns, jobs, strict=False):
            conn.send(job)
        deadline = time.monotonic() + timeout
        for i, conn in enumerate(self._conns[: len(jobs)]):
            while not conn.poll():
                if time.monotonic() > deadline:
                    raise TimeoutError(f"peer {i} did not start exchanging within {timeout:g} s")
                await asyncio.sleep(0.01)
            msg = conn.recv()
            if isinstance(msg, Report):  # it ended before it was ready
                raise RuntimeError(f"peer {i} failed: {msg.error}")

    async def stop(self, count: int, timeout: float = 60.0) -> list[Report]:
        """Tell the first ``count`` peers to stop; their reports, in order."""
        for conn in self._conns[:count]:
            conn.send(STOP)
        reports = []
        deadline = time.monotonic() + timeout
        for i, conn in enumerate(self._conns[:count]):
            while not conn.poll():
                if time.monotonic() > deadline:
                    raise TimeoutError(f"peer {i} did not stop within {timeout:g} s")
                await asyncio.sleep(0.01)
            reports.append(conn.recv())
        return reports

    def close(self) -> None:
        """End every peer process."""
        for conn in self._conns:
            with contextlib.suppress(OSError, ValueError):
                conn.send(None)
        for proc in self._procs:
            proc.join(5.0)
            if proc.is_alive():
                proc.terminate()
                proc.join(2.0)
        for conn in self._conns:
            conn.close()
