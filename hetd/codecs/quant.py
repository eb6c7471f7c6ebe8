"""Lossy quantizing codecs: ``int8``, ``int4`` and ``sign`` — kernels and byte layouts.

Owns how each of these codecs turns a float32 tensor into bytes and back; the registry, the
header checks shared by all codecs and the path in error messages live in :mod:`hetd.codecs.registry`.
All multi-byte numbers are little-endian. ``n`` is the element count of ``shape``.

``int8`` / ``int4`` (fields ``bits``, ``block``, ``scales``, ``data``)
    ``bits`` is 8 or 4 (it must match the codec). ``block`` is 0 for one scale over the whole
    tensor, else the number of consecutive elements (in C order) that share a scale; there are
    ``nb = 1`` (block 0) or ``ceil(n / block)`` scales. ``scales`` is ``nb`` float32, each finite
    and >= 0. Element ``i`` is ``q[i] * scales[i // block]``. ``int8``: ``data`` is ``n`` bytes,
    ``q`` as two's-complement int8 in [-127, 127]. ``int4``: ``data`` is ``ceil(n / 2)`` bytes;
    element ``2j`` is the low nibble of byte ``j`` and ``2j + 1`` the high one, each nibble holding
    ``q + 8`` with ``q`` in [-7, 7]; the unused high nibble of an odd-length tensor is 8 (zero).
``sign`` (fields ``bits``, ``scales``, ``data``)
    ``bits`` is 1; ``scales`` is one float32 (mean |x|, finite and >= 0); ``data`` is
    ``ceil(n / 8)`` bytes from ``np.packbits`` (first element in the most significant bit), bit 1
    meaning ``-scale`` and bit 0 ``+scale``; the padding bits of the last byte are 0.

The kernels work in chunks of :data:`CHUNK` elements through one small float32 scratch buffer, so
no temporary as big as the tensor is made: fresh memory is slow (docs/benchmark.md).
Rounding to nearest uses the float32 "magic number" trick: adding 1.5 * 2**23
to a value below 2**22 in magnitude rounds it (half to even, like ``np.rint``) and leaves the
integer in the low bits of the result, whose low byte is then the two's-complement int8 — one
add and one narrowing cast instead of ``rint`` + a float-to-int cast.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np

from hetd.codecs.tensor import (
    CHUNK,
    Codec,
    CodecError,
    WireTensor,
    as_bytes,
    as_f32,
    check_fields,
    header,
    non_finite,
    read_bytes,
    read_choice,
    read_int,
    read_scales,
    read_shape,
    size_of,
)

_MAGIC = 1.5 * 2**23  # x + _MAGIC rounds x (|x| < 2**22) to an integer held in the low bits
MIN_BLOCK = 8  # below this the float32 scales cost more than the quantization saves
MIN_SCALE = 2.0**-126  # the smallest normal float32
_ONES = np.ones(CHUNK, np.float32)
_ONES.flags.writeable = False


# --- shared checks -------------------------------------------------------------------------------


def _check_block(codec: str, block: Any) -> int:
    """``block`` as stored on the wire: 0 for per-tensor, else the block length."""
    if block is None:
        return 0
    if not isinstance(block, int) or isinstance(block, bool) or not MIN_BLOCK <= block < 2**31:
        raise CodecError(
            f"{codec}: block must be None (one scale per tensor) or an int >= {MIN_BLOCK}, "
            f"got {block!r}"
        )
    return block


def _check_bool(codec: str, name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise CodecError(f"{codec}: {name} must be True or False, got {value!r}")
    return value


def _n_blocks(n: int, block: int) -> int:
    return 1 if block == 0 else -(-n // block)


# --- int8 / int4: scaled integers ---------------------------------------------------------------


def _absmax(x: np.ndarray, block: int) -> np.ndarray:
    """max |x| over the whole tensor (block 0) or over each block, as float64."""
    n = x.size
    if n == 0:
        return np.zeros(_n_blocks(0, block))
    if block == 0:
        # Two plain reductions beat np.abs(x).max(): no temporary, and each runs at read speed.
        return np.array([max(float(x.max()), -float(x.min()))])
    full = n // block
    amax = np.empty(_n_blocks(n, block))
    if full:
        rows = x[: full * block].reshape(full, block)
        np.maximum(rows.max(axis=1), -rows.min(axis=1), out=amax[:full])
    if full * block < n:
        tail = x[full * block :]
        amax[full] = max(float(tail.max()), -float(tail.min()))
    return amax


def _pieces(
    x: np.ndarray, out: np.ndarray, per_block: np.ndarray, block: int
) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray | np.float32]]:
    """Walk ``x`` and ``out`` (same length) in chunks, each with its block's value of
    ``per_block``: a scalar for a per-tensor chunk or a tail, else a column for a run of rows."""
    n = x.size
    if block == 0:
        value = np.float32(per_block[0])
        for i in range(0, n, CHUNK):
            yield x[i : i + CHUNK], out[i : i + CHUNK], value
        return
    full = n // block
    rows_x = x[: full * block].reshape(full, block)
    rows_out = out[: full * block].reshape(full, block)
    col = per_block[:full, None]
    step = max(1, CHUNK // block)
    for r in range(0, full, step):
        yield rows_x[r : r + step], rows_out[r : r + step], col[r : r + step]
    if full * block < n:
        yield x[full * block :], out[full * block :], np.float32(per_block[full])


def _quantize(
    name: str, x: np.ndarray, block: int, levels: int, offset: int, rng: np.random.Generator | None
) -> tuple[np.ndarray, np.ndarray]:
    """Scales (float32, one per block) and ``q + offset`` as uint8 (the low byte of the int)."""
    amax = _absmax(x, block)
    if amax.size and not np.isfinite(amax).all():
        raise non_finite(name, "max |x|", float(amax[~np.isfinite(amax)][0]))
    # The scale never drops below the smallest normal float32, so 1 / scale stays finite and the
    # bound |err| <= scale / 2 holds for tiny (even all-zero) blocks too.
    scale64 = np.maximum(amax / levels, MIN_SCALE)
    scales = scale64.astype(np.float32)
    inv = (1.0 / scale64).astype(np.float32)
    q = np.empty(x.size, np.uint8)
    scratch = np.empty(min(x.size, CHUNK), np.float32)
    noise = None if rng is None else np.empty_like(scratch)
    magic = np.float32(_MAGIC + offset)
    for xs, qs, inv_s in _pieces(x, q, inv, block):
        buf = scratch[: xs.size].reshape(xs.shape)
        np.multiply(xs, inv_s, out=buf)
        if noise is not None and rng is not None:
            # floor(v + u), u ~ U(0, 1), is v rounded up with probability frac(v): unbiased.
            u = noise[: xs.size].reshape(xs.shape)
            _uniform(rng, u)
            np.add(buf, u, out=buf)
            np.floor(buf, out=buf)
            # |v| <= levels, but v + u may round up to levels + 1 in float32.
            np.clip(buf, -levels, levels, out=buf)
        np.add(buf, magic, out=buf)
        np.copyto(qs, buf.view(np.uint32), casting="unsafe")  # keep the low byte
    return scales, q


def _uniform(rng: np.random.Generator, out: np.ndarray) -> None:
    """Fill float32 ``out`` with ``(r + 0.5) / 2**16`` for uniform 16-bit ``r``: mean exactly 1/2,
    so rounding stays unbiased to 2**-17 of a step, below float32's own rounding at 127. Four
    values from each raw 64-bit draw, faster than ``rng.random(dtype=np.float32)``
    (docs/benchmark.md)."""
    raw = rng.bit_generator.random_raw(-(-out.size // 4)).view(np.uint16)
    np.copyto(out, raw[: out.size].reshape(out.shape))
    np.multiply(out, np.float32(2.0**-16), out=out)
    np.add(out, np.float32(2.0**-17), out=out)


def _dequantize(q: np.ndarray, scales: np.ndarray, block: int, n: int) -> np.ndarray:
    """``q[i] * scales[i // block]`` as a new float32 array of ``n`` elements."""
    out = np.empty(n, np.float32)
    for qs, outs, scale in _pieces(q, out, scales, block):
        np.copyto(outs, qs)  # int8 -> float32, then scale in place while it is in cache
        np.multiply(outs, scale, out=outs)
    return out


def _int_codec(name: str, bits: int, block: Any, stochastic: Any) -> Codec:
    levels = 2 ** (bits - 1) - 1  # symmetric: +-127 or +-7
    block_len = _check_block(name, block)
    random = _check_bool(name, "stochastic", stochastic)

    def encode(x: np.ndarray, rng: np.random.Generator | None = None) -> WireTensor:
        x = as_f32(x)
        flat = x.reshape(-1)
        offset = 0 if bits == 8 else 8  # int4 stores q + 8 in a nibble
        scales, q = _quantize(name, flat, block_len, levels, offset, rng if random else None)
        if bits == 4:
            q = _pack_nibbles(q)
        wire = header(name, x.shape)
        wire.update(bits=bits, block=block_len, scales=as_bytes(scales), data=as_bytes(q))
        return wire

    per_value = (bits / 8 + (0 if block_len == 0 else 4 / block_len)) / 4
    return Codec(name, encode, int8_decode if bits == 8 else int4_decode, per_value)


def int8_codec(block: int | None = None, stochastic: bool = False) -> Codec:
    """``int8``: one signed byte a value and a float32 scale per tensor or per ``block`` values.

    ``scale = max(max |x| / 127, 2**-126)`` over the block (sent on the wire). Deterministic
    rounding (the default, and always when ``encode`` gets ``rng=None``):
    ``|x - decode(x)| <= scale * (1/2 + 2**-14)`` (the 2**-14 covers float32 rounding).
    Stochastic rounding (``stochastic=True`` and an ``rng``): ``|x - decode(x)| < scale *
    (1 + 2**-14)`` and ``E[decode(x)] = x``. Non-finite input raises CodecError.
    """
    return _int_codec("int8", 8, block, stochastic)


def int4_codec(block: int | None = None, stochastic: bool = False) -> Codec:
    """``int4``: two values a byte, ``scale = max(max |x| / 7, 2**-126)``; the same bounds as
    ``int8``: ``|err| <= scale * (1/2 + 2**-14)`` deterministic, ``< scale * (1 + 2**-14)`` and
    unbiased stochastic."""
    return _int_codec("int4", 4, block, stochastic)


def _pack_nibbles(u: np.ndarray) -> np.ndarray:
    """Bytes holding ``u[2j]`` in the low and ``u[2j + 1]`` in the high nibble."""
    if u.size % 2:
        u = np.append(u, np.uint8(8))  # an odd tail pads with the code for zero
    pairs = u.view("<u2")  # low byte = even element, high byte = odd element
    packed = np.right_shift(pairs, 4)
    np.bitwise_or(packed, pairs, out=packed)  # low byte: even | odd << 4
    low: np.ndarray = packed.astype(np.uint8)  # drop the high byte
    return low


def _read_int_fields(wire: Mapping[str, Any], name: str, bits: int) -> tuple[int, int, np.ndarray]:
    check_fields(wire, name, ("bits", "block", "scales", "data"))
    n = size_of(read_shape(wire))
    read_choice(wire, "bits", name, (bits,))
    block = read_int(wire, "block", name, 0, 2**31 - 1)
    if 0 < block < MIN_BLOCK:
        raise CodecError(f"{name}: block must be 0 or >= {MIN_BLOCK}, got {block}")
    return n, block, read_scales(wire, name, _n_blocks(n, block))


def int8_decode(wire: Mapping[str, Any]) -> np.ndarray:
    """Decode an ``int8`` wire tensor, checking every field against the header."""
    n, block, scales = _read_int_fields(wire, "int8", 8)
    q = np.frombuffer(read_bytes(wire, "data", "int8", n), dtype=np.int8)
    return _dequantize(q, scales, block, n).reshape(read_shape(wire))


def int4_decode(wire: Mapping[str, Any]) -> np.ndarray:
    """Decode an ``int4`` wire tensor, checking every field against the header."""
    n, block, scales = _read_int_fields(wire, "int4", 4)
    packed = np.frombuffer(read_bytes(wire, "data", "int4", -(-n // 2)), dtype=np.uint8)
    if n % 2 and packed[-1] >> 4 != 8:
        raise CodecError("int4: the padding nibble of an odd-length tensor must be 8 (zero)")
    # Spread each byte's nibbles into the two bytes of a little-endian uint16 (low nibble first);
    # whole-array uint16 ops beat strided uint8 writes (docs/benchmark.md).
    pairs = packed.astype("<u2")
    high = np.left_shift(pairs, 4)
    np.bitwise_and(high, 0x0F00, out=high)
    np.bitwise_and(pairs, 0x0F, out=pairs)
    np.bitwise_or(pairs, high, out=pairs)
    u = pairs.view(np.uint8)
    np.subtract(u, 8, out=u)  # wraps to the two's-complement byte of q
    return _dequantize(u[:n].view(np.int8), scales, block, n).reshape(read_shape(wire))


# --- sign: one bit a value and one scale ---------------------------------------------------------


def sign_codec() -> Codec:
    """``sign``: one bit a value plus ``scale = mean |x|`` (EF-signSGD); decodes to
    ``scale * sign(x)`` (+scale for +0). Bound: ``||x - dec||^2 = ||x||^2 - n * scale^2``, so the
    relative error is at most 1; it is biased and meant to be used with error feedback."""
    return Codec("sign", _sign_encode, sign_decode, 1 / 32)


def _sign_encode(x: np.ndarray, rng: np.random.Generator | None = None) -> WireTensor:
    x = as_f32(x)
    flat = x.reshape(-1)
    scratch = np.empty(min(flat.size, CHUNK), np.float32)
    total = 0.0
    with np.errstate(over="ignore"):  # an overflow is caught and redone just below
        for i in range(0, flat.size, CHUNK):
            part = np.abs(flat[i : i + CHUNK], out=scratch[: flat[i : i + CHUNK].size])
            total += float(np.dot(part, _ONES[: part.size]))  # BLAS, faster than np.sum
    if not math.isfinite(total) and np.isfinite(flat).all():
        # float32 accumulation overflowed near the float32 limit: redo it in float64 (rare).
        total = float(np.abs(flat).sum(dtype=np.float64))
    scale = total / flat.size if flat.size else 0.0
    if not math.isfinite(scale):
        raise non_finite("sign", "mean |x|", scale)
    wire = header("sign", x.shape)
    bits = np.packbits(np.signbit(flat))
    wire.update(bits=1, scales=as_bytes(np.array([scale], "<f4")), data=as_bytes(bits))
    return wire


def sign_decode(wire: Mapping[str, Any]) -> np.ndarray:
    """Decode a ``sign`` wire tensor, checking every field against the header."""
    check_fields(wire, "sign", ("bits", "scales", "data"))
    shape = read_shape(wire)
    n = size_of(shape)
    read_choice(wire, "bits", "sign", (1,))
    scale_bits = read_scales(wire, "sign", 1).view(np.uint32)[0]
    packed = np.frombuffer(read_bytes(wire, "data", "sign", -(-n // 8)), dtype=np.uint8)
    if n % 8 and packed[-1] & ((1 << (8 - n % 8)) - 1):
        raise CodecError("sign: the padding bits of the last byte must be 0")
    out = np.empty(n, np.uint32)
    for i in range(0, n, CHUNK):  # CHUNK is a multiple of 8: chunks start on a byte
        bits = np.unpackbits(packed[i // 8 : (i + CHUNK) // 8 + 1], count=min(CHUNK, n - i))
        o = out[i : i + bits.size]
        # The wire bit becomes the float's sign bit and the scale its magnitude: exact for any
        # scale (no -2 * scale overflow near the float32 limit).
        np.copyto(o, bits)
        np.left_shift(o, 31, out=o)
        np.bitwise_or(o, scale_bits, out=o)
    return out.view(np.float32).reshape(shape)
