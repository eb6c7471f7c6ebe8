"""Who runs the pserver processes (``[pservers] backend``): one small interface, two backends.

* ``local`` (:class:`~hetd.server.pserver_sup.LocalPservers`): the daemon spawns S ``hetd pserver``
  processes on this host and restarts one that exits;
* ``ray`` (:class:`~hetd.server.pserver_ray.RayPservers`): S named Ray actors, each running the same
  ``hetd pserver`` command as its child; Ray restarts an actor whose process died.

Either way the daemon starts them once its link listens, reads their state for ``/v1/status``, and
stops them after its final checkpoint. A pserver keeps its slice in its own directory under
``<[store] dir>/pservers/slice<I>`` and takes its old port again when restarted, so the workers'
addresses stay good. Ray is imported by the ray backend's module alone.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol


class PserverProcesses(Protocol):
    """S pserver processes following the head's link: started, watched (one that dies is
    started again at its address), described, stopped."""

    root: Path  # the slices' directories are root/slice<I>

    async def start(self) -> None:
        """Start every pserver (and what watches them); an error says why one cannot start."""

    def describe(self) -> list[dict[str, Any]]:
        """One row per slice: at least ``slice``, ``pid``, ``state`` and ``restarts``."""
        ...

    async def stop(self, timeout: float) -> None:
        """Stop every pserver (they keep their saved slices); a second call does nothing more."""


def make(backend: str, head: tuple[str, int], root: Path, servers: int) -> PserverProcesses:
    """The processes of ``backend`` ("local" or "ray") for ``servers`` slices under ``root``,
    following the head's link at ``head``."""
    if backend == "local":
        from hetd.server.pserver_sup import LocalPservers

        return LocalPservers(head, root, servers)
    if backend == "ray":
        from hetd.server.pserver_ray import RayPservers

        return RayPservers(head, root, servers)
    raise ValueError(f"[pservers] backend = {backend!r} starts no processes")
