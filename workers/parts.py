"""A worker's pushes cut into parts for the daemon's pservers (when its welcome names them).

The welcome's ``pservers`` field holds the partition map (:mod:`hetd.pserver.partition`'s plain
value) and where each pserver takes parts. For each push the worker reads its encoded update back
as the daemon's sessions read it (an int8 tensor with one scale stays int8 with that scale, any
other codec is decoded to float32), cuts it by the map (whole tensors, or blocks of rows) and
sends each pserver its part (a ``part`` frame, :mod:`hetd.protocol.pslink`, over TCP), while the
push itself goes to the daemon as before. A part is sent again, over a new connection, until its pserver
answers ``held`` (it is then in the pserver's write-ahead file) or the daemon answers the push
(:meth:`PartsSender.done`): the daemon decides a push only once every pserver holds its part,
and drops it when they do not all come in time.

When the field says ``headers`` (the pservers hold the parameters, the daemon none), the daemon
takes each push's header only: :meth:`PartsSender.send` gives the frame to send it in place of
the push, the same push with no tensors (its parts carry them).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import Mapping
from typing import Any

import numpy as np

from hetd.codecs import registry as codecs
from hetd.codecs.tensor import read_bytes, read_scales, read_shape, size_of
from hetd.protocol import pslink, wire
from hetd.protocol.frames import Push, decode
from hetd.protocol.sockframes import FrameSocket

log = logging.getLogger("hetd.worker")

RETRY_S = (0.1, 2.0)  # a lost pserver connection: the first delay, the longest


PartsError = pslink.MapError  # a welcome's pservers field that cannot be read
Cut = pslink.Cut
Segments = list[bytes | memoryview]  # one frame, written in order
read_map = pslink.read_map
read_info = pslink.read_info


def tensors_of(push: Push, shapes: Mapping[str, tuple[int, ...]]) -> dict[str, list[Any]]:
    """A push's tensors as the link carries them, as the daemon reads them: an int8 tensor with
    one scale as its int8 values and that scale, any other decoded to float32. ``CodecError``
    when they are not the model's."""
    wire_tensors = push.tensors
    out: dict[str, list[Any]] = {}
    if not isinstance(wire_tensors, Mapping) or set(wire_tensors) != set(shapes):
        raise codecs.CodecError("the push's tensors are not the model's")
    rest = {}
    for path, t in wire_tensors.items():
        block = t.get("block") if isinstance(t, Mapping) else None
        if type(block) is int and block == 0 and t.get("codec") == "int8":
            shape = read_shape(t)
            scale = float(np.float32(read_scales(t, "int8", 1)[0]))
            q = np.frombuffer(read_bytes(t, "data", "int8", size_of(shape)), np.int8)
            out[path] = ["int8", q.reshape(shape), scale]
        else:
            rest[path] = t
    for path, arr in codecs.decode_tree(rest, {p: shapes[p] for p in rest}).items():
        out[path] = ["float32", arr, None]
    return out


def cut(
    tensors: Mapping[str, list[Any]], cuts: list[Cut], servers: int
) -> list[dict[str, tuple[np.ndarray, float | None]]]:
    """One slice per pserver, ``key -> (values, scale)`` (float32 values and no scale, or int8
    values and their scale): views of the push's tensors (a block of rows is one)."""
    out: list[dict[str, tuple[np.ndarray, float | None]]] = [{} for _ in range(servers)]
    for key, path, start, stop, whole, server in cuts:
        _, values, scale = tensors[path]
        out[server][key] = (values if whole else values[start:stop], scale)
    return out


class _Conn:
    """One pserver's connection: parts sent in order, each until answered."""

    def __init__(self, server: int, addr: tuple[str, int]) -> None:
        self.server = server
        self.addr = addr
        self.lock = asyncio.Lock()
        self._conn: FrameSocket | None = None

    async def deliver(self, frame: Segments, pid: int) -> None:
        """Send ``frame`` (push ``pid``'s part, as segments) until the pserver answers it."""
        delay = RETRY_S[0]
        async with self.lock:
            while True:
                try:
                    conn = await self._open()
                    await conn.send(*frame)
                    reply = await conn.recv_msg(1 << 16)
                    if reply["t"] == "held" and reply.get("pid") == pid:
                        return
                    log.warning("pserver %d: part of push %d: %r", self.server, pid, reply)
                    return  # refused: sending it again would not help (the daemon drops it)
                except (OSError, asyncio.IncompleteReadError, pslink.FrameError) as exc:
                    self.close()
                    log.info("pserver %d at %s:%d: %s; again", self.server, *self.addr, exc)
                    await asyncio.sleep(delay)
                    delay = min(RETRY_S[1], delay * 2)
                except asyncio.CancelledError:
                    self.close()  # a frame may be half written
                    raise

    async def _open(self) -> FrameSocket:
        if self._conn is None:
            self._conn = await FrameSocket.connect(*self.addr)
        return self._conn

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None


