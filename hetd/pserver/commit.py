"""Group commit: the parts file written and fsynced in a thread, one fsync for the parts that
arrive together.

A pserver answers a part ``held`` only once the part is durable (written to its parts file,
:class:`hetd.pserver.disk.PartsFile`, and fsynced), so that a part it reported survives a crash.
Writing a large part into the page cache takes longer than anything else a pserver does with
it, so the event loop only hands the part over (:meth:`GroupCommit.submit`: the part as it came
off the socket, no copy) and its sender waits (:meth:`GroupCommit.wait`). One thread, the file's
only writer, takes the parts handed over in arrival order, writes them, fsyncs once and then
wakes their senders; the parts handed over meanwhile are the next batch, covered by the next
fsync. The loop meanwhile takes more parts and serves pulls. Durability is unchanged: no part is
answered before an fsync that covers its write has returned.

A write or an fsync that fails (a disk error) fails every wait for the parts not yet durable,
and each part handed over after it.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections import deque
from typing import Any

from hetd.pserver.disk import PartsFile


class GroupCommit:
    """Writes and fsyncs ``parts`` in a thread of its own, in the order the parts came."""

    def __init__(self, parts: PartsFile) -> None:
        self.parts = parts
        self.syncs = 0  # fsyncs run (each covering one or more parts)
        self.submitted = 0  # parts handed over (numbered 1, 2, ... in arrival order)
        self.durable = 0  # the last of them written and fsynced (as the event loop knows it)
        self._queue: deque[tuple[int, int, int, Any]] = deque()
        self._cond = threading.Condition()
        self._closing = False
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._changed: asyncio.Future[None] | None = None  # done at the next wake
        self._error: BaseException | None = None

    def submit(self, worker: int, pid: int, raw: Any) -> int:
        """Hand a part (its tensors as the link carries them; not to be changed after) to the
        writer; its number, for :meth:`wait`. Called on the event loop. The writer's OSError
        when an earlier write or fsync failed."""
        if self._error is not None:
            raise self._error
        if self._thread is None:
            self._loop = asyncio.get_running_loop()
            self._thread = threading.Thread(target=self._write, name="hetd-parts", daemon=True)
            self._thread.start()
        self.submitted += 1
        with self._cond:
            self._queue.append((self.submitted, worker, pid, raw))
            self._cond.notify()
        return self.submitted

    async def wait(self, upto: int) -> None:
        """Return once part ``upto`` (a :meth:`submit` number) is written and fsynced; the
        writer's OSError when it failed first."""
        while self.durable < upto:
            if self._error is not None:
                raise self._error
            if self._changed is None:
                self._changed = asyncio.get_running_loop().create_future()
            await asyncio.shield(self._changed)

    def close(self) -> None:
        """Write and fsync what was handed over, stop the thread and close the file (a waiter
        then finds its part durable)."""
        with self._cond:
            self._closing = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join()
        self.parts.close()

    # --- the writer thread ------------------------------------------------------------------

    def _write(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closing:
                    self._cond.wait()
                batch = list(self._queue)
                self._queue.clear()
            if not batch:
                return  # closing, nothing left
            try:
                for _, worker, pid, raw in batch:
                    self.parts.write_raw(worker, pid, raw)
                if self.parts.sync():
                    self.syncs += 1
            except (OSError, ValueError) as exc:  # (ValueError: the file closed under it)
                self._post(0, exc if isinstance(exc, OSError) else OSError(str(exc)))
                return
            self._post(batch[-1][0], None)

    def _post(self, upto: int, error: BaseException | None) -> None:
        loop = self._loop
        assert loop is not None
        with contextlib.suppress(RuntimeError):  # the loop closed: nobody waits
            loop.call_soon_threadsafe(self._wake, upto, error)

    def _wake(self, upto: int, error: BaseException | None) -> None:
        self.durable = max(self.durable, upto)
        if error is not None:
            self._error = error
        changed, self._changed = self._changed, None
        if changed is not None and not changed.done():
            changed.set_result(None)
