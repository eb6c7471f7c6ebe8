"""A worker's full releases pulled from the daemon's pservers (a ``params_at`` frame).

With pservers the daemon answers a push (or a pull) that needs the full parameters with a
``params_at`` frame: the version, the log position it stands at and each pserver's slice hash.
The worker asks each pserver for its slice at that position (a ``pull`` frame,
:mod:`hetd.protocol.pslink`, over a connection of its own beside the parts'), checks each slice
against its hash and joins the slices by the partition map (whole tensors, or blocks of rows put
back in order). The map covers every tensor exactly once (:func:`check_cover` checks
it), so slices that each match their hash join into the version the daemon released: one version,
checked, as a full ``params`` frame's hash checks it. (A frame that also names the whole's
``hash``, which this release's daemon no longer sends, has the joined whole checked against it.)

A pserver keeps the newest few releases; one it no longer holds (or another version at that
position: the daemon restarted) is answered ``gone``. That, an answer that is not the slice
asked for, or a pserver unreachable past :data:`PULL_TIMEOUT_S` make :meth:`Puller.fetch` return
None, and the worker asks the daemon for the newest parameters again (a ``pull``), which names a
newer position. A pserver that is restarting is waited for: it comes back at the address the
worker holds.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping
from typing import Any

import numpy as np

from hetd.protocol import pslink
from hetd.protocol.frames import ParamsAt
from hetd.protocol.params import Held, param_hash
from hetd.protocol.sockframes import FrameSocket
from workers.parts import Cut, PartsError, read_info, read_map

log = logging.getLogger("hetd.worker")

PULL_TIMEOUT_S = 60.0  # s a release is pulled for before the worker asks the daemon again
RETRY_S = (0.1, 2.0)  # a lost pserver connection: the first delay, the longest


class SliceMismatch(ValueError):
    """A slice, or the joined whole, that is not what the daemon's release names."""


def slice_shapes(
    shapes: Mapping[str, tuple[int, ...]], cuts: list[Cut], servers: int
) -> list[dict[str, tuple[int, ...]]]:
    """Each pserver's parts, ``key -> shape``."""
    out: list[dict[str, tuple[int, ...]]] = [{} for _ in range(servers)]
    for key, path, start, stop, whole, server in cuts:
        shape = shapes[path]
        out[server][key] = shape if whole else (stop - start, *shape[1:])
    return out


def check_cover(shapes: Mapping[str, tuple[int, ...]], cuts: list[Cut]) -> None:
    """That the parts cover every tensor exactly once (:func:`hetd.protocol.pslink.uncovered`),
    so slices that each match their hash join into the whole version, with nothing left out or
    doubled. :class:`~workers.parts.PartsError` otherwise."""
    path = pslink.uncovered(
        shapes, ((p, start, stop, whole) for _, p, start, stop, whole, _ in cuts)
    )
    if path is not None:
        raise PartsError(f"the welcome's partition map does not cover {path!r} exactly once")


def join(
    slices: list[dict[str, np.ndarray]], shapes: Mapping[str, tuple[int, ...]], cuts: list[Cut]
) -> dict[str, np.ndarray]:
    """The slices put back into the model's tensors (a whole tensor as it came; blocks copied
    into their tensor in row order)."""
    blocks: dict[str, list[tuple[int, np.ndarray]]] = {}
    out: dict[str, np.ndarray] = {}
    for key, path, start, _stop, whole, server in cuts:
        if whole:
            out[path] = slices[server][key]
        else:
            blocks.setdefault(path, []).append((start, slices[server][key]))
    for path, rows in blocks.items():
        rows.sort(key=lambda r: r[0])
        out[path] = np.concatenate([r for _, r in rows], axis=0).reshape(shapes[path])
    return out


