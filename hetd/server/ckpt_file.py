"""The checkpoint file format, written and read without whole copies of the state.

A checkpoint is the msgpack map ``{"format": "hetd-checkpoint", "format_version": 1, "state": bytes,
"sha256": hex}``, where ``state`` is the training state in flax's msgpack format
(``flax.serialization.msgpack_serialize``; ``msgpack_restore`` reads it) and ``sha256`` is the hash of
those bytes. A reader takes the map in any key order (older files put ``sha256`` before ``state``).

:func:`write_to` streams the file: the envelope's header, then each array's few header bytes and its
own memory, hashed on the way, then the hash. So writing costs a few small buffers, not the
``tobytes()`` of every array, the packed payload and the envelope around it (three more copies of
the state, which glibc then keeps). :func:`decode` and :func:`verify` find the payload inside the
file's bytes instead of copying it out, and an array is made on the bytes its record was read into:
reading holds the file and one copy of the state. :func:`release_memory` gives freed heap back to
the operating system after either. :class:`CheckpointInfo` names one file written or read.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import dataclasses
import gc
import hashlib
import mmap
import struct
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import msgpack
import numpy as np
from flax import serialization

FORMAT = "hetd-checkpoint"
FORMAT_VERSION = 1

_ND, _COMPLEX, _SCALAR = 1, 2, 3  # flax's msgpack extension codes: ndarray, complex, numpy scalar
_CHUNKED = "__msgpack_chunked_array__"  # flax's form of an array above its chunk size
_CHUNK_BYTES: int = getattr(serialization, "MAX_CHUNK_SIZE", 2**30)
_MAX_BIN = 2**32 - 1  # msgpack's limit for one bin (the payload)


@dataclass(frozen=True, slots=True)
class CheckpointInfo:
    """One written or loaded checkpoint file."""

    path: str
    seq: int
    version: int  # the parameter version it holds
    nbytes: int
    created_unix: float  # s since the epoch (wall clock, for people)

    def to_json(self) -> dict[str, Any]:
        """A plain map for the admin API."""
        return dataclasses.asdict(self)


class CheckpointError(Exception):
    """A checkpoint cannot be read, or does not fit the configured model and optimizer."""


# --- writing ------------------------------------------------------------------------------------------

_packer = msgpack.Packer(use_bin_type=True)


def _array(value: Any) -> np.ndarray:
    arr = np.asarray(value)
    if not arr.flags.c_contiguous:  # (np.ascontiguousarray would make a 0-d array 1-d)
        arr = np.array(arr, order="C")
    if arr.dtype.hasobject or arr.dtype.isalignedstruct:
        raise ValueError("object and structured dtypes cannot go into a checkpoint")
    return arr


def _emit_array(arr: np.ndarray, out: Callable[[Any], None], code: int = _ND) -> None:
    """flax's record of an array (an extension holding ``(shape, dtype name, bytes)``), its bytes
    given as the array's own memory."""
    head = (
        _packer.pack_array_header(3)
        + msgpack.packb(list(arr.shape))
        + msgpack.packb(arr.dtype.name)
        + b"\xc6"
        + struct.pack(">I", arr.nbytes)
    )
    out(b"\xc9" + struct.pack(">Ib", len(head) + arr.nbytes, code) + head)
    out(arr.reshape(-1).view(np.uint8).data)  # the memory itself, as a memoryview


