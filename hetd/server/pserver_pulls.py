"""Releases that name a log position: the workers pull the parameters from the pservers.

With pservers the head does not send a worker its full parameters (4 bytes per parameter, copied,
cut into chunks and written by the head's one process); it sends a ``params_at`` frame naming the
version, the log position the release stands at, each slice's hash and the whole's, and the
worker fetches each slice from its pserver at that position (:mod:`workers.pulls`). The pservers
carry out the same log, so the slices in force at that position are the snapshot's, cut by the
partition map. :class:`Pointers` makes that frame once per version; the engine's publisher sends
it in place of a full frame (:attr:`hetd.core.publish.Publisher.pointer`) to every worker that
named ``pulls`` and whose frames go over its socket. Deltas (lossy codecs) and workers on shared
memory still get their frames from the head.
"""

from __future__ import annotations

import threading

from hetd.core.store import Snapshot
from hetd.protocol.frames import ParamsAt
from hetd.protocol.params import param_hash
from hetd.pserver.log import DecisionLog
from hetd.pserver.partition import PartitionMap, split


class Pointers:
    """The ``params_at`` frame of a snapshot, made once per version."""

    def __init__(self, pmap: PartitionMap, log: DecisionLog) -> None:
        self.pmap = pmap
        self.log = log
        self._lock = threading.Lock()  # (the publisher calls from its thread or the loop)
        self._last: tuple[int, bytes] | None = None

    def __call__(self, snap: Snapshot) -> bytes:
        """The frame for ``snap``, the store's current snapshot: the log's position now is one
        where the slices in force are the snapshot's (a version's parameters change only where
        the store ran its queued steps, which the log records before the version is read)."""
        with self._lock:
            last = self._last
            if last is not None and last[0] == snap.version:
                return last[1]
            slices = tuple(param_hash(s) for s in split(self.pmap, snap.tensors))
            frame = ParamsAt(snap.version, self.log.position, slices, snap.hash).encode()
            self._last = (snap.version, frame)
            return frame
