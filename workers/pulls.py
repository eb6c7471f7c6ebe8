"""A worker's full releases pulled from the daemon's pservers (a ``params_at`` frame).

With pservers the daemon answers a push (or a pull) that needs the full parameters with a
``params_at`` frame: the version, the log position it stands at and, from a daemon that holds the
parameters, each pserver's slice hash. The pulling itself is the protocol's
(:class:`hetd.protocol.pulls.ReleasePuller`, which the head uses too): every pserver asked at
once for its slice at that position, each slice checked against the hash the frame names (or,
when it names none, against the hash the pserver's answer carries), the slices joined by the
partition map into the version released, and the whole checked against the frame's ``hash``
where it names one. What is the worker's is here: the frame read as a :class:`Held` release, a
welcome's map refused as :class:`~workers.parts.PartsError` (the worker leaves: retrying would
not help), and the counts of releases pulled and of those no longer held.

A pserver keeps the newest few releases; one it no longer holds (or another version at that
position: the daemon restarted) is answered ``gone``. That, an answer that is not the slice
asked for, or a pserver unreachable past :data:`PULL_TIMEOUT_S` make :meth:`Puller.fetch` return
None, and the worker asks the daemon for the newest parameters again (a ``pull``), which names a
newer position. A slice that is not what the release names raises :class:`SliceMismatch`.
"""

from __future__ import annotations

from typing import Any

from hetd.protocol.frames import ParamsAt
from hetd.protocol.params import Held
from hetd.protocol.pulls import (
    PULL_TIMEOUT_S,
    RETRY_S,
    ReleasePuller,
    SliceMismatch,
    check_cover,
    join,
    slice_shapes,
)

__all__ = [
    "PULL_TIMEOUT_S",
    "RETRY_S",
    "Puller",
    "SliceMismatch",
    "check_cover",
    "join",
    "slice_shapes",
]


class Puller:
    """Pulls releases from the pservers a welcome names; kept across reconnects."""

    def __init__(self, info: Any) -> None:
        # (a field that cannot be read raises pslink.MapError, workers.parts.PartsError: the
        # daemon's own field, so retrying will not help)
        self.releases = ReleasePuller(info, PULL_TIMEOUT_S)
        self.pmap = self.releases.pmap
        self.shapes = self.releases.shapes
        self.cuts = self.releases.cuts
        self.servers = self.releases.servers
        self.slice_shapes = self.releases.slice_shapes
        self.pulled = 0  # releases pulled and checked
        self.gone = 0  # releases no longer held (asked of the daemon again)

    def update(self, info: Any) -> None:
        """A new welcome's field (a pserver may have moved)."""
        self.releases.update(info)

    async def fetch(self, msg: ParamsAt) -> tuple[Held, int] | None:
        """The release ``msg`` names, checked, and the bytes it took; None when a pserver no
        longer holds it (ask the daemon again). :class:`SliceMismatch` when a slice (or the
        whole, where ``msg`` names its hash) is not what ``msg`` names."""
        got = await self.releases.fetch(msg.version, msg.position, msg.slices, msg.hash)
        if got is None:
            self.gone += 1
            return None
        self.pulled += 1
        tensors, size = got
        return Held(msg.version, tensors), size

    def close(self) -> None:
        """Close the pservers' connections."""
        self.releases.close()
