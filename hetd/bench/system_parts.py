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
"""

from __future__ import annotations

import asyncio
import contextlib
import struct
from typing import Any

import msgpack

from hetd.protocol import pslink
from hetd.protocol.frames import Push, decode
from workers.parts import cut, read_info, read_map, tensors_of


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
            head += packer.pack("tensors") + packer.pack(tensors)
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
        self._writers: list[asyncio.StreamWriter] = []
        self._readers: list[asyncio.Task[None]] = []

    async def open(self) -> None:
        """Connect to every pserver."""
        for host, port in self.frames.addrs:
            reader, writer = await asyncio.open_connection(host, port)
            self._writers.append(writer)
            self._readers.append(asyncio.create_task(self._read(reader)))

    async def _read(self, reader: asyncio.StreamReader) -> None:
        with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
            while True:
                reply = await pslink.recv(reader, 1 << 16)
                if reply["t"] == "held":
                    self.held += 1
                elif self.error is None:
                    self.error = f"a pserver answered a part: {reply!r}"

    async def send(self, pid: int) -> None:
        """Push ``pid``'s part to every pserver (the next push patches the same buffers only
        once this one was decided, which needs every part received)."""
        for server, writer in enumerate(self._writers):
            writer.write(self.frames.frame(server, pid))
        for writer in self._writers:
            await writer.drain()

    async def close(self) -> None:
        for task in self._readers:
            task.cancel()
        for writer in self._writers:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()
