"""Group commit: one fsync of the parts file for the parts that arrive together.

A pserver answers a part ``held`` only once the part is durable (fsynced to its parts file,
:class:`hetd.pserver.disk.PartsFile`), so that a part it reported survives a crash. An fsync per
part made the parts file a pserver's largest cost. Here the part is written at once (on the event
loop, in arrival order) and its sender waits (:meth:`GroupCommit.wait`) for an fsync that began
after the write; the fsync runs in a thread, so the loop meanwhile takes more parts and serves
pulls; the parts written while it runs are covered by the next one, one fsync for all of them.
Durability is unchanged: no part is answered before an fsync that covers it has returned.

One writer: the event loop (the thread only fsyncs a descriptor of its own). An fsync that fails
(a disk error) fails every wait for the parts it was to cover, and each one after it.
"""

from __future__ import annotations

import asyncio
import os

from hetd.pserver.disk import PartsFile


def _fsync(fd: int) -> None:
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class GroupCommit:
    """Fsyncs ``parts`` off the event loop, one at a time, each covering every part written
    before it began."""

    def __init__(self, parts: PartsFile) -> None:
        self.parts = parts
        self.syncs = 0  # fsyncs run (each covering one or more parts)
        self._task: asyncio.Task[None] | None = None
        self._ended: asyncio.Future[None] | None = None  # done when the running fsync returns
        self._error: OSError | None = None

    async def wait(self, upto: int) -> None:
        """Return once part ``upto`` (a :meth:`PartsFile.write` number) is durable; the
        fsync's OSError when it failed."""
        while self.parts.synced < upto:
            if self._error is not None:
                raise self._error
            if self._task is None:
                self._ended = asyncio.get_running_loop().create_future()
                self._task = asyncio.create_task(self._run(), name="hetd-parts-fsync")
            assert self._ended is not None
            await asyncio.shield(self._ended)

    async def _run(self) -> None:
        """Fsync until every part written is durable (the parts written during one fsync are
        covered by the next); each end wakes the waiters."""
        try:
            while self.parts.synced < self.parts.written and not self.parts.closed:
                fd, upto = self.parts.sync_fd()
                try:
                    await asyncio.to_thread(_fsync, fd)
                except OSError as exc:
                    self._error = exc
                    return
                self.syncs += 1
                self.parts.synced = max(self.parts.synced, upto)
                self._wake()
        finally:
            self._task = None
            self._wake()

    def _wake(self) -> None:
        ended = self._ended
        if ended is not None and not ended.done():
            ended.set_result(None)
        self._ended = asyncio.get_running_loop().create_future() if self._task else None
