"""The engine's queue of commands, a part of :class:`hetd.core.engine.Engine` (:class:`CommandQueue`).

Sessions, timers and the admin API put :mod:`~hetd.core.commands` on it from the event loop; the
engine task takes them in batches of up to :data:`BATCH` (what is queued when it looks), runs each
through the engine's handler and then publishes once for the whole batch. Each command's wait in
the queue and its run time go to the :class:`~hetd.core.rates.Meters`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any

from hetd.core import commands as cmd
from hetd.core.rates import Meters

log = logging.getLogger("hetd.core.engine")  # one logger for the engine and its parts

BATCH = 64  # commands at most taken before one publish


class CommandQueue:
    """Commands stamped with the time they were queued."""

    def __init__(self, meters: Meters) -> None:
        self.meters = meters
        self._queue: asyncio.Queue[tuple[float, cmd.Command]] = asyncio.Queue()

    def submit(self, command: cmd.Command) -> None:
        """Queue a command for the engine task."""
        self._queue.put_nowait((time.perf_counter(), command))

    async def call(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` on the engine task and return its result (or raise its error)."""
        done: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self.submit(cmd.Call(fn, done))
        return await done

    async def run_batch(self, handle: Callable[[cmd.Command], Any]) -> None:
        """Wait for a command, then run it and whatever else is already queued (up to
        :data:`BATCH`) through ``handle``; a command that fails is logged, the rest go on."""
        m = self.meters
        item = await self._queue.get()
        for taken in range(1, BATCH + 1):
            queued_at, command = item
            start = time.perf_counter()
            m.wait.add(start - queued_at)
            try:
                handle(command)
            except Exception:  # a bug in one command must not stop training
                log.exception("engine command %s failed", type(command).__name__)
            m.latency.add(time.perf_counter() - start)
            if taken == BATCH or self._queue.empty():
                return
            item = self._queue.get_nowait()

    async def tick_every(self, seconds: float) -> None:
        """Queue a :class:`~hetd.core.commands.Tick` every ``seconds`` until cancelled."""
        while True:
            await asyncio.sleep(seconds)
            self.submit(cmd.Tick())

    @contextlib.asynccontextmanager
    async def ticking(
        self, seconds: float, *feeds: Coroutine[Any, Any, None]
    ) -> AsyncIterator[None]:
        """While the block runs, :meth:`tick_every` ``seconds`` and the other ``feeds`` (coroutines
        that queue commands on timers of their own) run as tasks; cancelled and awaited after."""
        tasks = [asyncio.create_task(c) for c in (self.tick_every(seconds), *feeds)]
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
