"""Releases that name a log position: the workers pull the parameters from the pservers.

With pservers the head does not send a worker its full parameters (4 bytes per parameter, copied,
cut into chunks and written by the head's one process); it sends a ``params_at`` frame naming the
version, the log position the release stands at and each slice's hash, and the worker fetches
each slice from its pserver at that position, checks each against its hash and joins them
(:mod:`workers.pulls`). The pservers carry out the same log, so the slices in force at that
position are the version's, cut by the partition map; the map covers every tensor exactly once,
so slices that each match make the whole the version, and the frame carries no whole's hash (one
pass over the model less, on the head and on the worker).

:class:`Pointers` makes that frame once per version, reading the store's parameters in place
(:meth:`hetd.core.store.Store.read`: no snapshot, no copy of the model); the engine's publisher
sends it in place of a full frame (:attr:`hetd.core.publish.Publisher.pointer`) to every worker
that named ``pulls`` and whose frames go over its socket, and builds no full frame for it. Deltas
(lossy codecs) and workers on shared memory still get their frames from the head. A head that
holds no parameters (``[pservers] headers``) names no slice hashes (``hashes`` false): every
release is a pull, and each pserver sends its slice's hash with it.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping

import numpy as np

from hetd.core.store import Store
from hetd.protocol.frames import ParamsAt
from hetd.protocol.params import param_hash
from hetd.pserver.log import DecisionLog
from hetd.pserver.partition import PartitionMap, split


class Pointers:
    """The ``params_at`` frame of the store's current version, made once per version."""

    def __init__(self, pmap: PartitionMap, log: DecisionLog, hashes: bool = True) -> None:
        """``hashes`` false: a head without parameters (``[pservers] headers``) names no slice
        hashes; each pserver's answer carries its own."""
        self.pmap = pmap
        self.log = log
        self.hashes = hashes
        self._lock = threading.Lock()  # (the publisher calls from its thread or the loop)
        self._last: tuple[int, bytes] | None = None
        self.made = 0  # frames made (one per version released to a puller)

    def __call__(self, store: Store) -> bytes:
        """The frame for ``store``'s current version (its queued steps run first): the log's
        position then is one where the slices in force are that version's (a version's
        parameters change only where the store runs its queued steps, which the log records
        before the version is read)."""
        with self._lock:
            last = self._last
            if last is not None and last[0] == store.version and not store.pending:
                return last[1]
            if self.hashes:
                version, frame = store.read(self._frame)
            else:
                store.flush()  # (a header store's queued steps: the log's step entry)
                version = store.version
                frame = ParamsAt(version, self.log.position, ()).encode()
            self._last = (version, frame)
            self.made += 1
            return frame

    def _frame(self, version: int, params: Mapping[str, np.ndarray]) -> tuple[int, bytes]:
        slices = tuple(param_hash(s) for s in split(self.pmap, params))
        return version, ParamsAt(version, self.log.position, slices).encode()
