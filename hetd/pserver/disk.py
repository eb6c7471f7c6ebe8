"""A pserver's state directory: its saved slices and the write-ahead file of the parts it holds.

* **Saved slices** — ``slice-<position>.msgpack``, one per ``checkpoint`` entry the pserver carried
  out (the newest :data:`KEEP` are kept): the slice's tensors, its optimizer state's leaves, the
  store version, the log position, the buffered groups, each worker's last consumed push id, the
  outer optimizer's spec, the entry's name (a later ``restore`` entry names it) and the head's
  life (epoch) it followed. Written to a temporary file, fsynced, renamed, the directory fsynced:
  a crash leaves the old file or the new one, never half of one.
* **The parts file** — ``parts.wal``: every part the pserver took, appended and fsynced before it
  answers ``held`` (so a part it reported is never lost; written from the bytes that came off
  the socket, in a thread, and the parts that arrive while one batch is written share the next
  fsync, :mod:`hetd.pserver.commit`). Replayed at a restart, it gives back the
  parts of the pushes logged after the saved slice, including those consumed since; after each
  saved slice it is rewritten with only the parts of pushes the slice has not consumed. A torn
  record at its end (a crash mid-append) is dropped: its part was never reported held.

Records and files are msgpack (tensors as :func:`hetd.pserver.link.encode_tensors` has them).
"""

from __future__ import annotations

import contextlib
import os
import re
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import msgpack
import numpy as np

from hetd.core.store import Tensors
from hetd.protocol import wire
from hetd.pserver.link import LinkError, decode_tensors, encode_tensors
from hetd.pserver.slice import SliceSaved

KEEP = 3  # saved slices kept (a restore entry names a recent one)
WAL = "parts.wal"
_SPLIT = 1 << 12  # bytes values at least this long are written as they are, not copied
_SLICE = re.compile(r"^slice-(\d{12})\.msgpack$")


class DiskError(RuntimeError):
    """A saved slice that cannot be read."""


@dataclass(frozen=True, slots=True)
class Saved:
    """A saved slice as read back, with what the pserver needs beside it."""

    slice: SliceSaved  # the optimizer state as a list of leaves (see :func:`load`)
    ref: str  # the checkpoint entry's name
    epoch: str  # the head's life it followed


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _arrays(tree: Mapping[str, Any]) -> dict[str, list[Any]]:
    return encode_tensors({k: np.asarray(v, np.float32) for k, v in tree.items()})


def _leaf(x: Any) -> list[Any]:
    arr = np.array(x, order="C")  # (np.ascontiguousarray would make a 0-d array 1-d)
    return [arr.dtype.name, list(arr.shape), arr.tobytes()]


def _unleaf(item: Any) -> np.ndarray:
    dtype, shape, data = item
    return np.frombuffer(data, np.dtype(dtype)).reshape(shape).copy()


def save(directory: Path, saved: SliceSaved, *, ref: str, epoch: str) -> Path:
    """Write ``saved`` durably as ``slice-<position>``; the oldest past :data:`KEEP` go."""
    directory.mkdir(parents=True, exist_ok=True)
    body = {
        "format": 1,
        "params": _arrays(saved.params),
        "opt_state": [_leaf(x) for x in jax.tree.leaves(saved.opt_state)],
        "version": saved.version,
        "position": saved.position,
        "buffers": [
            [g, b["count"], dict(b["weights"]), {k: _arrays(s) for k, s in b["sums"].items()}]
            for g, b in saved.buffers.items()
        ],
        "done": [[w, p] for w, p in saved.done.items()],
        "ref": ref,
        "outer": saved.outer,
        "epoch": epoch,
    }
    path = directory / f"slice-{saved.position:012d}.msgpack"
    _write_atomic(path, msgpack.packb(body, use_bin_type=True))
    for old in listing(directory)[KEEP:]:
        with contextlib.suppress(OSError):
            old.unlink()
    return path


def listing(directory: Path) -> list[Path]:
    """The saved slices, newest (highest position) first."""
    if not directory.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in directory.iterdir() if (m := _SLICE.match(p.name))]
    return [p for _, p in sorted(found, reverse=True)]


def load(path: Path) -> Saved:
    """A saved slice; its ``opt_state`` is the list of leaves, for the caller to put into its
    optimizer's structure (``jax.tree.unflatten``). :class:`DiskError` when unreadable."""
    try:
        body = msgpack.unpackb(path.read_bytes(), raw=False, strict_map_key=False)
        buffers: dict[int, Mapping[str, Any]] = {
            int(g): {
                "count": int(count),
                "weights": {str(k): float(v) for k, v in weights.items()},
                "sums": {str(kind): dict(decode_tensors(s)) for kind, s in sums.items()},
            }
            for g, count, weights, sums in body["buffers"]
        }
        params = {k: np.array(v) for k, v in decode_tensors(body["params"]).items()}
        saved = SliceSaved(
            params,
            [_unleaf(x) for x in body["opt_state"]],
            int(body["version"]),
            int(body["position"]),
            buffers,
            {int(w): int(p) for w, p in body["done"]},
            str(body["outer"]),
        )
        return Saved(saved, str(body["ref"]), str(body["epoch"]))
    except (OSError, KeyError, TypeError, ValueError, LinkError) as exc:
        raise DiskError(f"{path}: not a saved slice ({exc!r})") from None


