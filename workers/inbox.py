"""The hand-off between a worker's reader task and its compute loop."""

from __future__ import annotations

import asyncio

from hetd.protocol.messages import ProfileRequest
from hetd.protocol.params import Held
from workers.errors import FatalError
from workers.shm import ShmLink


class Stopped(Exception):
    """The worker was asked to stop (SIGTERM): it sends what it computed, says bye and exits."""


class Inbox:
    """What the reader task hands the compute loop: the newest parameters and how many pushes are
    still unanswered. A worker computes when it has parameters and at most ``depth`` pushes in
    flight (0, or 1 when its plan says ``pipeline``: the next step overlaps the last push)."""

    def __init__(self) -> None:
        self.params: Held | None = None
        self.in_flight = 0
        self.changed = asyncio.Event()
        self.joined = asyncio.Event()  # the welcome arrived: heartbeats start
        self.welcomed = asyncio.Event()  # ... and the trainer is built
        self.profile: ProfileRequest | None = None  # a pending ``profile`` request
        self.closed: BaseException | None = None
        self.pushes: set[int] = set()  # request ids of pushes the daemon has not answered
        self.resent: set[int] = set()  # ... of earlier sessions' pushes sent again (not in flight)
        self.shm: ShmLink | None = None  # shared memory with a same-host daemon, once agreed
        self.rejected_in_a_row = 0  # pushes the daemon refused with ``error`` since one went in
        self.staged = False  # a pipeline stage is assigned: only replica steps run
        self.pong = asyncio.Event()  # a websocket pong arrived (a link round trip, see link_rtt)
        self.stopping = False  # asked to stop: no step starts any more

    def stop(self) -> None:
        """Start no more steps: :meth:`take` raises :class:`Stopped` from now on."""
        self.stopping = True
        self.changed.set()

    def deliver(self, held: Held) -> None:
        """New parameters arrived."""
        self.params = held
        self.in_flight = max(0, self.in_flight - 1)
        self.changed.set()

    def unpipeline(self) -> None:
        """The plan stopped pipelining. A pipelined worker computes on while its pushes wait, so
        it may count two unanswered where the daemon, which answers each wait for parameters with
        one release however many pushes came in it, owes it one or none; waiting for all of them
        now would wait forever (a hot swap from hps to any policy did). So the next step starts
        from the parameters held, and every release after it answers one push again."""
        self.in_flight = 0
        self.changed.set()

    def answered(self, push_id: int, status: str = "applied") -> None:
        """The daemon acknowledged push ``push_id`` (applied, buffered, dropped or duplicate). No
        parameters follow a ``duplicate`` of a push in flight: the next step may start."""
        if push_id in self.pushes and status == "duplicate":
            self.in_flight = max(0, self.in_flight - 1)
            self.changed.set()
        self.pushes.discard(push_id)
        self.resent.discard(push_id)
        self.rejected_in_a_row = 0

    def refused(self, push_id: int) -> bool:
        """The daemon refused push ``push_id`` with an ``error``: nothing of it counts and no
        parameters follow, so the next step starts from the parameters held. False when the id
        is no push of ours in flight."""
        if push_id in self.resent:  # sent again after a reconnect: never counted in flight
            self.resent.discard(push_id)
            self.rejected_in_a_row += 1
            return True
        if push_id not in self.pushes:
            return False
        self.pushes.discard(push_id)
        self.in_flight = max(0, self.in_flight - 1)
        self.rejected_in_a_row += 1
        self.changed.set()
        return True

    async def take(self, depth: int) -> Held:
        """Wait until a step may start; the parameters to start it from."""
        while True:
            if self.stopping:
                raise Stopped
            if isinstance(self.closed, FatalError):
                raise self.closed
            if self.closed is not None:
                raise ConnectionError(f"daemon connection ended: {self.closed}")
            if self.params is not None and self.in_flight <= depth and not self.staged:
                return self.params
            self.changed.clear()
            await self.changed.wait()
