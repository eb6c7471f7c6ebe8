"""Parameters a worker holds, and how a ``params`` frame changes them.

Owns :class:`Held` and :func:`apply_params`, shared by the real worker (``workers.receive``) and the
emulated one (:mod:`hetd.sim.agent`): a full frame replaces what is held; a delta frame adds to the
version it names, and only to that one. :func:`param_hash` is the short hash (XXH3, 64 bits) of a parameter set that
the daemon puts in each full ``params`` frame (field ``hash``) and a worker checks after a full pull;
:func:`full_frame` packs that frame once per version, the snapshot's tensors living in it
(:func:`full_frame_into`: in a shared-memory slot).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import msgpack
import numpy as np
import xxhash

from hetd.codecs import registry as codecs
from hetd.protocol import wire

HASH_BYTES = 8  # XXH3's 64 bits


class Params(Protocol):
    """What is read here of a ``params`` message (:class:`hetd.protocol.frames.Params`, decoded
    by the frames layer above this one): parameters are applied and checked without it."""

    @property
    def version(self) -> int: ...
    @property
    def full(self) -> bool: ...
    @property
    def tensors(self) -> Mapping[str, Mapping[str, Any]]: ...
    @property
    def base(self) -> int | None: ...
    @property
    def hash(self) -> str | None: ...


def param_hash(tensors: Mapping[str, np.ndarray]) -> str:
    """XXH3-64 (16 hex digits) over the parameters as float32, in sorted path order; each tensor's
    path and shape are hashed with its bytes, so a renamed or reshaped tensor differs too. The
    daemon computes it once per published version; a worker after a full pull. It guards against
    accidents (a wrong base, a torn or mixed-up frame, a bug), not an attacker: TLS does that. So
    a fast non-cryptographic hash: ~0.1 ms per 1M parameters here, where SHA-256 (even with the
    CPU's SHA extensions) took 2.3-4.3 ms and was two thirds of publishing a full frame."""
    h = xxhash.xxh3_64()
    for path in sorted(tensors):
        arr = np.asarray(tensors[path], dtype=np.float32, order="C")  # 0-d stays 0-d
        h.update(f"{path}\0{arr.shape}\0".encode())
        h.update(arr.data)
    return h.hexdigest()[: 2 * HASH_BYTES]


def full_frame(
    version: int, tensors: Mapping[str, np.ndarray], hash_: str | None
) -> tuple[bytes, dict[str, np.ndarray]]:
    """The full ``params`` frame of ``version`` in codec ``none`` (with ``hash_`` when given),
    packed with one copy of the tensors (:func:`hetd.protocol.wire.pack_parts`: no msgpack copy
    of the payload), and the tensors as read-only float32 views of the frame: a snapshot that
    shares its frame's memory costs one copy of the model, not two. Byte for byte what
    :func:`hetd.protocol.wire.encode` packs for the same fields."""
    frame, views = full_frame_into(version, tensors, hash_, lambda _: None)
    assert isinstance(frame, bytes)  # nothing was given to pack into
    return frame, views


def full_frame_into(
    version: int,
    tensors: Mapping[str, np.ndarray],
    hash_: str | None,
    into: Callable[[int], np.ndarray | None],
) -> tuple[bytes | memoryview, dict[str, np.ndarray]]:
    """:func:`full_frame`, packed into the writable ``uint8`` buffer ``into`` gives for the
    frame's size (a shared-memory slot): the frame is then a ``memoryview`` of that buffer and
    the tensors views of it. When ``into`` gives None, a fresh ``bytes`` as :func:`full_frame`."""
    # np.asarray, not ascontiguousarray: that makes a 0-d parameter (a scalar bias) 1-d
    flat = {path: np.asarray(x, dtype=np.float32, order="C") for path, x in tensors.items()}
    extra = {} if hash_ is None else {"hash": hash_}
    encoded = codecs.encode_tree(flat, codecs.none_codec())
    parts = wire.pack_parts("params", 0, version=version, full=True, tensors=encoded, **extra)
    buf = into(parts.nbytes)
    frame: bytes | memoryview
    if buf is None:
        frame = parts.join()
    else:
        pos = 0
        for seg in parts.segments:
            n = memoryview(seg).nbytes
            buf[pos : pos + n] = np.frombuffer(seg, np.uint8)
            pos += n
        frame = buf[: parts.nbytes].data
    views: dict[str, np.ndarray] = {}
    big = iter(parts.offsets)
    for path, x in flat.items():
        if x.nbytes >= wire.ZERO_COPY_MIN:
            view = np.frombuffer(frame, np.float32, x.size, next(big)).reshape(x.shape)
        else:
            view = np.array(x, np.float32, copy=True)
        view.flags.writeable = False
        views[path] = view
    return frame, views


def with_hash(frame: bytes | memoryview, hash_: str) -> bytes:
    """A message frame packed without a ``hash`` field (by :func:`full_frame`), with one: its
    top-level map (a fixmap: fewer than 15 fields) grows by one entry appended at the end. One
    copy of the frame; byte for byte what :func:`full_frame` packs with ``hash_``."""
    head = frame[0]
    if not 0x80 <= head < 0x8F:
        raise ValueError("with_hash takes a frame whose top-level map has fewer than 15 fields")
    tail = msgpack.packb("hash") + msgpack.packb(hash_)
    return b"".join((bytes((head + 1,)), memoryview(frame)[1:], tail))


def hash_matches(held: Held, msg: Params) -> bool | None:
    """Whether parameters applied from a full ``params`` frame are what the daemon published:
    None when there is nothing to check (a delta, which is lossy by design, or no ``hash``)."""
    if not msg.full or msg.hash is None:
        return None
    return bool(param_hash(held.tensors) == msg.hash)


@dataclass(frozen=True, slots=True)
class Held:
    """Parameters a worker holds: a version and its tensors (never changed in place)."""

    version: int
    tensors: Mapping[str, np.ndarray]


def apply_params(held: Held | None, msg: Params) -> Held | None:
    """The parameters after a ``params`` message: full ones replace; a delta adds to the version
    it names, or returns None when that is not the version held."""
    decoded = codecs.decode_tree(msg.tensors)
    if msg.full:
        return Held(msg.version, decoded)
    if held is None or msg.base != held.version:
        return None
    tensors = dict(held.tensors)
    for path, d in decoded.items():
        if path not in tensors or tensors[path].shape != d.shape:
            return None
        tensors[path] = tensors[path] + d
    return Held(msg.version, tensors)


def params_envelope(frame: bytes | memoryview) -> tuple[dict[str, Any], int | None] | None:
    """The fields of a ``params`` frame before its tensors, read from its first 256 bytes without
    unpacking the tensors, and its version (None unless a plain int); None when the frame is not
    a ``params`` frame or its envelope cannot be read."""
    unpacker = msgpack.Unpacker(raw=False, max_buffer_size=4096)
    unpacker.feed(frame[:256])
    fields: dict[str, Any] = {}
    try:
        for _ in range(unpacker.read_map_header()):
            key = unpacker.unpack()
            if key == "tensors":
                break
            fields[key] = unpacker.unpack()
    except (msgpack.OutOfData, ValueError):
        return None
    if fields.get("type") != "params":
        return None
    version = fields.get("version")
    return fields, version if isinstance(version, int) and not isinstance(version, bool) else None
