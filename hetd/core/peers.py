"""What the engine is given to talk to the world: a :class:`Clock` to read the time from (the
daemon's wall clock, the simulator's virtual one), one :class:`Peer` per session, its outbox, and
the :class:`FrameSink` a same-host session's frames are packed into."""

from __future__ import annotations

import time
from typing import Protocol

import numpy as np

from hetd.protocol.messages import Reply

__all__ = ["Clock", "FrameSink", "MonotonicClock", "Peer"]


class Clock(Protocol):
    """Where the engine reads the time (seconds)."""

    def now(self) -> float: ...


class MonotonicClock:
    """Wall time for the real daemon."""

    def now(self) -> float:
        return time.monotonic()


class Peer(Protocol):
    """A session's outbox as the engine sees it; nothing here blocks."""

    def send(self, reply: Reply) -> None:
        """Queue a control reply (the peer encodes it, or reads it as it is)."""
        ...

    def send_params(self, frame: bytes | memoryview, *, full: bool) -> None:
        """Queue one encoded ``params`` frame of a release (``full``: it replaces every
        parameter frame still queued)."""
        ...

    def close(self, reason: str) -> None:
        """End the session after what is queued."""
        ...


class FrameSink(Protocol):
    """Where the store packs a snapshot's frame instead of fresh memory (the daemon's same-host
    shared-memory ring, :class:`hetd.server.shm_hub.ShmHub`)."""

    def reserve(self, nbytes: int) -> np.ndarray | None:
        """A writable ``uint8`` buffer of at least ``nbytes`` (None: pack a fresh frame)."""

    def commit(self, buf: np.ndarray, frame: memoryview, version: int) -> None:
        """``frame``, packed into ``buf``, is complete."""
