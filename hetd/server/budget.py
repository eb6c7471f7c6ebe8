"""A bound on the pushes the daemon decodes at once, and on their bytes: decoding a frame of
nested arrays takes several times its size in memory, and every session could otherwise decode in
its own thread at the same time. A session waits for room before it decodes a big frame (and reads
nothing more from its socket meanwhile); one frame alone always gets room, however big."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

__all__ = ["DecodeBudget"]


class DecodeBudget:
    """At most ``max_decodes`` decodes at once, holding at most ``max_bytes`` of frames."""

    def __init__(self, max_decodes: int, max_bytes: int) -> None:
        self.max_decodes = max_decodes
        self.max_bytes = max_bytes
        self.running = 0
        self.bytes = 0
        self.held = 0  # decodes given room, since start
        self.waited = 0  # of them, those that had to wait for it
        self._room = asyncio.Condition()

    def _fits(self, nbytes: int) -> bool:
        if self.running == 0:
            return True  # one alone always fits: a frame is capped by max_frame_bytes already
        return self.running < self.max_decodes and self.bytes + nbytes <= self.max_bytes

    @contextlib.asynccontextmanager
    async def hold(self, nbytes: int) -> AsyncIterator[None]:
        """Room for one decode of ``nbytes`` of frames while the block runs."""
        async with self._room:
            if not self._fits(nbytes):
                self.waited += 1
                await self._room.wait_for(lambda: self._fits(nbytes))
            self.running += 1
            self.bytes += nbytes
            self.held += 1
        try:
            yield
        finally:
            async with self._room:
                self.running -= 1
                self.bytes -= nbytes
                self._room.notify_all()
