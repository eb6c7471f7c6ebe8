"""Tensor codecs: how one float32 tensor travels as bytes.

Owns the codec registry and the wire form of a tensor::

    {"codec": name, "dtype": "float32", "shape": [d0, d1, ...], "data": bytes, ...codec fields}

Every codec is a pure pair of functions (``encode``, ``decode``) plus an estimated size ratio
against float32. Decoding is strict: a payload whose length or fields do not fit its header raises
:class:`CodecError` naming the tensor, and nothing is returned half-made.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import numpy as np

WireTensor = dict[str, Any]
"""One tensor on the wire: ``codec``, ``dtype``, ``shape``, ``data`` and codec fields."""


class CodecError(ValueError):
    """A tensor payload that does not fit its header, or an unknown codec."""


class Codec(NamedTuple):
    """A named, pure tensor codec.

    ``encode(x, rng)`` maps a float32 array to its wire form (``rng`` feeds stochastic rounding;
    deterministic codecs ignore it); ``decode(wire)`` maps it back to a float32 array of the header's
    shape or raises :class:`CodecError`; ``ratio`` is the estimated encoded size / float32 size.
    """

    name: str
    encode: Callable[[np.ndarray, np.random.Generator | None], WireTensor]
    decode: Callable[[Mapping[str, Any]], np.ndarray]
    ratio: float


def _header(x: np.ndarray, codec: str) -> WireTensor:
    return {"codec": codec, "dtype": "float32", "shape": list(x.shape)}


def _shape_of(wire: Mapping[str, Any]) -> tuple[int, ...]:
    shape = wire.get("shape")
    if not isinstance(shape, list | tuple) or not all(
        isinstance(d, int) and not isinstance(d, bool) and 0 <= d < 2**31 for d in shape
    ):
        raise CodecError(f"shape must be a list of non-negative ints, got {shape!r}")
    return tuple(shape)


def _data_of(wire: Mapping[str, Any]) -> bytes | bytearray | memoryview:
    data = wire.get("data")
    if not isinstance(data, bytes | bytearray | memoryview):
        raise CodecError(f"data must be bytes, got {type(data).__name__}")
    return data


def _size(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _as_f32(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(x, dtype=np.float32)


# --- none: raw float32 ---------------------------------------------------------------------------


def _none_encode(x: np.ndarray, rng: np.random.Generator | None = None) -> WireTensor:
    x = _as_f32(x)
    wire = _header(x, "none")
    # A memoryview packs without a copy (msgpack reads the buffer directly).
    wire["data"] = x.data.cast("B")
    return wire


def _none_decode(wire: Mapping[str, Any]) -> np.ndarray:
    shape = _shape_of(wire)
    data = _data_of(wire)
    if len(data) != 4 * _size(shape):
        raise CodecError(f"none: {len(data)} bytes do not hold float32{list(shape)}")
    return np.frombuffer(data, dtype="<f4").reshape(shape)


# --- bf16: the top 16 bits of each float32 (round to nearest even) -------------------------------


def _bf16_encode(x: np.ndarray, rng: np.random.Generator | None = None) -> WireTensor:
    x = _as_f32(x)
    bits = x.view(np.uint32)
    # Round to nearest even on the dropped 16 bits; NaN payloads are kept NaN by the check below.
    rounded = bits + (np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1)))
    top = (rounded >> np.uint32(16)).astype(np.uint16)
    nan = np.isnan(x)
    if nan.any():
        top[nan] = np.uint16(0x7FC0)
    wire = _header(x, "bf16")
    wire["data"] = top.data.cast("B")
    return wire


def _bf16_decode(wire: Mapping[str, Any]) -> np.ndarray:
    shape = _shape_of(wire)
    data = _data_of(wire)
    if len(data) != 2 * _size(shape):
        raise CodecError(f"bf16: {len(data)} bytes do not hold bfloat16{list(shape)}")
    top = np.frombuffer(data, dtype="<u2")
    return (top.astype(np.uint32) << np.uint32(16)).view(np.float32).reshape(shape)


# --- registry ------------------------------------------------------------------------------------

_REGISTRY: dict[str, Callable[..., Codec]] = {}


def register(name: str, factory: Callable[..., Codec]) -> None:
    """Add a codec factory under ``name``; a duplicate name raises."""
    if name in _REGISTRY:
        raise ValueError(f"codec {name!r} is already registered")
    _REGISTRY[name] = factory


register("none", lambda: Codec("none", _none_encode, _none_decode, 1.0))
register("bf16", lambda: Codec("bf16", _bf16_encode, _bf16_decode, 0.5))


def names() -> list[str]:
    """The registered codec names, sorted."""
    return sorted(_REGISTRY)


def get_codec(name: str, **params: Any) -> Codec:
    """The codec ``name`` built with ``params``; an unknown name raises listing the known ones."""
    try:
        factory = _REGISTRY[name]
    except KeyError:
        raise CodecError(f"unknown codec {name!r}; known codecs: {', '.join(names())}") from None
    try:
        return factory(**params)
    except TypeError as exc:
        raise CodecError(f"codec {name!r}: bad parameters {params!r} ({exc})") from None


def negotiate(offered: list[str], preferred: str) -> str:
    """The codec to use with a worker that offers ``offered``: ``preferred`` if it has it, else
    ``none`` (every worker must offer ``none``)."""
    if preferred in offered:
        return preferred
    if "none" in offered:
        return "none"
    raise CodecError(f"worker offers no usable codec (offered {offered!r}, need 'none')")


def decode_tensor(
    wire: Any, path: str, expected_shape: tuple[int, ...] | None = None
) -> np.ndarray:
    """Decode one wire tensor named ``path``; check its shape when ``expected_shape`` is given.

    Every failure raises :class:`CodecError` whose message names the tensor.
    """
    if not isinstance(wire, Mapping):
        raise CodecError(f"tensor {path!r}: expected a map, got {type(wire).__name__}")
    name = wire.get("codec")
    if not isinstance(name, str) or name not in _REGISTRY:
        raise CodecError(f"tensor {path!r}: unknown codec {name!r}; known: {', '.join(names())}")
    if wire.get("dtype") != "float32":
        raise CodecError(f"tensor {path!r}: dtype {wire.get('dtype')!r} is not 'float32'")
    try:
        shape = _shape_of(wire)
        if expected_shape is not None and shape != tuple(expected_shape):
            raise CodecError(
                f"shape {list(shape)} does not match the model's {list(expected_shape)}"
            )
        return _REGISTRY[name]().decode(wire)
    except CodecError as exc:
        raise CodecError(f"tensor {path!r}: {exc}") from None


def encode_tree(
    tensors: Mapping[str, np.ndarray], codec: Codec, rng: np.random.Generator | None = None
) -> dict[str, WireTensor]:
    """Encode a flat ``path -> array`` map with one codec."""
    return {path: codec.encode(x, rng) for path, x in tensors.items()}


def decode_tree(
    wire: Any, expected: Mapping[str, tuple[int, ...]] | None = None
) -> dict[str, np.ndarray]:
    """Decode a flat ``path -> wire tensor`` map; with ``expected`` (path -> shape), the paths must
    be exactly the model's and every shape must match."""
    if not isinstance(wire, Mapping):
        raise CodecError(f"tensors must be a map of path -> tensor, got {type(wire).__name__}")
    if expected is not None:
        missing = sorted(set(expected) - set(wire))
        extra = sorted(set(wire) - set(expected))
        if missing or extra:
            raise CodecError(
                f"tensor paths do not match the model: missing {missing}, unknown {extra}"
            )
    return {
        str(path): decode_tensor(t, str(path), None if expected is None else expected[path])
        for path, t in wire.items()
    }
