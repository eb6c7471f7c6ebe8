"""Tensor codecs: how one float32 tensor travels as bytes.

Owns the codec registry, the dense float codecs and the strict entry points that decode untrusted
tensors. A wire tensor is a flat map (see :mod:`hetd.codecs.tensor`)::

    {"codec": name, "dtype": "float32", "shape": [d0, d1, ...], ...codec fields}

=========  =====================================================  ==========================
codec      fields besides the header                               bytes a value (float32: 4)
=========  =====================================================  ==========================
``none``   ``data``: n little-endian float32                       4
``fp16``   ``data``: n little-endian IEEE half floats               2
``bf16``   ``data``: n little-endian top halves of the float32s     2
``int8``   ``bits`` 8, ``block``, ``scales``, ``data``              1 (+ 4 / block)
``int4``   ``bits`` 4, ``block``, ``scales``, ``data``              1/2 (+ 4 / block)
``sign``   ``bits`` 1, ``scales`` (one), ``data``                   1/8
``topk``   ``count``, ``index_bits``, ``indices``, ``values``       k * (2 or 4 + values')
=========  =====================================================  ==========================

The byte layouts of the last four are in :mod:`hetd.codecs.quant` and :mod:`hetd.codecs.topk`. Encoding takes parameters
(``get_codec("int8", block=1024)`` or ``from_spec("int8:block=1024")``); decoding never does: a wire
tensor carries every field its decoder needs, and :func:`decode_tensor` checks each of them against
the header, raising :class:`CodecError` that names the tensor. Nothing is returned half-made.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import numpy as np

from hetd.codecs import quant, topk
from hetd.codecs.tensor import (
    Codec,
    CodecError,
    WireTensor,
    as_bytes,
    as_f32,
    check_fields,
    header,
    nbytes,
    read_bytes,
    read_shape,
    size_of,
)

__all__ = [
    "Codec",
    "CodecError",
    "WireTensor",
    "decode_tensor",
    "decode_tree",
    "encode_tree",
    "from_spec",
    "get_codec",
    "names",
    "negotiate",
    "payload_nbytes",
    "register",
    "spec_name",
]

payload_nbytes = nbytes
"""The payload bytes of one wire tensor (every bytes field, nested ones included)."""


# --- none: raw float32 ---------------------------------------------------------------------------


def _none_encode(x: np.ndarray, rng: np.random.Generator | None = None) -> WireTensor:
    x = as_f32(x)
    wire = header("none", x.shape)
    # A memoryview packs without a copy (msgpack reads the buffer directly).
    wire["data"] = as_bytes(x)
    return wire


def _none_decode(wire: Mapping[str, Any]) -> np.ndarray:
    check_fields(wire, "none", ("data",))
    shape = read_shape(wire)
    data = read_bytes(wire, "data", "none", 4 * size_of(shape))
    return np.frombuffer(data, dtype="<f4").reshape(shape)


def none_codec() -> Codec:
    """``none``: raw float32, bit-exact (NaN payloads, -0.0 and subnormals included)."""
    return Codec("none", _none_encode, _none_decode, 1.0, lossless=True)


# --- fp16: IEEE half precision -------------------------------------------------------------------

_FP16_MAX = 65504.0


def _fp16_encode(x: np.ndarray, rng: np.random.Generator | None = None) -> WireTensor:
    x = as_f32(x)
    with np.errstate(over="ignore"):
        half = x.astype("<f2")
    over = np.isinf(half)
    if over.any():
        # Saturate finite values beyond the half range instead of turning them into infinities;
        # a real infinity stays one (so the daemon's finiteness check still sees it).
        over &= np.isfinite(x)
        half[over] = np.copysign(np.float16(_FP16_MAX), x[over])
    wire = header("fp16", x.shape)
    wire["data"] = as_bytes(half)
    return wire


def _fp16_decode(wire: Mapping[str, Any]) -> np.ndarray:
    check_fields(wire, "fp16", ("data",))
    shape = read_shape(wire)
    data = read_bytes(wire, "data", "fp16", 2 * size_of(shape))
    return np.frombuffer(data, dtype="<f2").astype(np.float32).reshape(shape)


def fp16_codec() -> Codec:
    """``fp16``: IEEE half. Bound: ``|err| <= 2**-11 |x|`` for ``2**-14 <= |x| <= 65504``,
    ``|err| <= 2**-25`` below; finite values beyond 65504 saturate to +-65504; NaN and +-inf
    survive. numpy's half-float cast is slow (docs/benchmark.md): prefer ``bf16`` where speed or
    range matter more."""
    return Codec("fp16", _fp16_encode, _fp16_decode, 0.5)


# --- bf16: the top 16 bits of each float32 (round to nearest even) -------------------------------


def _bf16_encode(x: np.ndarray, rng: np.random.Generator | None = None) -> WireTensor:
    x = as_f32(x)
    bits = x.view(np.uint32)
    # Round to nearest even on the dropped 16 bits; NaN payloads are kept NaN by the check below.
    rounded = bits + (np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1)))
    top = (rounded >> np.uint32(16)).astype(np.uint16)
    nan = np.isnan(x)
    if nan.any():
        top[nan] = np.uint16(0x7FC0)
    wire = header("bf16", x.shape)
    wire["data"] = as_bytes(top)
    return wire


def _bf16_decode(wire: Mapping[str, Any]) -> np.ndarray:
    check_fields(wire, "bf16", ("data",))
    shape = read_shape(wire)
    data = read_bytes(wire, "data", "bf16", 2 * size_of(shape))
    top = np.frombuffer(data, dtype="<u2")
    return (top.astype(np.uint32) << np.uint32(16)).view(np.float32).reshape(shape)


def bf16_codec() -> Codec:
    """``bf16``: the top half of each float32, rounded to nearest even. Bound: ``|err| <= 2**-8
    |x|`` for normal values (the float32 range is kept); NaN and +-inf survive."""
    return Codec("bf16", _bf16_encode, _bf16_decode, 0.5)


# --- registry ------------------------------------------------------------------------------------


class _Entry(NamedTuple):
    factory: Callable[..., Codec]  # parameters -> a codec that encodes with them
    decode: Callable[[Mapping[str, Any]], np.ndarray]  # header-driven: needs no parameters


_REGISTRY: dict[str, _Entry] = {}


def register(
    name: str,
    factory: Callable[..., Codec],
    decode: Callable[[Mapping[str, Any]], np.ndarray] | None = None,
) -> None:
    """Add a codec under ``name``; a duplicate name raises.

    ``factory(**params)`` builds an encoder; ``decode`` (default: the default codec's) must rebuild
    the tensor from the wire map alone and raise :class:`CodecError` on anything that does not fit.
    """
    if name in _REGISTRY:
        raise ValueError(f"codec {name!r} is already registered; registered: {', '.join(names())}")
    _REGISTRY[name] = _Entry(factory, decode if decode is not None else factory().decode)


def _topk_factory(k: float = 0.01, values: str = "none") -> Codec:
    """``topk`` with fraction ``k`` and its kept values in the dense codec ``values``."""
    if not isinstance(values, str) or values == "topk" or values not in _REGISTRY:
        dense = [n for n in names() if n != "topk"]
        raise CodecError(
            f"topk: values must name a dense codec ({', '.join(dense)}), got {values!r}"
        )
    return topk.topk_codec(k, get_codec(values), _decode_values)


def _decode_values(wire: Any, count: int) -> np.ndarray:
    """The nested ``values`` tensor of a ``topk`` payload: dense, float32, shape ``[count]``."""
    try:
        if isinstance(wire, Mapping) and wire.get("codec") == "topk":
            raise CodecError("the values codec must be dense, not 'topk'")
        values = _decode_checked(wire, (count,))
    except CodecError as exc:
        raise CodecError(f"topk values: {exc}") from None
    return values


def names() -> list[str]:
    """The registered codec names, sorted."""
    return sorted(_REGISTRY)


def _entry(name: Any) -> _Entry:
    entry = _REGISTRY.get(name) if isinstance(name, str) else None
    if entry is None:
        raise CodecError(f"unknown codec {name!r}; known codecs: {', '.join(names())}")
    return entry


def get_codec(name: str, **params: Any) -> Codec:
    """The codec ``name`` built with ``params``; an unknown name or parameter raises listing the
    known ones, and a bad parameter value raises saying what is allowed."""
    entry = _entry(name)
    accepted = list(inspect.signature(entry.factory).parameters)
    unknown = sorted(set(params) - set(accepted))
    if unknown:
        raise CodecError(
            f"codec {name!r}: unknown parameter(s) {unknown}; it accepts {accepted or 'none'}"
        )
    return entry.factory(**params)


register("none", none_codec)
register("fp16", fp16_codec)
register("bf16", bf16_codec)
register("int8", quant.int8_codec, quant.int8_decode)
register("int4", quant.int4_codec, quant.int4_decode)
register("sign", quant.sign_codec, quant.sign_decode)
register("topk", _topk_factory)


def _parse_value(text: str) -> Any:
    if text in ("true", "false"):
        return text == "true"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def spec_name(spec: str) -> str:
    """The codec name of a spec string (``"int8:block=256"`` -> ``"int8"``)."""
    return spec.partition(":")[0].strip()


def from_spec(spec: str) -> Codec:
    """A codec from a one-string spec, as a config or a plan holds it:
    ``"name"`` or ``"name:key=value,key=value"`` (values parsed as true/false, int, float, text),
    e.g. ``"topk:k=0.01,values=int8"``."""
    name, _, rest = spec.partition(":")
    params: dict[str, Any] = {}
    for item in filter(None, (p.strip() for p in rest.split(","))):
        key, eq, value = item.partition("=")
        if not eq or not key.strip():
            raise CodecError(f"codec spec {spec!r}: expected key=value, got {item!r}")
        params[key.strip()] = _parse_value(value.strip())
    return get_codec(name.strip(), **params)


def negotiate(offered: list[str], preferred: str) -> str:
    """The codec to use with a worker that offers ``offered`` (names): ``preferred`` (a name or a
    spec) if the worker has its codec, else ``none`` (every worker must offer ``none``)."""
    if spec_name(preferred) in offered:
        return preferred
    if "none" in offered:
        return "none"
    raise CodecError(f"worker offers no usable codec (offered {offered!r}, need 'none')")


def _decode_checked(wire: Any, expected_shape: tuple[int, ...] | None) -> np.ndarray:
    """Check the header of an untrusted wire tensor and decode it (messages without the path)."""
    if not isinstance(wire, Mapping):
        raise CodecError(f"expected a map, got {type(wire).__name__}")
    entry = _entry(wire.get("codec"))
    if wire.get("dtype") != "float32":
        raise CodecError(f"dtype {wire.get('dtype')!r} is not 'float32'")
    shape = read_shape(wire)
    if expected_shape is not None and shape != tuple(expected_shape):
        raise CodecError(f"shape {list(shape)} does not match the expected {list(expected_shape)}")
    out = entry.decode(wire)
    if out.shape != shape or out.dtype != np.float32:  # a plug-in decoder that broke its contract
        raise CodecError(f"decoder gave {out.dtype}{list(out.shape)}, not float32{list(shape)}")
    return out


def decode_tensor(
    wire: Any, path: str, expected_shape: tuple[int, ...] | None = None
) -> np.ndarray:
    """Decode one wire tensor named ``path`` from its fields alone; check its shape when
    ``expected_shape`` is given. Every failure raises :class:`CodecError` naming the tensor."""
    try:
        return _decode_checked(wire, expected_shape)
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
    bad = [p for p in wire if not isinstance(p, str)]
    if bad:
        raise CodecError(f"tensor paths must be strings, got {sorted(map(repr, bad))[:5]}")
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