def _chunked(arr: np.ndarray) -> dict[str, Any]:
    """flax's chunked form of an array above its chunk size (views, no copies)."""
    step = max(1, _CHUNK_BYTES // arr.dtype.itemsize)
    flat = arr.reshape(-1)
    return {
        _CHUNKED: True,
        "shape": {str(i): d for i, d in enumerate(arr.shape)},
        "chunks": {str(i): flat[s : s + step] for i, s in enumerate(range(0, flat.size, step))},
    }


def _emit(node: Any, out: Callable[[Any], None], in_dict: bool = True) -> None:
    """Write ``node`` as ``msgpack_serialize`` would (arrays above the chunk size chunked where flax
    chunks them: values of a map, and the root)."""
    if isinstance(node, Mapping):
        out(_packer.pack_map_header(len(node)))
        for key, value in node.items():
            out(msgpack.packb(key))
            _emit(value, out)
    elif isinstance(node, list):
        out(_packer.pack_array_header(len(node)))
        for value in node:
            _emit(value, out, in_dict=False)
    elif hasattr(node, "shape") and hasattr(node, "dtype") and not isinstance(node, np.generic):
        arr = _array(node)
        if in_dict and arr.nbytes > _CHUNK_BYTES:
            _emit(_chunked(arr), out)
        else:
            _emit_array(arr, out)
    elif isinstance(node, np.generic):
        _emit_array(_array(node), out, _SCALAR)
    else:  # plain values (and whatever flax does with anything else)
        out(serialization.msgpack_serialize(node))


def write_to(fh: IO[bytes], state: Mapping[str, Any]) -> int:
    """Write ``state`` as a checkpoint into ``fh``; the number of bytes written."""
    size = 0

    def count(chunk: Any) -> None:
        nonlocal size
        size += memoryview(chunk).nbytes

    _emit(dict(state), count)  # the payload's length goes before it
    if size > _MAX_BIN:
        raise ValueError(f"the state is {size} bytes: a checkpoint holds at most {_MAX_BIN}")
    digest = hashlib.sha256()

    def hashed(chunk: Any) -> None:
        fh.write(chunk)
        digest.update(chunk)

    head = (
        _packer.pack_map_header(4)
        + msgpack.packb("format")
        + msgpack.packb(FORMAT)
        + msgpack.packb("format_version")
        + msgpack.packb(FORMAT_VERSION)
        + msgpack.packb("state")
        + b"\xc6"
        + struct.pack(">I", size)
    )
    fh.write(head)
    _emit(dict(state), hashed)
    tail = msgpack.packb("sha256") + msgpack.packb(digest.hexdigest())
    fh.write(tail)
    return len(head) + size + len(tail)


# --- reading ------------------------------------------------------------------------------------------

_FIXED = {0xCC: ">B", 0xCD: ">H", 0xCE: ">I", 0xCF: ">Q", 0xD0: ">b", 0xD1: ">h", 0xD2: ">i"}
_FIXED |= {0xD3: ">q"}
_SIZED = {0xD9: (">B", 1), 0xDA: (">H", 1), 0xDB: (">I", 1), 0xC4: (">B", 0)}
_SIZED |= {0xC5: (">H", 0), 0xC6: (">I", 0)}  # lead byte -> (length format, 1: str / 0: bin)


def _scalar(buf: memoryview, at: int) -> tuple[Any, int]:
    """One envelope value at ``at`` (a str, int, bool, nil or a bin's span) and where the next
    starts; ValueError for anything else (the envelope then goes through the general reader)."""
    lead = buf[at]
    if lead <= 0x7F or lead >= 0xE0:
        return (lead if lead <= 0x7F else lead - 0x100), at + 1
    if 0xA0 <= lead <= 0xBF:
        n = lead & 0x1F
        return bytes(buf[at + 1 : at + 1 + n]).decode(), at + 1 + n
    if lead in (0xC0, 0xC2, 0xC3):
        return {0xC0: None, 0xC2: False, 0xC3: True}[lead], at + 1
    if lead in _FIXED:
        fmt = _FIXED[lead]
        return struct.unpack_from(fmt, buf, at + 1)[0], at + 1 + struct.calcsize(fmt)
    if lead in _SIZED:
        fmt, is_str = _SIZED[lead]
        start = at + 1 + struct.calcsize(fmt)
        n = struct.unpack_from(fmt, buf, at + 1)[0]
        if start + n > len(buf):
            raise ValueError("truncated")
        return (bytes(buf[start : start + n]).decode() if is_str else (start, n)), start + n
    raise ValueError(f"unexpected msgpack type 0x{lead:02x}")


def _envelope(buf: memoryview) -> dict[str, Any]:
    """The envelope's fields, ``state`` as its ``(offset, length)`` in ``buf``."""
    fields: dict[str, Any] = {}
    try:
        lead = buf[0]
        if not 0x80 <= lead <= 0x8F:
            raise ValueError("not a small map")
        at = 1
        for _ in range(lead & 0x0F):
            key, at = _scalar(buf, at)
            fields[str(key)], at = _scalar(buf, at)
        if at != len(buf) or not isinstance(fields.get("state", ()), tuple):
            raise ValueError("not the envelope we write")
        return fields
    except (ValueError, IndexError, struct.error, UnicodeDecodeError):
        pass  # not the shape we write: the general reader decides (it copies the payload)
    try:
        envelope = msgpack.unpackb(buf, raw=False, strict_map_key=False)
    except Exception as exc:
        raise CheckpointError(f"not a msgpack checkpoint (truncated?): {exc}") from None
    if not isinstance(envelope, dict):
        raise CheckpointError("not a hetd checkpoint (no format marker)")
    return envelope


_HASH_STEP = 64 << 20  # bytes hashed between two page drops


def _checked(buf: memoryview, drop: Callable[[int], None] | None = None) -> memoryview:
    """The payload of a checkpoint whose envelope and hash are right; CheckpointError otherwise.
    ``drop(end)`` is told, as the hash goes, that the bytes before ``end`` are not needed again."""
    envelope = _envelope(buf)
    if envelope.get("format") != FORMAT:
        raise CheckpointError("not a hetd checkpoint (no format marker)")
    if envelope.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(
            f"checkpoint format version {envelope.get('format_version')!r}; "
            f"this hetd reads version {FORMAT_VERSION}"
        )
    span = envelope.get("state")
    if isinstance(span, bytes):  # from the general reader
        payload, start = memoryview(span), None
    elif isinstance(span, tuple):
        start, n = span
        payload = buf[start : start + n]
    else:
        raise CheckpointError("checkpoint has no state payload")
    digest = hashlib.sha256()
    for at in range(0, len(payload), _HASH_STEP):
        digest.update(payload[at : at + _HASH_STEP])
        if drop is not None and start is not None:
            drop(start + at + _HASH_STEP)
    if digest.hexdigest() != envelope.get("sha256"):
        payload.release()  # a mapped file cannot close while a view on it lives
        raise CheckpointError("checksum mismatch: the file is corrupt")
    return payload


def _from_record(data: bytes) -> np.ndarray:
    """An array from flax's ``(shape, dtype name, bytes)`` record, on ``data`` itself."""
    up = msgpack.Unpacker(raw=True)
    up.feed(data[:4096])  # the record's head: shape, dtype name, the bin's header
    if up.read_array_header() != 3:
        raise ValueError("bad array record")
    shape, name = up.unpack(), up.unpack()
    at = up.tell()
    lead = data[at]
    fmt = {0xC4: ">B", 0xC5: ">H", 0xC6: ">I"}[lead]
    n = struct.unpack_from(fmt, data, at + 1)[0]
    start = at + 1 + struct.calcsize(fmt)
    dtype = getattr(serialization, "_dtype_from_name", np.dtype)(name)
    return np.frombuffer(data, dtype, count=n // np.dtype(dtype).itemsize, offset=start).reshape(
        shape
    )


def _ext(code: int, data: bytes) -> Any:
    if code == _ND:
        return _from_record(data)
    if code == _SCALAR:
        return _from_record(data)[()]
    if code == _COMPLEX:
        real, imag = msgpack.unpackb(data)
        return complex(real, imag)
    return msgpack.ExtType(code, data)


def _unchunk(node: Any) -> Any:
    if isinstance(node, dict):
        if _CHUNKED in node:
            shape = tuple(node["shape"][str(i)] for i in range(len(node["shape"])))
            chunks = [node["chunks"][str(i)] for i in range(len(node["chunks"]))]
            return np.concatenate(chunks).reshape(shape)
        for key, value in node.items():
            node[key] = _unchunk(value)
    return node


def decode(data: bytes | bytearray | memoryview | mmap.mmap) -> dict[str, Any]:
    """Checkpoint bytes back to the state tree; :class:`CheckpointError` says what is wrong."""
    with memoryview(data) as buf:
        payload = _checked(buf)
        try:
            state = _unchunk(
                msgpack.unpackb(payload, ext_hook=_ext, raw=False, strict_map_key=False)
            )
        except Exception as exc:
            raise CheckpointError(f"state payload does not decode: {exc}") from None
        finally:
            payload.release()
    if not isinstance(state, dict) or not {"params", "opt_state", "version"} <= set(state):
        raise CheckpointError("state payload lacks params, opt_state or version")
    return state


def _mapped(path: Path, use: Callable[[mmap.mmap], Any]) -> Any:
    with open(path, "rb") as fh:
        try:
            mm = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
        except ValueError:  # an empty file
            raise CheckpointError("empty file") from None
        with mm:
            return use(mm)


def read(path: Path) -> dict[str, Any]:
    """The state tree of the checkpoint file at ``path``, mapped rather than read in: while it
    decodes, the process holds the file's pages (the page cache's, given back when it is unmapped)
    and the arrays, one copy of the state."""
    result: dict[str, Any] = _mapped(path, decode)
    return result


def verify(path: Path) -> None:
    """CheckpointError unless the file at ``path`` is a checkpoint whose hash is right. The state
    is not decoded, and the pages hashed are unmapped as it goes: it costs no memory."""

    def check(mm: mmap.mmap) -> None:
        def drop(end: int) -> None:
            end = min(end, len(mm)) // mmap.PAGESIZE * mmap.PAGESIZE
            if end > 0 and hasattr(mm, "madvise"):
                mm.madvise(mmap.MADV_DONTNEED, 0, end)

        with memoryview(mm) as buf:
            _checked(buf, drop).release()

    _mapped(path, check)


# --- memory -------------------------------------------------------------------------------------------


def _malloc_trim() -> Callable[[int], int] | None:
    try:
        fn = ctypes.CDLL(ctypes.util.find_library("c") or None).malloc_trim
    except (OSError, AttributeError):  # not glibc
        return None
    fn.argtypes, fn.restype = [ctypes.c_size_t], ctypes.c_int
    trim: Callable[[int], int] = fn
    return trim


_TRIM = _malloc_trim()


def release_memory(collect: bool = False) -> bool:
    """Give the heap's free pages back to the operating system (glibc's ``malloc_trim``; the
    daemon's allocator settings otherwise keep up to 4 GiB of them). False where there is none.

    ``collect``: first free what only reference cycles keep (a full ``gc.collect()``: a capture's
    arrays can hang on such a cycle until the collector's next full pass, tens of ms)."""
    if _TRIM is None:
        return False
    if collect:
        gc.collect()
    _TRIM(0)
    return True
