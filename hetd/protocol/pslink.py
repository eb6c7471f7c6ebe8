"""The pservers' frames as both ends write them: what a worker needs to send a push's parts to a
pserver, with nothing of the core (the pserver's side, :mod:`hetd.pserver.link`, builds on it).

One frame is a 4-byte big-endian length and a msgpack map with a string ``"t"`` (its type). A
part's name inside a slice is its tensor's path, or for a block of rows the path and the rows
(:func:`part_key`). A tensor travels as ``[dtype, shape, bytes]``, an int8 one with its float
scale after them (:func:`tensor_entry`).
"""

from __future__ import annotations

import asyncio
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


def unpack(body: bytes) -> dict[str, Any]:
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
