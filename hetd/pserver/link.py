"""The pservers' link: length-prefixed msgpack frames over a stream, and tensors inside them.

One frame is a 4-byte big-endian length and a msgpack map with a string ``"t"`` (its type). The
head's side and the pserver's side speak it over TCP on loopback (:mod:`hetd.server.pserver_link`,
:mod:`hetd.server.pserver_proc`); a worker (:mod:`workers.parts`) sends a push's parts to a pserver with it. Frames:

* pserver -> head: ``hello {server, position, epoch, parts}`` (the log position its slice stands
  at, the head's life it followed, and the ``[host, port]`` it takes parts on, which the head
  hands its workers), then ``durable {position}`` each time it saved its slice and ``have
  {worker, pid}`` for each part it holds (on each new connection, every one it holds), with
  ``sq`` and ``bytes`` (the part's squared norm and its values' bytes) for a head of headers;
* head -> pserver: ``welcome {map, optimizer, outer, combine, step_each, epoch, start, base,
  headers}`` (the partition map, the optimizer specs, the store's modes, this head's life and the
  position its log began at, the slice's initial tensors for a pserver with none saved, and
  ``headers`` when the head takes push headers only and holds no parameters), then
  ``records {items}`` (:func:`hetd.pserver.log.to_dict` values, in position order), or ``error
  {message}``;
* pusher -> pserver: ``part {worker, pid, tensors}`` (answered ``held {worker, pid, new}`` once the
  part is in the write-ahead file), ``fetch {position}`` (answered ``slice {position, version,
  tensors}`` once the slice stands at or past that position) and ``pull {position, version}`` (a
  worker's pull of a release the head named: answered ``slice`` with the release in force at
  exactly that position once the slice got there, with its ``hash`` for a head of headers, or
  ``gone {position}`` when it no longer keeps it or its version differs); any may be answered
  ``error``.

Everything read is checked as strictly as the workers' wire: a frame over the size limit, a
value of the wrong type, a tensor whose bytes do not match its dtype and shape raise
:class:`LinkError`, which closes that connection only.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from hetd.core.store import Int8
from hetd.protocol import pslink

DTYPES = ("float32", "int8")  # what a tensor on the link may be

# The frames themselves are the protocol's (a worker writes them too): a LinkError is a FrameError.
LinkError = pslink.FrameError
MAX_FRAME = pslink.MAX_FRAME
pack = pslink.pack
recv = pslink.recv
unpack = pslink.unpack


async def send(writer: asyncio.StreamWriter, kind: str, **fields: Any) -> None:
    """Write one frame and wait until the transport takes it."""
    writer.write(pack(kind, **fields))
    await writer.drain()


def field(msg: Mapping[str, Any], name: str, kind: type | tuple[type, ...]) -> Any:
    """``msg[name]``, checked to be of ``kind`` (a bool is not an int here)."""
    value = msg.get(name)
    if not isinstance(value, kind) or (isinstance(value, bool) and bool not in _tuple(kind)):
        raise LinkError(f"frame {msg.get('t')!r}: field {name!r} is missing or of a wrong type")
    return value


def _tuple(kind: type | tuple[type, ...]) -> tuple[type, ...]:
    return kind if isinstance(kind, tuple) else (kind,)


# --- tensors ----------------------------------------------------------------------------------


def encode_tensors(tensors: Mapping[str, Any]) -> dict[str, list[Any]]:
    """``key -> [dtype, shape, bytes(, scale)]``: float32 arrays and :class:`Int8` updates."""
    out: dict[str, list[Any]] = {}
    for key, value in tensors.items():
        if isinstance(value, Int8):
            out[key] = pslink.tensor_entry(value.q, float(value.scale))
        else:
            out[key] = pslink.tensor_entry(value)
    return out


def decode_tensors(
    raw: Any, shapes: Mapping[str, tuple[int, ...]] | None = None
) -> dict[str, np.ndarray | Int8]:
    """:func:`encode_tensors`'s value back; with ``shapes``, its keys and shapes must be those.
    The arrays are read-only views of the frame's bytes (no copy)."""
    if not isinstance(raw, dict):
        raise LinkError("tensors must be a map")
    if shapes is not None and set(raw) != set(shapes):
        raise LinkError(f"tensors {sorted(raw)[:3]}... are not the expected parts")
    out: dict[str, np.ndarray | Int8] = {}
    for key, item in raw.items():
        if not isinstance(key, str) or not isinstance(item, list) or len(item) not in (3, 4):
            raise LinkError(f"tensor {key!r} is malformed")
        dtype, shape, data = item[:3]
        if dtype not in DTYPES or not isinstance(data, bytes) or not isinstance(shape, list):
            raise LinkError(f"tensor {key!r}: a bad dtype, shape or data")
        if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
            raise LinkError(f"tensor {key!r}: a bad shape {shape!r}")
        if shapes is not None and tuple(shape) != tuple(shapes[key]):
            raise LinkError(f"tensor {key!r} has shape {shape}, expected {shapes[key]}")
        itemsize = np.dtype(dtype).itemsize
        if len(data) != itemsize * math.prod(shape):
            raise LinkError(f"tensor {key!r}: {len(data)} bytes for shape {shape} of {dtype}")
        arr = np.frombuffer(data, dtype).reshape(shape)
        if dtype == "int8":
            if len(item) != 4 or not isinstance(item[3], float):
                raise LinkError(f"tensor {key!r}: an int8 tensor needs its float scale")
            scale = np.float32(item[3])
            if not (math.isfinite(scale) and scale >= 0 and math.isfinite(scale * 128)):
                raise LinkError(f"tensor {key!r}: a bad int8 scale {item[3]!r}")
            out[key] = Int8(arr, scale)
        else:
            if len(item) != 3:
                raise LinkError(f"tensor {key!r}: a float32 tensor has no scale")
            out[key] = arr
    return out
