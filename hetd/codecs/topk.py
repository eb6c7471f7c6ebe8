"""The sparse codec ``topk``: the largest magnitudes, with delta-coded indices.

Owns how ``topk`` picks what to send and its byte layout (little-endian; ``n`` is the element
count of ``shape``):

``topk`` (fields ``count``, ``index_bits``, ``indices``, ``values``)
    ``count`` kept elements (0 <= count <= n); ``indices`` holds ``count`` gaps as uint16 or uint32
    (``index_bits`` 16 or 32): the first is the first kept index, each next one the distance to the
    previous kept index (>= 1), so the indices are strictly increasing and the last is < n.
    ``values`` is a nested wire tensor of shape ``[count]`` in any dense codec (not ``topk``).

The threshold comes from a random sample of |x| and candidates from one chunked compare and
``np.flatnonzero``; only the few candidates are partitioned (a full ``np.argpartition`` is much
slower, docs/benchmark.md). The nested values codec is resolved by :mod:`hetd.codecs.registry`,
which hands this module the encoder and a checked decoder.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
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
    read_shape,
    size_of,
)

SAMPLE = 1 << 14  # |x| samples behind a topk threshold


def topk_codec(k: Any, values: Codec, decode_values: Callable[[Any, int], np.ndarray]) -> Codec:
    """``topk``: keeps the ``round(k * n)`` (at least 1) largest |x|, fewer only when the rest are
    zero; everything kept is >= everything dropped in magnitude. Dropped entries decode to 0; kept
    ones carry the ``values`` codec's own error. The threshold comes from a sample of |x|
    (``rng``, or a fixed seed when ``None``) so no full sort is done. ``decode_values`` decodes
    the nested values tensor (see :func:`topk_decode`)."""
    if (
        not isinstance(k, int | float)
        or isinstance(k, bool)
        or not math.isfinite(k)
        or not 0 < k <= 1
    ):
        raise CodecError(f"topk: k must be a fraction in (0, 1], got {k!r}")
    index_bytes = 2 if k >= 1 / 65536 else 4

    def encode(x: np.ndarray, rng: np.random.Generator | None = None) -> WireTensor:
        x = as_f32(x)
        flat = x.reshape(-1)
        if flat.size and not (
            math.isfinite(float(flat.max())) and math.isfinite(float(flat.min()))
        ):
            raise non_finite("topk", "an element", float(flat[~np.isfinite(flat)][0]))
        keep = 0 if flat.size == 0 else min(flat.size, max(1, round(k * flat.size)))
        idx = _top_indices(flat, keep, rng)
        gaps = np.diff(idx, prepend=0)
        width = 16 if gaps.size == 0 or int(gaps.max()) < 2**16 else 32
        wire = header("topk", x.shape)
        wire.update(
            count=int(idx.size),
            index_bits=width,
            indices=as_bytes(gaps.astype("<u2" if width == 16 else "<u4")),
            values=values.encode(flat[idx], rng),
        )
        return wire

    def decode(wire: Mapping[str, Any]) -> np.ndarray:
        return topk_decode(wire, decode_values)

    return Codec("topk", encode, decode, float(k) * (index_bytes + 4 * values.ratio) / 4)


def _top_indices(flat: np.ndarray, keep: int, rng: np.random.Generator | None) -> np.ndarray:
    """Sorted int64 indices of the ``keep`` largest |flat| (dropping zeros)."""
    n = flat.size
    if keep == 0:
        return np.zeros(0, np.int64)
    if n <= 4 * SAMPLE:
        return _exact_top(flat, keep)
    gen = rng if rng is not None else np.random.default_rng(0)
    sample = np.abs(flat[gen.integers(0, n, SAMPLE)])
    # Aim a little above keep / n so that the sample's noise (std ~ sqrt(p / SAMPLE)) almost never
    # leaves fewer than keep candidates; the surplus is trimmed exactly below.
    frac = keep / n
    aim = min(1.0, 1.2 * frac + 5 * math.sqrt(frac / SAMPLE))
    kth = max(0, SAMPLE - math.ceil(aim * SAMPLE))
    threshold = float(np.partition(sample, kth)[kth])
    if threshold == 0.0:
        cand = np.flatnonzero(flat)  # mostly zeros: every nonzero is a candidate
        if cand.size <= keep:
            return cand.astype(np.int64)
    else:
        cand = _at_least(flat, threshold)
        if cand.size < keep:  # the sample misled us (rare): fall back to the exact answer
            return _exact_top(flat, keep)
    mags = np.abs(flat[cand])
    top = np.argpartition(mags, cand.size - keep)[cand.size - keep :]
    found: np.ndarray = np.sort(cand[top]).astype(np.int64)
    return found


def _at_least(flat: np.ndarray, threshold: float) -> np.ndarray:
    """Indices where |flat| >= threshold, found chunk by chunk without a tensor-sized |x|."""
    scratch = np.empty(min(flat.size, CHUNK), np.float32)
    mask = np.empty(scratch.size, np.bool_)
    found = []
    for i in range(0, flat.size, CHUNK):
        xs = flat[i : i + CHUNK]
        m = mask[: xs.size]
        np.greater_equal(np.abs(xs, out=scratch[: xs.size]), threshold, out=m)
        found.append(np.flatnonzero(m) + i)
    return np.concatenate(found)


def _exact_top(flat: np.ndarray, keep: int) -> np.ndarray:
    mags = np.abs(flat)
    top = np.argpartition(mags, flat.size - keep)[flat.size - keep :]
    top = top[mags[top] > 0]
    return np.sort(top).astype(np.int64)


def topk_decode(
    wire: Mapping[str, Any], decode_values: Callable[[Any, int], np.ndarray]
) -> np.ndarray:
    """Decode a ``topk`` wire tensor; ``decode_values(values_wire, count)`` decodes the nested
    values tensor (checking its codec and that its shape is ``[count]``)."""
    check_fields(wire, "topk", ("count", "index_bits", "indices", "values"))
    shape = read_shape(wire)
    n = size_of(shape)
    count = read_int(wire, "count", "topk", 0, n)
    width = read_choice(wire, "index_bits", "topk", (16, 32))
    raw = read_bytes(wire, "indices", "topk", count * width // 8)
    gaps = np.frombuffer(raw, dtype="<u2" if width == 16 else "<u4")
    if count > 1 and not gaps[1:].all():
        raise CodecError("topk: indices must be strictly increasing (a gap of 0)")
    idx = np.cumsum(gaps, dtype=np.int64)
    if count and idx[-1] >= n:
        raise CodecError(f"topk: index {int(idx[-1])} is out of range for {n} elements")
    vals = decode_values(wire["values"], count)
    out = np.zeros(n, np.float32)
    out[idx] = vals
    return out.reshape(shape)
