"""The pservers' frames as both ends write them: what a worker needs to send a push's parts to a
pserver and to pull a slice from one, with nothing of the core (the pserver's side,
:mod:`hetd.pserver.link`, builds on it).

One frame is a 4-byte big-endian length and a msgpack map with a string ``"t"`` (its type). A
part's name inside a slice is its tensor's path, or for a block of rows the path and the rows
(:func:`part_key`). A tensor travels as ``[dtype, shape, bytes]``, an int8 one with its float
scale after them (:func:`tensor_entry`).

Also read here, for both a worker and the head: a welcome's ``pservers`` field, the partition
map's plain value and where each pserver listens (:func:`read_map`, :func:`read_info`, a bad one
:class:`MapError`), and whether parts cover a model exactly once (:func:`uncovered`). A ``slice``
frame may carry its tensors' hash (:func:`slice_frame`); :mod:`hetd.protocol.pulls` pulls and
checks releases with these frames.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Mapping
from typing import Any

import msgpack
import numpy as np

MAX_FRAME = 1 << 30  # bytes in one frame: a part of at most 1 GiB
BLOCK_MARK = "#rows="  # a block's key: f"{path}{BLOCK_MARK}{start}:{stop}"


class FrameError(ValueError):
    """A frame that cannot be read or says something impossible."""


def part_key(path: str, start: int, stop: int, whole: bool) -> str:
    """A part's name inside a slice: the path for a whole tensor, else the path and its rows."""
    return path if whole else f"{path}{BLOCK_MARK}{start}:{stop}"


def read_part_key(key: str) -> tuple[str, tuple[int, int] | None]:
    """:func:`part_key` read back: the tensor's path and, for a block, its rows (None for a
    whole tensor); :class:`FrameError` for a block whose rows are not ``start:stop``."""
    path, mark, rows = key.rpartition(BLOCK_MARK)
    if not mark:
        return key, None
    start, colon, stop = rows.partition(":")
    if not (colon and start.isdigit() and stop.isdigit()):
        raise FrameError(f"a part key with bad rows: {key!r}")
    return path, (int(start), int(stop))


def uncovered(
    shapes: Mapping[str, tuple[int, ...]], parts: Iterable[tuple[str, int, int, bool]]
) -> str | None:
    """The first tensor of ``shapes`` that ``parts`` (path, start, stop, whole; a tensor's parts
    in row order) do not cover exactly once, or a part's tensor ``shapes`` lacks; None when
    each tensor is one whole part or blocks of rows running from 0 to its first dimension with no
    gap and no overlap. What makes slices that each match their hash the whole model (the
    partition map read back, the worker's welcome)."""
    by_path: dict[str, list[tuple[int, int, bool]]] = {}
    for path, start, stop, whole in parts:
        by_path.setdefault(path, []).append((start, stop, whole))
    for path in by_path:
        if path not in shapes:
            return path
    for path, shape in shapes.items():
        ps = by_path.get(path, [])
        rows = shape[0] if shape else 1
        if len(ps) == 1 and ps[0] == (0, rows, True):
            continue
        at = 0
        for start, stop, whole in ps:
            if whole or start != at or stop <= start:
                return path
            at = stop
        if not shape or not ps or at != rows:
            return path
    return None


# --- the welcome's pservers field: the partition map's plain value and the addresses ----------

# a part: (key, path, first row, one past the last, whole tensor, pserver)
Cut = tuple[str, str, int, int, bool, int]


class MapError(ValueError):
    """A welcome's ``pservers`` field (the partition map, the pservers' addresses) that cannot be
    read, or a map that does not cover the model exactly once."""


def read_map(m: Any) -> tuple[dict[str, tuple[int, ...]], list[Cut], int]:
    """A partition map's plain value (:meth:`hetd.pserver.partition.PartitionMap.to_dict`) as the
    tensors' shapes, the parts and the pservers' number (what cutting a push and joining a
    release need; the pservers check each part's key and shape). :class:`MapError` otherwise."""
    try:
        shapes = {str(path): tuple(int(d) for d in shape) for path, shape, _ in m["tensors"]}
        cuts: list[Cut] = []
        for path, start, stop, whole, server in m["parts"]:
            if path not in shapes or not 0 <= start <= stop or not 0 <= server < m["servers"]:
                raise ValueError(f"a bad part of {path!r}")
            cuts.append((part_key(path, start, stop, whole), path, start, stop, whole, server))
        servers = int(m["servers"])
    except (KeyError, TypeError, ValueError) as exc:
        raise MapError(f"the welcome's partition map: {exc!r}") from None
    return shapes, cuts, servers


