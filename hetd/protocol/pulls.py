"""Full releases pulled from the pservers, checked and joined: what a worker and the head share.

With pservers a release is named by the log position it stands at (the daemon's ``params_at``
frame). :class:`ReleasePuller`, built from a welcome's ``pservers`` field (the partition map's
plain value and the S addresses, :func:`hetd.protocol.pslink.read_info`), asks every pserver at
once for its slice at that position (a ``pull`` frame, over a connection of its own per pserver),
checks each slice and joins the slices by the map (whole tensors, or blocks of rows put back in
order) into the model's float32 tensors. The map covers every tensor exactly once
(:func:`check_cover`), so slices that each match their hash join into the version released.

**What a slice is checked against.** When the caller names one hash per pserver (``slices``: the
daemon computed them from the parameters it holds) each slice is checked against its own; when it
names none (a head that sees only the pushes' headers holds no tensors to hash), against the
``hash`` the pserver's answer carries, which the pserver computed from the tensors it sent (an
answer without one is then a mismatch). The joined whole is checked against ``whole`` when given.
A mismatch raises :class:`SliceMismatch`: never train on, or save, parameters known to be wrong.

A pserver keeps the newest few releases; one it no longer holds (or another version at that
position: the head restarted) is answered ``gone``. That, an answer that is not the slice asked
for, or a pserver unreachable past the puller's timeout make :meth:`ReleasePuller.fetch` return
None: the caller names a newer release. A pserver that is restarting is waited for (until the
timeout): it comes back at the address the puller holds.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from hetd.protocol import pslink
from hetd.protocol.params import param_hash
from hetd.protocol.pslink import Cut
from hetd.protocol.sockframes import FrameSocket

log = logging.getLogger("hetd.pulls")

PULL_TIMEOUT_S = 60.0  # s a release is pulled for before fetch gives up (the caller asks again)
RETRY_S = (0.1, 2.0)  # a lost pserver connection: the first delay, the longest

Slice = dict[str, np.ndarray]  # one pserver's parts, part key -> float32 values


class SliceMismatch(ValueError):
    """A slice, or the joined whole, that is not what the release names."""


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
    doubled. :class:`~hetd.protocol.pslink.MapError` otherwise."""
    path = pslink.uncovered(
        shapes, ((p, start, stop, whole) for _, p, start, stop, whole, _ in cuts)
    )
    if path is not None:
        raise pslink.MapError(f"the welcome's partition map does not cover {path!r} exactly once")


def join(
    slices: Sequence[Mapping[str, np.ndarray]],
    shapes: Mapping[str, tuple[int, ...]],
    cuts: list[Cut],
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
    ) -> tuple[Slice, int, str | None] | None:
        """The slice at ``position``, its frame's size and the hash its answer carries (None
        when it carries none); None when the pserver no longer holds that release, or past
        ``deadline`` (``time.monotonic``)."""
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
                named = reply.get("hash")
                if named is not None and not isinstance(named, str):
                    raise pslink.FrameError("a slice's hash must be a string")
                return pslink.read_slice(reply, shapes), n, named
            except TimeoutError:
                self.close()
                return None
            except pslink.FrameError as exc:  # not a slice of this release: asking again here
                self.close()  # would get the same; the caller names a newer one
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


class ReleasePuller:
    """Pulls releases from the pservers a welcome's ``pservers`` field names.

    ``info``: that field, ``{map, addrs}``; :class:`~hetd.protocol.pslink.MapError` when it
    cannot be read or its map does not cover the model exactly once. ``timeout_s``: how long a
    :meth:`fetch` waits for a pserver (one restarting included) before it returns None. Keep one
    across reconnects (:meth:`update` takes a new welcome's field); :meth:`close` it when done.
    """

    def __init__(self, info: Any, timeout_s: float = PULL_TIMEOUT_S) -> None:
        self.pmap, addrs = pslink.read_info(info)  # the map's plain value
        self.shapes, self.cuts, self.servers = pslink.read_map(self.pmap)
        check_cover(self.shapes, self.cuts)
        self.slice_shapes = slice_shapes(self.shapes, self.cuts, self.servers)
        self.timeout_s = timeout_s
        self._conns = [_Conn(s, a) for s, a in enumerate(addrs)]

    @property
    def addrs(self) -> list[tuple[str, int]]:
        """Where each pserver is pulled from."""
        return [c.addr for c in self._conns]

    def update(self, info: Any) -> None:
        """A new welcome's field (a pserver may have moved; the map is the same model's)."""
        _, addrs = pslink.read_info(info)
        for conn, addr in zip(self._conns, addrs, strict=True):
            if conn.addr != addr:
                conn.close()
                conn.addr = addr

    async def fetch(
        self, version: int, position: int, slices: Sequence[str], whole: str | None
    ) -> tuple[dict[str, np.ndarray], int] | None:
        """Release ``version`` at log ``position``: the model's tensors (path -> float32 array
        of its shape, joined from every pserver's slice, pulled at once) and the bytes read;
        None when a pserver no longer holds it (or did not answer in time). Each slice is checked
        against ``slices[i]`` when ``slices`` names one hash per pserver, else against the hash
        its answer carries; the whole against ``whole`` when given. :class:`SliceMismatch` when
        one is not what it should be (or ``slices`` names another number of pservers)."""
        if slices and len(slices) != self.servers:
            raise SliceMismatch(f"{len(slices)} slice hashes for {self.servers} pservers")
        deadline = time.monotonic() + self.timeout_s
        got = await asyncio.gather(
            *(c.pull(position, version, self.slice_shapes[c.server], deadline) for c in self._conns)
        )
        pulled = [g for g in got if g is not None]
        if len(pulled) != len(got):
            return None
        wants = list(slices) if slices else [g[2] for g in pulled]
        tensors = await asyncio.to_thread(
            self._check, position, [g[0] for g in pulled], wants, whole
        )
        return tensors, sum(g[1] for g in pulled)

    def _check(
        self,
        position: int,
        slices: list[Slice],
        wants: Sequence[str | None],
        whole: str | None,
    ) -> dict[str, np.ndarray]:
        for server, (tensors, want) in enumerate(zip(slices, wants, strict=True)):
            if want is None:
                raise SliceMismatch(
                    f"pserver {server}'s slice at position {position} carries no hash, and the "
                    "release names none to check it against"
                )
            if param_hash(tensors) != want:
                raise SliceMismatch(f"pserver {server}'s slice at position {position}")
        tensors = join(slices, self.shapes, self.cuts)
        if whole is not None and param_hash(tensors) != whole:
            raise SliceMismatch(f"the slices joined at position {position}")
        return tensors

    def close(self) -> None:
        """Close every pserver connection (a later :meth:`fetch` opens them again)."""
        for conn in self._conns:
            conn.close()