class PartsSender:
    """Sends each push's parts to the pservers; kept across reconnects (the daemon's map and
    the pservers' addresses come with each welcome)."""

    def __init__(self, info: Any) -> None:
        self.pmap, addrs = read_info(info)
        self.shapes, self.cuts, self.servers = read_map(self.pmap)
        self.headers = bool(info.get("headers"))  # the daemon takes each push's header only
        self._conns = [_Conn(s, a) for s, a in enumerate(addrs)]
        self._sending: dict[int, asyncio.Task[None]] = {}
        self.sent = 0  # pushes whose parts all went out

    def update(self, info: Any) -> None:
        """A new welcome's field (the same map; a pserver may have moved)."""
        pmap, addrs = read_info(info)
        if pmap != self.pmap or bool(info.get("headers")) != self.headers:
            raise PartsError(
                "the daemon's partition map, or what it takes of a push, changed: restart "
                "this worker"
            )
        for conn, addr in zip(self._conns, addrs, strict=True):
            if conn.addr != addr:
                conn.close()
                conn.addr = addr

    def frames(self, worker: int, push: bytes) -> tuple[Push, list[Segments]]:
        """The push and one ``part`` frame per pserver, as segments that hold the push's tensors
        uncopied (:func:`hetd.protocol.pslink.part_frame`; CPU work: a thread's)."""
        p = decode(push, max_size=len(push))
        if not isinstance(p, Push):
            raise TypeError(f"a push frame holds a {p.type} message")
        slices = cut(tensors_of(p, self.shapes), self.cuts, self.servers)
        return p, [pslink.part_frame(worker, p.id, s) for s in slices]

    async def send(self, worker: int, push: bytes) -> bytes | None:
        """Cut ``push`` (an encoded push frame) and start sending its parts (in the background:
        until each is held, or :meth:`done`). A push the daemon will refuse (not finite) sends
        none. With ``headers``, the frame to send the daemon in place of ``push`` (None: send
        ``push``)."""
        try:
            p, frames = await asyncio.to_thread(self.frames, worker, push)
        except (wire.ProtocolError, codecs.CodecError) as exc:
            log.info("no parts for a push the daemon will refuse: %s", exc)
            return self._header(push) if self.headers else None
        pid = p.id
        task = asyncio.create_task(self._deliver(pid, frames))
        self._sending[pid] = task
        task.add_done_callback(lambda _t: self._finished(pid, _t))
        return dataclasses.replace(p, tensors={}).encode() if self.headers else None

    @staticmethod
    def _header(push: bytes) -> bytes | None:
        """The header of a push frame that could not be cut (the daemon refuses it, or drops it
        when its parts do not come); None when it is not a push frame at all."""
        try:
            p = decode(push, max_size=len(push))
        except (wire.ProtocolError, TypeError, ValueError):
            return None
        return dataclasses.replace(p, tensors={}).encode() if isinstance(p, Push) else None

    async def _deliver(self, pid: int, frames: list[Segments]) -> None:
        await asyncio.gather(*(c.deliver(f, pid) for c, f in zip(self._conns, frames, strict=True)))
        self.sent += 1

    def _finished(self, pid: int, task: asyncio.Task[None]) -> None:
        if self._sending.get(pid) is task:
            del self._sending[pid]

    def done(self, pid: int) -> None:
        """The daemon answered push ``pid``: its parts need not be sent any more."""
        task = self._sending.pop(pid, None)
        if task is not None:
            task.cancel()

    def pending(self) -> int:
        """Pushes with parts still going out."""
        return len(self._sending)

    async def drain(self, timeout_s: float) -> None:
        """Wait (at most ``timeout_s``) until every push's parts are held: a worker that
        leaves first would leave its last pushes without their parts."""
        tasks = list(self._sending.values())
        if tasks:
            await asyncio.wait(tasks, timeout=timeout_s)

    async def close(self) -> None:
        for task in list(self._sending.values()):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._sending.clear()
        for conn in self._conns:
            conn.close()