def read_info(info: Any) -> tuple[Any, list[tuple[str, int]]]:
    """The partition map (its plain value) and the pservers' addresses from a welcome's
    ``pservers`` field ``{map, addrs}``; :class:`MapError` otherwise."""
    if not isinstance(info, Mapping) or not isinstance(info.get("addrs"), list):
        raise MapError("the welcome's pservers field must be {map, addrs}")
    pmap = info.get("map")
    servers = read_map(pmap)[2]
    addrs = []
    for a in info["addrs"]:
        if not (isinstance(a, list) and len(a) == 2 and isinstance(a[0], str)):
            raise MapError(f"a pserver address must be [host, port], got {a!r}")
        if not isinstance(a[1], int) or isinstance(a[1], bool) or not 0 < a[1] <= 65535:
            raise MapError(f"a pserver address must be [host, port], got {a!r}")
        addrs.append((a[0], a[1]))
    if len(addrs) != servers:
        raise MapError(f"{len(addrs)} pserver addresses for a map of {servers}")
    return pmap, addrs


def pack(kind: str, **fields: Any) -> bytes:
    """One frame (length prefix included)."""
    body: bytes = msgpack.packb({"t": kind, **fields}, use_bin_type=True)
    return len(body).to_bytes(4, "big") + body


async def recv(reader: asyncio.StreamReader, max_bytes: int = MAX_FRAME) -> dict[str, Any]:
    """The next frame; :class:`FrameError` when malformed, ``asyncio.IncompleteReadError`` when
    the stream ends."""
    n = int.from_bytes(await reader.readexactly(4), "big")
    if n > max_bytes:
        raise FrameError(f"a frame of {n} bytes, over the limit of {max_bytes}")
    return unpack(await reader.readexactly(n))