class _Conn:
    """One pserver's pull connection (one request at a time)."""

    def __init__(self, server: int, addr: tuple[str, int]) -> None:
        self.server = server
        self.addr = addr
        self._conn: FrameSocket | None = None

    async def pull(
        self, position: int, version: int, shapes: Mapping[str, tuple[int, ...]], deadline: float
    ) -> tuple[dict[str, np.ndarray], int] | None:
        """The slice at ``position`` and its frame's size; None when the pserver no longer holds
        that release, or past ``deadline`` (``time.monotonic``)."""
        delay = RETRY_S[0]
        frame = pslink.pack("pull", position=position, version=version)
        while True:
            try:
                if self._conn is None:
                    self._conn = await FrameSocket.connect(*self.addr)
                conn = self._conn
                await conn.send(frame)
                left = max(0.1, deadline - time.monotonic())
                async with asyncio.timeout(left):
                    body = await conn.recv()  # (this connection's buffer: read before the next)
                n = body.nbytes
                reply = await asyncio.to_thread(pslink.unpack, body)
                if reply["t"] == "gone":
                    return None
                if reply["t"] != "slice":
                    log.warning("pserver %d answered a pull with %r", self.server, reply["t"])
                    return None
                if reply.get("position") != position or reply.get("version") != version:
                    raise pslink.FrameError("a slice of another position or version")
                return pslink.read_slice(reply, shapes), n
            except TimeoutError:
                self.close()
                return None
            except pslink.FrameError as exc:  # not a slice of this release: asking again here
                self.close()  # would get the same; the daemon names a newer one
                log.warning("pserver %d: a pull at position %d: %s", self.server, position, exc)
                return None
            except (OSError, asyncio.IncompleteReadError) as exc:
                self.close()
                if time.monotonic() + delay > deadline:
                    log.info("pserver %d: no slice at position %d: %s", self.server, position, exc)
                    return None
                log.info("pserver %d at %s:%d: %s; again", self.server, *self.addr, exc)
                await asyncio.sleep(delay)
                delay = min(RETRY_S[1], delay * 2)
            except asyncio.CancelledError:
                self.close()  # a reply may be half read
                raise

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None


class Puller:
    """Pulls releases from the pservers a welcome names; kept across reconnects."""

    def __init__(self, info: Any) -> None:
        self.pmap, addrs = read_info(info)
        self.shapes, self.cuts, self.servers = read_map(self.pmap)
        check_cover(self.shapes, self.cuts)
        self.slice_shapes = slice_shapes(self.shapes, self.cuts, self.servers)
        self._conns = [_Conn(s, a) for s, a in enumerate(addrs)]
        self.pulled = 0  # releases pulled and checked
        self.gone = 0  # releases no longer held (asked of the daemon again)

    def update(self, info: Any) -> None:
        """A new welcome's field (a pserver may have moved)."""
        _, addrs = read_info(info)
        for conn, addr in zip(self._conns, addrs, strict=True):
            if conn.addr != addr:
                conn.close()
                conn.addr = addr

    async def fetch(self, msg: ParamsAt) -> tuple[Held, int] | None:
        """The release ``msg`` names, checked, and the bytes it took; None when a pserver no
        longer holds it (ask the daemon again). :class:`SliceMismatch` when a slice (or the
        whole, where ``msg`` names its hash) is not what ``msg`` names."""
        if len(msg.slices) != self.servers:
            raise SliceMismatch(f"{len(msg.slices)} slice hashes for {self.servers} pservers")
        deadline = time.monotonic() + PULL_TIMEOUT_S
        got = await asyncio.gather(
            *(
                c.pull(msg.position, msg.version, self.slice_shapes[c.server], deadline)
                for c in self._conns
            )
        )
        if any(g is None for g in got):
            self.gone += 1
            return None
        slices = [g[0] for g in got if g is not None]
        size = sum(g[1] for g in got if g is not None)
        held = await asyncio.to_thread(self._check, msg, slices)
        self.pulled += 1
        return held, size

    def _check(self, msg: ParamsAt, slices: list[dict[str, np.ndarray]]) -> Held:
        for server, (tensors, want) in enumerate(zip(slices, msg.slices, strict=True)):
            if param_hash(tensors) != want:
                raise SliceMismatch(f"pserver {server}'s slice at position {msg.position}")
        tensors = join(slices, self.shapes, self.cuts)
        if msg.hash is not None and param_hash(tensors) != msg.hash:
            raise SliceMismatch(f"the slices joined at position {msg.position}")
        return Held(msg.version, tensors)

    def close(self) -> None:
        for conn in self._conns:
            conn.close()
