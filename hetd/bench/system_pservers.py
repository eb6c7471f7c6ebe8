"""The system bench's ``--pservers`` axis: the daemon alone (S = 1) or with S pserver processes.

A :class:`Variant` is one way of serving a cell: ``Variant(1, "none")`` is today's daemon, which
applies every update itself; ``Variant(S, backend)`` with S >= 2 is a daemon whose S pservers
(started by ``backend``, "local" or "ray") each hold a slice and replay its decision log, the
senders sending each pserver its part of every push (:mod:`hetd.bench.system_parts`). Every
variant of a cell runs side by side, windows alternated, against the same senders.

:func:`start_served` starts one made by :func:`hetd.bench.system.serve` (its pservers connected
before it returns), :func:`stop_served` stops it and removes its state directory; :func:`pserver_cpu_s` reads the CPU its pserver
processes used so far, so a row can say what the pservers cost per update beside the head.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from hetd.server.daemon import Daemon

BACKENDS = ("local", "ray")
READY_S = 600.0  # s for the pservers to start and connect (JAX imports, a big model's slices)


HEADS = ("whole", "headers")  # what the daemon takes of each push (S >= 2)


class Variant(NamedTuple):
    """S pservers behind the daemon, started by ``backend`` (S = 1: none, the daemon alone);
    ``headers``: the daemon takes each push's header only and holds no parameters."""

    servers: int
    backend: str
    headers: bool = False

    def label(self) -> str:
        if self.servers == 1:
            return "1"
        return f"{self.servers} {self.backend}" + (" headers" if self.headers else "")


def variants(
    servers: Sequence[int], backends: Sequence[str], heads: Sequence[str] = ("whole",)
) -> list[Variant]:
    """One variant per S, and per backend and head for each S >= 2, in the order given."""
    out: list[Variant] = []
    for s in servers:
        if s == 1:
            out.append(Variant(1, "none"))
        else:
            out += [Variant(s, b, h == "headers") for b in backends for h in heads]
    return list(dict.fromkeys(out))


@dataclass
class Served:
    """A started daemon of one variant, and its state directory (S >= 2)."""

    variant: Variant
    daemon: Daemon
    state: Path | None


def state_dir(v: Variant) -> Path | None:
    """A new state directory for a daemon of variant ``v`` (its pservers' slices), or None."""
    return Path(tempfile.mkdtemp(prefix="hetd-bench-ps-")) if v.servers > 1 else None


async def start_served(served: Served) -> None:
    """Start the daemon; return once its pservers are connected (stopped again if it fails)."""
    if served.variant.backend == "ray":
        from hetd.server.pserver_ray import connect, load_ray

        connect(load_ray())  # a Ray instance on this host, kept for the rest of the run
    daemon = served.daemon
    try:
        await daemon.start()
        if daemon.pservers is not None:
            await asyncio.wait_for(daemon.pservers.ready.wait(), READY_S)
    except BaseException:
        await stop_served(served)
        raise


async def stop_served(served: Served) -> None:
    """Stop the daemon (and its pservers), remove its state directory."""
    try:
        await served.daemon.stop(final_checkpoint=False)
    finally:
        if served.state is not None:
            shutil.rmtree(served.state, ignore_errors=True)


def pserver_cpu_s(daemon: Daemon) -> float:
    """CPU seconds used so far by the daemon's pserver processes (and their children: a Ray
    actor runs the pserver as its child); 0 without pservers or off Linux."""
    procs = daemon.pserver_procs
    if procs is None:
        return 0.0
    total = 0.0
    for row in procs.describe():
        pid = row.get("pid")
        if isinstance(pid, int) and pid > 0:
            for p in (pid, *_children(pid)):
                total += _cpu_s(p)
    return total


def _children(pid: int) -> list[int]:
    with contextlib.suppress(OSError, ValueError):
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
        return [int(x) for x in text.split()]
    return []


def _cpu_s(pid: int) -> float:
    """A process's user + system CPU seconds (``/proc/<pid>/stat``); 0 when unreadable."""
    with contextlib.suppress(OSError, ValueError, IndexError):
        stat = Path(f"/proc/{pid}/stat").read_text()
        fields = stat[stat.rindex(")") + 2 :].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return 0.0