def unpack(body: bytes | memoryview) -> dict[str, Any]:
    """A frame's body as a map with a string ``"t"``; :class:`FrameError` otherwise."""
    try:
        msg = msgpack.unpackb(body, raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises several kinds on bad bytes
        raise FrameError(f"not a msgpack frame: {exc!r}") from None
    if not isinstance(msg, dict) or not isinstance(msg.get("t"), str):
        raise FrameError("a frame must be a map with a string 't'")
    return msg


def tensor_entry(values: np.ndarray, scale: float | None = None) -> list[Any]:
    """A tensor as the link carries it: float32 values, or int8 ones with their ``scale``."""
    if scale is not None:
        q = np.asarray(values, np.int8)
        return ["int8", list(q.shape), q.tobytes(), float(scale)]  # C order
    arr = np.asarray(values, np.float32)  # (tobytes() writes C order, a 0-d array too)
    return ["float32", list(arr.shape), arr.tobytes()]


# --- pulls: a release's slice, fetched at a log position --------------------------------------


def slice_frame(
    position: int, version: int, tensors: Mapping[str, np.ndarray], hash: str | None = None
) -> list[bytes | memoryview]:
    """A ``slice {position, version, tensors}`` frame (float32 tensors) as segments to write in
    order: the tensors' bytes are not copied (each must be C-contiguous float32), so a pserver
    writes the release it keeps straight to the socket. ``hash``: the tensors'
    :func:`hetd.protocol.params.param_hash`, sent as the frame's ``hash`` field (a head that
    sees only headers names no slice hashes: the puller checks the slice against this one);
    None leaves the frame as it was without it, byte for byte."""
    for key, arr in tensors.items():
        if arr.dtype != np.float32 or not arr.flags.c_contiguous:
            raise ValueError(f"slice_frame takes C-contiguous float32 tensors, not {key!r}")
    entries = {key: (arr, None) for key, arr in tensors.items()}
    fields: dict[str, Any] = {"position": position, "version": version}
    if hash is not None:
        fields["hash"] = hash
    return frame_segments("slice", fields, entries)


def part_frame(
    worker: int, pid: int, tensors: Mapping[str, tuple[np.ndarray, float | None]]
) -> list[bytes | memoryview]:
    """A ``part {worker, pid, tensors}`` frame as segments, byte for byte what :func:`pack` makes
    of the same fields with :func:`tensor_entry` values (``key -> (values, scale)``: float32, or
    int8 with its scale), without copying a C-contiguous tensor's bytes."""
    return frame_segments("part", {"worker": worker, "pid": pid}, tensors)


def frame_segments(
    kind: str, fields: Mapping[str, Any], tensors: Mapping[str, tuple[np.ndarray, float | None]]
) -> list[bytes | memoryview]:
    """A frame ``{t: kind, **fields, tensors: {key: tensor entry}}`` as segments: a length
    prefix, msgpack's headers and values, and each tensor's bytes as a view (a copy only of a
    tensor that is not C-contiguous or not already of its dtype)."""
    packer = msgpack.Packer(use_bin_type=True)
    head = bytearray(packer.pack_map_header(2 + len(fields)))
    for key, value in (("t", kind), *fields.items()):
        head += packer.pack(key) + packer.pack(value)
    head += packer.pack("tensors") + packer.pack_map_header(len(tensors))
    segments: list[bytes | memoryview] = [b"", bytes(head)]
    size = len(head)
    for key, (values, scale) in tensors.items():
        dtype = np.float32 if scale is None else np.int8
        arr = np.asarray(values, dtype)  # (not ascontiguousarray: it makes a 0-d array 1-d)
        if not arr.flags.c_contiguous:
            arr = arr.copy(order="C")
        data = arr.reshape(-1).data.cast("B")
        entry = packer.pack(key) + packer.pack_array_header(3 if scale is None else 4)
        entry += packer.pack(np.dtype(dtype).name) + packer.pack(list(arr.shape))
        entry += _bin_header(data.nbytes)
        segments += [entry, data]
        size += len(entry) + data.nbytes
        if scale is not None:
            tail = packer.pack(float(scale))
            segments.append(tail)
            size += len(tail)
    if size > MAX_FRAME:
        raise ValueError(f"a {kind} frame of {size} bytes is over the frame limit of {MAX_FRAME}")
    segments[0] = size.to_bytes(4, "big")
    return segments


def read_slice(
    msg: Mapping[str, Any], shapes: Mapping[str, tuple[int, ...]]
) -> dict[str, np.ndarray]:
    """A ``slice`` frame's tensors: float32 of exactly ``shapes`` (the pserver's parts), as
    read-only views of the frame's bytes; :class:`FrameError` for anything else."""
    raw = msg.get("tensors")
    if not isinstance(raw, dict) or set(raw) != set(shapes):
        raise FrameError("a slice's tensors are not the pserver's parts")
    out = {}
    for key, item in raw.items():
        if not isinstance(item, list) or len(item) != 3 or item[0] != "float32":
            raise FrameError(f"slice tensor {key!r} is not a float32 entry")
        shape, data = item[1], item[2]
        if not isinstance(shape, list) or tuple(shape) != tuple(shapes[key]):
            raise FrameError(f"slice tensor {key!r} has shape {shape!r}, not {shapes[key]}")
        if not isinstance(data, bytes) or len(data) != 4 * _count(shapes[key]):
            raise FrameError(f"slice tensor {key!r}: its bytes do not match its shape")
        out[key] = np.frombuffer(data, np.float32).reshape(shapes[key])
    return out


def _bin_header(n: int) -> bytes:
    """msgpack's header of a ``bin`` of ``n`` bytes (the bytes follow it)."""
    if n < 1 << 8:
        return b"\xc4" + n.to_bytes(1, "big")
    if n < 1 << 16:
        return b"\xc5" + n.to_bytes(2, "big")
    return b"\xc6" + n.to_bytes(4, "big")


def _count(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