def find(directory: Path, ref: str) -> Saved | None:
    """The kept saved slice named ``ref`` (a restore entry's), or None."""
    for path in listing(directory):
        with contextlib.suppress(DiskError):
            saved = load(path)
            if saved.ref == ref:
                return saved
    return None


# --- the parts file ---------------------------------------------------------------------------


def record(worker: int, pid: int, raw: Any) -> list[bytes | bytearray | memoryview]:
    """A part's record (length prefix first) as segments to write in order: exactly
    ``msgpack.packb([worker, pid, raw])`` with its length, but each large ``bytes`` value of
    ``raw`` (a tensor's data as it came off the socket) a segment of its own, not copied."""
    parts = wire.pack_value([worker, pid, raw], _SPLIT)
    return [parts.nbytes.to_bytes(4, "big"), *parts.segments]


class PartsFile:
    """``parts.wal``: parts appended, and made durable (fsynced) before they are reported held.

    Each part written gets a number (1, 2, ...; :attr:`written` the last); :attr:`synced` is the
    last one an fsync (or a rewrite) covers. :meth:`append` writes and fsyncs in one go;
    :meth:`write_raw` and :meth:`sync` are what :class:`hetd.pserver.commit.GroupCommit`'s thread
    calls to write the parts that arrive together and cover them with one fsync. A lock keeps a
    record whole against a rewrite (:meth:`keep`) or a close from the event loop."""

    def __init__(self, directory: Path, sync: bool = True) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.path = directory / WAL
        self.sync_each = sync
        self.written = 0  # the last part written (a count since this object was made)
        self.synced = 0  # the last part durable
        self._lock = threading.Lock()
        self._fh = open(self.path, "ab")  # noqa: SIM115 (held open for appends)
        if sync:  # parts a crashed process wrote and never saw fsynced: durable before reported
            os.fsync(self._fh.fileno())

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` ran."""
        return self._fh.closed

    def write_raw(self, worker: int, pid: int, raw: Any) -> int:
        """Append a part given as the link carries it (:func:`record`; handed to the kernel,
        not fsynced; with ``sync`` off, counted durable); its number."""
        with self._lock:
            for segment in record(worker, pid, raw):
                self._fh.write(segment)
            self._fh.flush()
            self.written += 1
            if not self.sync_each:
                self.synced = self.written
            return self.written

    def write(self, worker: int, pid: int, tensors: Tensors) -> int:
        """:meth:`write_raw` of decoded tensors."""
        return self.write_raw(worker, pid, encode_tensors(tensors))

    def append(self, worker: int, pid: int, tensors: Tensors) -> None:
        """Append a part and fsync it here (when ``sync``)."""
        self.write(worker, pid, tensors)
        self.sync()

    def sync(self) -> bool:
        """Fsync the parts written so far (a file descriptor of its own, outside the lock: a
        rewrite meanwhile fsyncs them itself); whether an fsync ran."""
        with self._lock:
            if self.synced >= self.written or self._fh.closed:
                return False
            fd, upto = os.dup(self._fh.fileno()), self.written
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        with self._lock:
            self.synced = max(self.synced, upto)
        return True

    def read(self) -> Iterator[tuple[int, int, Any]]:
        """The records in order, ``(worker, pid, encoded tensors)``; a torn tail ends it."""
        return read_parts(self.path)

    def keep(self, done: Mapping[int, int]) -> int:
        """Rewrite the file with only the parts of pushes after ``done`` (worker -> the last
        push id a saved slice consumed); the number of parts kept. The new file is fsynced, so
        every part written so far is durable."""
        with self._lock:
            kept = [(w, p, t) for w, p, t in self.read() if p > done.get(w, -1)]
            data = bytearray()
            for w, p, t in kept:
                body = msgpack.packb([w, p, t], use_bin_type=True)
                data += len(body).to_bytes(4, "big") + body
            self._fh.close()
            _write_atomic(self.path, bytes(data))
            self._fh = open(self.path, "ab")  # noqa: SIM115
            self.synced = self.written
            return len(kept)

    def close(self) -> None:
        """Close the file; a part written and not yet covered is fsynced first (its waiters then
        find it durable)."""
        with self._lock:
            if self._fh.closed:
                return
            if self.synced < self.written:
                self._fh.flush()
                os.fsync(self._fh.fileno())
                self.synced = self.written
            self._fh.close()


def read_parts(path: Path) -> Iterator[tuple[int, int, Any]]:
    """The parts file's records; stops at the first torn or malformed one."""
    if not path.exists():
        return
    data = path.read_bytes()
    at = 0
    while at + 4 <= len(data):
        n = int.from_bytes(data[at : at + 4], "big")
        if at + 4 + n > len(data):
            return  # torn: a crash mid-append; that part was never reported held
        try:
            worker, pid, tensors = msgpack.unpackb(data[at + 4 : at + 4 + n], raw=False)
        except (ValueError, TypeError, msgpack.UnpackException):
            return
        yield int(worker), int(pid), tensors
        at += 4 + n
