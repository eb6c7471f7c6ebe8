"""A no-compute sender's parts for the daemon's pservers (the system bench's ``--pservers``).

With pservers the welcome names the partition map and where each pserver takes parts; a real
worker cuts every push by the map and sends each pserver its part (``workers.parts``). The
no-compute sender pushes one ready-made update again and again, so it cuts that update once, as
a real worker's cut does (the same functions), packs one ``part`` frame per pserver, and only
patches the push id into each (a fixed-width msgpack uint64) before it sends them: a part costs
the sender what sending its bytes costs, as the push itself does.

Each pserver's connection is read in the background: every part is answered ``held`` (it is in
the pserver's write-ahead file); anything else is an error the sender reports. The sender needs
no retry: a push is decided, and the next one sent, only once every pserver holds its part.

A full release that names a log position (``params_at``) is pulled as a real worker pulls it
(``workers.pulls``): one ``pull`` frame to each pserver over a connection of its own, each
``slice`` read whole; as with a ``params`` frame, the sender reads the frames' envelopes, not
their tensors (:class:`PullLinks`).
"""

from __future__ import annotations

import asyncio
import contextlib
import struct
from typing import Any

import msgpack

from hetd.protocol import pslink
from hetd.protocol.frames import Push, decode
from hetd.protocol.pslink import read_info, read_map
from hetd.protocol.sockframes import FrameSocket
from workers.parts import cut, tensors_of


class PartFrames:
    """One ``part`` frame per pserver for a fixed push frame, the push id patched per push."""

    def __init__(self, info: Any, worker: int, push_frame: bytes) -> None:
        pmap, self.addrs = read_info(info)
        shapes, cuts, servers = read_map(pmap)
        push = decode(push_frame, max_size=len(push_frame))
        if not isinstance(push, Push):
            raise TypeError(f"a push frame holds a {push.type} message")
        slices = cut(tensors_of(push, shapes), cuts, servers)
        self.frames: list[bytearray] = []
        self._at: list[int] = []
        for tensors in slices:
            packer = msgpack.Packer(use_bin_type=True)
            head = bytearray(packer.pack_map_header(4))
            for key, value in (("t", "part"), ("worker", worker)):
                head += packer.pack(key) + packer.pack(value)
            head += packer.pack("pid")
            at = len(head) + 1
            head += b"\xcf" + bytes(8)  # msgpack uint64: patched per push
            entries = {k: pslink.tensor_entry(v, scale) for k, (v, scale) in tensors.items()}
            head += packer.pack("tensors") + packer.pack(entries)
            frame = bytearray(len(head).to_bytes(4, "big")) + head
            self.frames.append(frame)
            self._at.append(at + 4)

    def frame(self, server: int, pid: int) -> bytearray:
        """Pserver ``server``'s part of push ``pid`` (the same buffer, patched)."""
        frame = self.frames[server]
        struct.pack_into(">Q", frame, self._at[server], pid)
        return frame


class PartsLinks:
    """The sender's connections to the pservers: parts out, ``held`` counted."""

    def __init__(self, frames: PartFrames) -> None:
        self.frames = frames
        self.held = 0  # parts answered held
        self.error: str | None = None
        self._conns: list[FrameSocket] = []
        self._readers: list[asyncio.Task[None]] = []

    async def open(self) -> None:
        """Connect to every pserver."""
        for host, port in self.frames.addrs:
            conn = await FrameSocket.connect(host, port)
            self._conns.append(conn)
            self._readers.append(asyncio.create_task(self._read(conn)))

    async def _read(self, conn: FrameSocket) -> None:
        with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
            while True:
                reply = await conn.recv_msg(1 << 16)
                if reply["t"] == "held":
                    self.held += 1
                elif self.error is None:
                    self.error = f"a pserver answered a part: {reply!r}"

    async def send(self, pid: int) -> None:
        """Push ``pid``'s part to every pserver (the next push patches the same buffers only
        once this one was decided, which needs every part received)."""
        await asyncio.gather(
            *(conn.send(self.frames.frame(s, pid)) for s, conn in enumerate(self._conns))
        )

    async def close(self) -> None:
        for task in self._readers:
            task.cancel()
        await asyncio.gather(*self._readers, return_exceptions=True)
        for conn in self._conns:
            conn.close()


ENVELOPE = 4096  # bytes of a pull's answer kept: an error's whole frame, a slice's envelope


class PullLinks:
    """The sender's pull connections to the pservers: a release's slices read, their bytes
    counted."""

    def __init__(self, addrs: list[tuple[str, int]]) -> None:
        self.addrs = addrs
        self._conns: list[FrameSocket] = []

    async def open(self) -> None:
        """Connect to every pserver."""
        for host, port in self.addrs:
            self._conns.append(await FrameSocket.connect(host, port))

    async def fetch(self, position: int, version: int) -> int | None:
        """Every slice of the release at ``position``: the bytes read, or None when a pserver
        no longer holds it (the sender asks the daemon again)."""
        frame = pslink.pack("pull", position=position, version=version)
        await asyncio.gather(*(conn.send(frame) for conn in self._conns))
        sizes = await asyncio.gather(*(self._read(conn) for conn in self._conns))
        if any(n is None for n in sizes):
            return None
        return sum(n for n in sizes if n is not None)

    @staticmethod
    async def _read(conn: FrameSocket) -> int | None:
        """One answer: its envelope read, the rest of its bytes read and let go (a slice of a
        big model is not held whole: a sender's memory stays what it was without pservers)."""
        n, head = await conn.skim(ENVELOPE)
        unpacker = msgpack.Unpacker(raw=False, max_buffer_size=ENVELOPE)
        unpacker.feed(head[:64])
        unpacker.read_map_header()
        kind = unpacker.unpack(), unpacker.unpack()
        if kind == ("t", "gone"):
            return None
        if kind != ("t", "slice"):
            what = pslink.unpack(head) if n == len(head) else kind[1]
            raise pslink.FrameError(f"a pserver answered a pull with {what!r}")
        return n

    async def close(self) -> None:
        for conn in self._conns:
            conn.close()
