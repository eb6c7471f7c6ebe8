"""Decoding a frame with its big byte strings copied into 64-byte-aligned buffers.

:func:`hetd.protocol.wire.decode` (msgpack) copies each tensor's bytes into a fresh ``bytes``,
whose data sits 16 bytes off a 64-byte boundary. JAX takes a host array without a copy only when
it is so aligned, so each such tensor was copied twice: by msgpack, then into XLA when the step ran
(at 5.8M parameters ≈ 6–10 ms of CPU per frame here, against nothing for an aligned one).
:func:`decode_aligned` walks the frame itself and copies every ``bin`` of
:data:`hetd.protocol.wire.ZERO_COPY_MIN` bytes or more once, into an aligned buffer, handed on as
a read-only ``memoryview``; every other value (a key, a string, a number, a small ``bin``) is
unpacked by msgpack from its own bytes, with :func:`~hetd.protocol.wire.decode`'s limits, and the
message is validated by the same :func:`~hetd.protocol.wire.validate`. Same fields, same errors
(:class:`~hetd.protocol.wire.ProtocolError`), one copy fewer. Used where a big frame is read from
shared memory (a worker's parameters, the daemon's pushes).
"""

from __future__ import annotations

import struct
from typing import Any, Final

import msgpack
import numpy as np

from hetd.protocol import wire

ALIGN: Final = 64  # bytes: what XLA's CPU client needs to use a host buffer as it is
MAX_DEPTH: Final = 64  # nesting of maps and arrays (the protocol's messages use 4)
MAX_LEN: Final = 1 << 20  # entries of one map or array, as wire.decode allows

# first byte -> (header bytes, how the length follows: "" fixed, else a struct code)
_BIN = {0xC4: (2, ">B"), 0xC5: (3, ">H"), 0xC6: (5, ">I")}
_STR = {0xD9: (2, ">B"), 0xDA: (3, ">H"), 0xDB: (5, ">I")}
_FIXED = {0xC0: 1, 0xC2: 1, 0xC3: 1, 0xCA: 5, 0xCB: 9, 0xCC: 2, 0xCD: 3, 0xCE: 5, 0xCF: 9}
_FIXED |= {0xD0: 2, 0xD1: 3, 0xD2: 5, 0xD3: 9}
_ARRAY = {0xDC: (3, ">H"), 0xDD: (5, ">I")}
_MAP = {0xDE: (3, ">H"), 0xDF: (5, ">I")}


def aligned_copy(data: memoryview) -> memoryview:
    """``data``'s bytes in a fresh buffer starting on an :data:`ALIGN`-byte boundary, read-only."""
    n = data.nbytes
    raw = np.empty(n + ALIGN, np.uint8)
    start = -raw.ctypes.data % ALIGN
    out = raw[start : start + n]
    out[:] = np.frombuffer(data, np.uint8, n)
    out.flags.writeable = False
    return out.data


def decode_aligned(
    frame: bytes | bytearray | memoryview, max_size: int = wire.DEFAULT_MAX_FRAME
) -> wire.Message:
    """:func:`hetd.protocol.wire.decode`, with big ``bin`` values aligned (see the module)."""
    size = frame.nbytes if isinstance(frame, memoryview) else len(frame)
    if size > max_size:
        raise wire.ProtocolError("too_large", f"frame of {size} bytes exceeds the {max_size} cap")
    view = memoryview(frame).cast("B") if isinstance(frame, memoryview) else memoryview(frame)
    try:
        walker = _Walker(view, max_size)
        raw, end = walker.item(0, 0)
        if end != size:
            raise ValueError(f"{size - end} bytes of extra data after the message")
    except wire.ProtocolError:
        raise
    except Exception as exc:  # truncated, a reserved or extension type, a bad leaf
        raise wire.ProtocolError("malformed", f"frame is not valid msgpack: {exc}") from None
    if not isinstance(raw, dict):
        raise wire.ProtocolError("malformed", f"frame must be a map, got {type(raw).__name__}")
    return wire.validate(raw)


class _Walker:
    """One frame's walk: :meth:`item` returns a value and where the next one starts."""

    def __init__(self, buf: memoryview, max_size: int) -> None:
        self.buf = buf
        self.max_size = max_size

    def leaf(self, start: int, end: int) -> Any:
        if end > len(self.buf):
            raise ValueError("truncated")
        return msgpack.unpackb(
            self.buf[start:end],
            raw=False,
            max_bin_len=self.max_size,
            max_str_len=1 << 20,
            max_array_len=0,
            max_map_len=0,
            max_ext_len=0,
        )

    def length(self, pos: int, head: tuple[int, str]) -> tuple[int, int]:
        n_head, code = head
        (n,) = struct.unpack_from(code, self.buf, pos + 1)
        return n_head, int(n)

    def item(self, pos: int, depth: int) -> tuple[Any, int]:
        b = self.buf[pos]
        if b <= 0x7F or b >= 0xE0:  # fixint
            return self.leaf(pos, pos + 1), pos + 1
        if b in _FIXED:
            end = pos + _FIXED[b]
            return self.leaf(pos, end), end
        if 0xA0 <= b <= 0xBF or b in _STR:
            n_head, n = (1, b & 0x1F) if b <= 0xBF else self.length(pos, _STR[b])
            end = pos + n_head + n
            return self.leaf(pos, end), end
        if b in _BIN:
            n_head, n = self.length(pos, _BIN[b])
            start, end = pos + n_head, pos + n_head + n
            if end > len(self.buf):
                raise ValueError("truncated")
            if n >= wire.ZERO_COPY_MIN:
                return aligned_copy(self.buf[start:end]), end
            return bytes(self.buf[start:end]), end
        if 0x80 <= b <= 0x8F or b in _MAP:
            n_head, n = (1, b & 0x0F) if b <= 0x8F else self.length(pos, _MAP[b])
            return self.entries(pos + n_head, n, depth, is_map=True)
        if 0x90 <= b <= 0x9F or b in _ARRAY:
            n_head, n = (1, b & 0x0F) if b <= 0x9F else self.length(pos, _ARRAY[b])
            return self.entries(pos + n_head, n, depth, is_map=False)
        raise ValueError(f"type byte 0x{b:02x} is not allowed")  # 0xc1, extension types

    def entries(self, pos: int, n: int, depth: int, is_map: bool) -> tuple[Any, int]:
        if depth >= MAX_DEPTH:
            raise ValueError("nested too deep")
        if n > MAX_LEN:
            raise ValueError(f"{n} entries exceed the {MAX_LEN} allowed")
        if not is_map:
            items = []
            for _ in range(n):
                value, pos = self.item(pos, depth + 1)
                items.append(value)
            return items, pos
        out: dict[Any, Any] = {}
        for _ in range(n):
            key, pos = self.item(pos, depth + 1)
            if not isinstance(key, str | bytes):
                raise ValueError(f"{type(key).__name__} is not allowed for map key")
            value, pos = self.item(pos, depth + 1)
            out[key] = value
        return out, pos
