"""The wire form of one tensor, and the strict readers of its fields.

Owns :class:`Codec`, :class:`CodecError`, :data:`WireTensor` and the helpers every codec uses to
build a header and to read a field back from untrusted input. A wire tensor is a flat map::

    {"codec": name, "dtype": "float32", "shape": [d0, d1, ...], ...codec fields}

Each codec lists the fields it uses; a reader rejects a missing field, a field of the wrong type
or range, and a field the codec does not use, always with :class:`CodecError` (never ``assert``).
Messages here do not name the tensor: :func:`hetd.codecs.registry.decode_tensor` prefixes the path.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Mapping
from typing import Any, NamedTuple

import numpy as np

WireTensor = dict[str, Any]
"""One tensor on the wire: ``codec``, ``dtype``, ``shape`` and codec fields (bytes, ints)."""

Bytes = bytes | bytearray | memoryview
"""What a bytes field may hold: msgpack gives ``bytes``; an encoder may leave a ``memoryview``."""

HEADER_FIELDS = frozenset({"codec", "dtype", "shape"})
MAX_DIM = 2**31  # exclusive bound on one dimension, and on a tensor's element count
CHUNK = 1 << 18  # elements per kernel pass: a 1 MiB float32 scratch stays in L2/L3


class CodecError(ValueError):
    """A tensor payload that does not fit its header, an unknown codec, or bad codec parameters."""


class Codec(NamedTuple):
    """A named, pure tensor codec.

    ``encode(x, rng)`` maps a float32 array to its wire form (``rng`` feeds stochastic rounding and
    sampling; ``None`` means deterministic); ``decode(wire)`` maps it back to a float32 array of the
    header's shape or raises :class:`CodecError` (it reads only the wire map, never the encoder's
    parameters); ``ratio`` is the estimated encoded bytes / float32 bytes; ``lossless`` says that
    ``decode(encode(x))`` is bit-exact, so error feedback may skip it.
    """

    name: str
    encode: Callable[[np.ndarray, np.random.Generator | None], WireTensor]
    decode: Callable[[Mapping[str, Any]], np.ndarray]
    ratio: float
    lossless: bool = False


def non_finite(codec: str, what: str, value: float) -> CodecError:
    """The error an encoder raises for NaN or infinite input it cannot represent."""
    return CodecError(f"{codec} cannot encode non-finite values ({what} is {value!r})")


def header(codec: str, shape: tuple[int, ...]) -> WireTensor:
    """The fields every wire tensor starts with."""
    return {"codec": codec, "dtype": "float32", "shape": list(shape)}


def as_f32(x: np.ndarray) -> np.ndarray:
    """``x`` as a C-contiguous float32 array (no copy when it already is one; unlike
    ``np.ascontiguousarray`` it keeps a 0-d array 0-d)."""
    return np.asarray(x, dtype=np.float32, order="C")


def as_bytes(a: np.ndarray) -> memoryview:
    """The bytes of a C-contiguous array as a flat memoryview (msgpack packs it without a copy;
    works for empty and 0-d arrays too)."""
    return a.reshape(-1).view(np.uint8).data


def size_of(shape: tuple[int, ...]) -> int:
    """The element count of ``shape``."""
    return math.prod(shape)


def check_fields(wire: Mapping[str, Any], codec: str, fields: Collection[str]) -> None:
    """Reject a wire tensor that lacks one of ``fields`` or carries one the codec does not use."""
    allowed = HEADER_FIELDS | set(fields)
    missing = sorted(f for f in fields if f not in wire)
    if missing:
        raise CodecError(f"{codec}: missing field(s) {missing}")
    extra = sorted(repr(k) for k in wire if k not in allowed)
    if extra:
        raise CodecError(f"{codec}: unexpected field(s) {extra}; {codec} uses {sorted(fields)}")


def read_shape(wire: Mapping[str, Any]) -> tuple[int, ...]:
    """The ``shape`` field: a list of ints in [0, 2**31) whose product is below 2**31."""
    shape = wire.get("shape")
    if not isinstance(shape, list | tuple) or not all(
        isinstance(d, int) and not isinstance(d, bool) and 0 <= d < MAX_DIM for d in shape
    ):
        raise CodecError(f"shape must be a list of non-negative ints, got {shape!r}")
    if size_of(tuple(shape)) >= MAX_DIM:
        raise CodecError(f"shape {list(shape)} holds 2**31 or more elements")
    return tuple(shape)


def read_bytes(wire: Mapping[str, Any], field: str, codec: str, length: int) -> Bytes:
    """The bytes field ``field``, which must be exactly ``length`` bytes long."""
    data = wire.get(field)
    if not isinstance(data, bytes | bytearray | memoryview):
        raise CodecError(f"{codec}: {field} must be bytes, got {type(data).__name__}")
    nbytes = data.nbytes if isinstance(data, memoryview) else len(data)
    if nbytes != length:
        raise CodecError(f"{codec}: {field} has {nbytes} bytes, the header needs {length}")
    return data


def read_int(wire: Mapping[str, Any], field: str, codec: str, lo: int, hi: int) -> int:
    """The int field ``field``, which must lie in ``[lo, hi]``."""
    value = wire.get(field)
    if not isinstance(value, int) or isinstance(value, bool) or not lo <= value <= hi:
        raise CodecError(f"{codec}: {field} must be an int in [{lo}, {hi}], got {value!r}")
    return value


def read_choice(wire: Mapping[str, Any], field: str, codec: str, choices: tuple[int, ...]) -> int:
    """The int field ``field``, which must be one of ``choices`` (an int, not a float or bool)."""
    value = wire.get(field)
    if not isinstance(value, int) or isinstance(value, bool) or value not in choices:
        allowed = " or ".join(map(str, choices))
        raise CodecError(f"{codec}: {field} must be {allowed}, got {value!r}")
    return value


def read_scales(wire: Mapping[str, Any], codec: str, count: int) -> np.ndarray:
    """The ``scales`` field: ``count`` little-endian float32 values, each finite and >= 0."""
    data = read_bytes(wire, "scales", codec, 4 * count)
    scales = np.frombuffer(data, dtype="<f4")
    # ``s >= 0`` is False for NaN, so this one test also rejects NaN (and -inf); +inf is separate.
    if count and not (bool((scales >= 0).all()) and bool(np.isfinite(scales).all())):
        bad = scales[~((scales >= 0) & np.isfinite(scales))][0]
        raise CodecError(f"{codec}: scales must be finite and >= 0, got {float(bad)!r}")
    return scales


def nbytes(wire: Mapping[str, Any]) -> int:
    """The payload bytes of a wire tensor: every bytes field, nested tensors included."""
    total = 0
    for value in wire.values():
        if isinstance(value, memoryview):
            total += value.nbytes
        elif isinstance(value, bytes | bytearray):
            total += len(value)
        elif isinstance(value, Mapping):
            total += nbytes(value)
    return total
