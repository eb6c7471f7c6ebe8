"""The partition map: which pserver owns which tensor, or which rows of a big one.

A model's flat ``path -> array`` map is cut into *parts*: a tensor under ``2 · block_bytes``
is one part; a bigger one is cut along its first axis into blocks of about ``block_bytes`` each
(4 MiB by default, a million float32 values: the size BytePS and MXNet settled on, below which
the cost per message outweighs the balance gained). Cutting by rows keeps each block's number of
dimensions, so an optimizer mask that looks at ``ndim`` still reads the block as it reads the
tensor. The parts depend only on the shapes, never on the number of pservers, so a
checkpoint written per part can be loaded under another S. The parts go to the S pservers by
longest-processing-time: largest first, each to the least-loaded pserver (ties to the lowest
index), which keeps the heaviest pserver's bytes within one part of the mean.

Everything here is a pure function of its arguments: the same shapes and S give the same map in
every process. :meth:`PartitionMap.to_dict` is a msgpack-able plain value (a welcome can carry
it); :meth:`PartitionMap.from_dict` checks one strictly, as anything read off the wire.
:func:`split` cuts a flat map of parameters or updates into S slices keyed by part, and
:func:`join` puts slices back together, bit for bit.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from hetd.core.store import Int8
from hetd.protocol.pslink import part_key, uncovered

FORMAT = 1  # the version of to_dict()'s layout
BLOCK_BYTES = 4 << 20  # 4 MiB: a million float32 values per block


class _Malformed(ValueError):
    """A partition map that reads but says something impossible (raised as it is)."""


@dataclass(frozen=True, slots=True)
class Part:
    """One tensor, or rows ``[start, stop)`` of one, owned by pserver ``server``."""

    path: str
    start: int  # first row along axis 0 (0 for a whole tensor)
    stop: int  # one past the last row (a whole tensor: its rows; 1 for a scalar)
    whole: bool  # the whole tensor (start and stop then cover it)
    server: int  # 0 <= server < S
    nbytes: int  # its bytes in the parameters' dtype

    @property
    def key(self) -> str:
        """The part's name inside a slice: the path for a whole tensor, else path and rows."""
        return part_key(self.path, self.start, self.stop, self.whole)


@dataclass(frozen=True, slots=True)
class PartitionMap:
    """The parts of one model and the pserver of each; build it with :func:`partition`."""

    servers: int  # S
    block_bytes: int  # the block size it was cut with (0: whole tensors only)
    shapes: Mapping[str, tuple[int, ...]]  # path -> shape, in canonical (sorted) order
    dtypes: Mapping[str, str]  # path -> numpy dtype name
    parts: tuple[Part, ...]  # by path, then by rows

    def of(self, server: int) -> tuple[Part, ...]:
        """The parts pserver ``server`` owns, in map order."""
        return tuple(p for p in self.parts if p.server == server)

    def loads(self) -> list[int]:
        """Bytes owned per pserver."""
        out = [0] * self.servers
        for p in self.parts:
            out[p.server] += p.nbytes
        return out

    def imbalance(self) -> float:
        """The heaviest pserver's bytes over the mean (1.0: perfectly even)."""
        loads = self.loads()
        mean = sum(loads) / len(loads)
        return max(loads) / mean if mean else 1.0

    def slice_shapes(self, server: int) -> dict[str, tuple[int, ...]]:
        """``key -> shape`` of pserver ``server``'s slice."""
        return {p.key: _part_shape(self.shapes[p.path], p) for p in self.of(server)}

    def to_dict(self) -> dict[str, Any]:
        """The map as plain values (ints, strings, lists), for msgpack."""
        return {
            "format": FORMAT,
            "servers": self.servers,
            "block_bytes": self.block_bytes,
            "tensors": [[k, list(s), self.dtypes[k]] for k, s in self.shapes.items()],
            "parts": [[p.path, p.start, p.stop, p.whole, p.server] for p in self.parts],
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> PartitionMap:
        """A map read back from :meth:`to_dict`'s value; ValueError, saying what is wrong, unless
        it is well-formed and its parts cover every tensor exactly once, in order."""
        try:
            return _from_dict(d)
        except _Malformed:
            raise
        except (KeyError, TypeError, IndexError, ValueError) as exc:
            raise ValueError(f"malformed partition map: {exc!r}") from exc


def partition(
    shapes: Mapping[str, Sequence[int]],
    servers: int,
    *,
    dtypes: Mapping[str, str] | None = None,
    block_bytes: int = BLOCK_BYTES,
) -> PartitionMap:
    """The partition map of a model's tensors over ``servers`` pservers.

    ``shapes``: path -> shape; ``dtypes``: path -> numpy dtype name (float32 where not given);
    ``block_bytes``: a tensor over twice this is cut into row blocks of about this size; 0 keeps
    every tensor whole (for optimizers that read a whole tensor, :mod:`hetd.pserver.separable`).
    """
    if servers < 1:
        raise ValueError(f"servers must be >= 1, got {servers}")
    if block_bytes < 0:
        raise ValueError(f"block_bytes must be >= 0, got {block_bytes}")
    if not shapes:
        raise ValueError("the model has no tensors")
    canon = {k: tuple(int(d) for d in shapes[k]) for k in sorted(shapes)}
    types = {k: np.dtype((dtypes or {}).get(k, "float32")).name for k in canon}
    pieces: list[tuple[str, int, int, bool, int]] = []  # path, start, stop, whole, nbytes
    for path, shape in canon.items():
        if any(d < 0 for d in shape):
            raise ValueError(f"tensor {path!r} has a negative dimension: {shape}")
        pieces += _cut(path, shape, np.dtype(types[path]).itemsize, block_bytes)
    owner = _lpt([n for *_, n in pieces], servers)
    parts = tuple(
        Part(path, start, stop, whole, owner[i], nbytes)
        for i, (path, start, stop, whole, nbytes) in enumerate(pieces)
    )
    _check_keys(canon, parts)
    return PartitionMap(servers, block_bytes, canon, types, parts)


def _cut(
    path: str, shape: tuple[int, ...], itemsize: int, block_bytes: int
) -> list[tuple[str, int, int, bool, int]]:
    """One tensor's parts: itself, or row blocks of at least about ``block_bytes`` each."""
    rows = shape[0] if shape else 1
    row_bytes = itemsize * math.prod(shape[1:])
    nbytes = rows * row_bytes
    if block_bytes == 0 or not shape or nbytes < 2 * block_bytes or rows < 2:
        return [(path, 0, rows, True, nbytes)]
    k = min(rows, nbytes // block_bytes)  # >= 2 here; each block holds nbytes / k >= block_bytes
    edges = [rows * i // k for i in range(k + 1)]
    return [(path, a, b, False, (b - a) * row_bytes) for a, b in itertools.pairwise(edges)]


def _lpt(sizes: Sequence[int], servers: int) -> list[int]:
    """Largest first, each to the least-loaded server (ties: the lower index); deterministic."""
    loads = [0] * servers
    owner = [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda j: (-sizes[j], j)):
        s = min(range(servers), key=lambda k: (loads[k], k))
        owner[i] = s
        loads[s] += sizes[i]
    return owner


def _check_keys(shapes: Mapping[str, tuple[int, ...]], parts: Sequence[Part]) -> None:
    """No block's key may be another tensor's path (a path may contain anything)."""
    keys = [p.key for p in parts]
    if len(set(keys)) != len(keys):
        clash = sorted(k for k in set(keys) if keys.count(k) > 1)[0]
        raise ValueError(f"part key {clash!r} names two parts; rename the parameter {clash!r}")


def _part_shape(shape: tuple[int, ...], p: Part) -> tuple[int, ...]:
    return shape if p.whole else (p.stop - p.start, *shape[1:])


def _from_dict(d: Mapping[str, Any]) -> PartitionMap:
    if d["format"] != FORMAT:
        raise _Malformed(f"partition map format {d['format']!r}; this hetd reads {FORMAT}")
    servers, block_bytes = d["servers"], d["block_bytes"]
    if not isinstance(servers, int) or servers < 1:
        raise _Malformed(f"partition map: servers must be an int >= 1, got {servers!r}")
    if not isinstance(block_bytes, int) or block_bytes < 0:
        raise _Malformed(f"partition map: block_bytes must be an int >= 0, got {block_bytes!r}")
    shapes: dict[str, tuple[int, ...]] = {}
    types: dict[str, str] = {}
    for path, shape, dtype in d["tensors"]:
        if not isinstance(path, str) or path in shapes:
            raise _Malformed(f"partition map: bad or repeated path {path!r}")
        if not all(isinstance(x, int) and x >= 0 for x in shape):
            raise _Malformed(f"partition map: bad shape {shape!r} for {path!r}")
        shapes[path] = tuple(shape)
        types[path] = np.dtype(str(dtype)).name
    if list(shapes) != sorted(shapes):
        raise _Malformed("partition map: tensors are not in sorted path order")
    parts = []
    for path, start, stop, whole, server in d["parts"]:
        if path not in shapes:
            raise _Malformed(f"partition map: a part of unknown tensor {path!r}")
        if not all(isinstance(x, int) for x in (start, stop, server)) or not isinstance(
            whole, bool
        ):
            raise _Malformed(f"partition map: bad part fields for {path!r}")
        if not 0 <= server < servers:
            raise _Malformed(f"partition map: part of {path!r} on server {server} of {servers}")
        shape = shapes[path]
        row_bytes = np.dtype(types[path]).itemsize * math.prod(shape[1:])
        parts.append(Part(path, start, stop, whole, server, (stop - start) * row_bytes))
    _check_cover(shapes, parts)
    _check_keys(shapes, parts)
    return PartitionMap(servers, block_bytes, shapes, types, tuple(parts))


def _check_cover(shapes: Mapping[str, tuple[int, ...]], parts: Sequence[Part]) -> None:
    """Each tensor's parts, in order: one whole part, or blocks covering its rows exactly."""
    order = [path for path, _ in itertools.groupby(p.path for p in parts)]
    if order != list(shapes):
        raise _Malformed("partition map: the parts do not follow the tensors, one run each")
    path = uncovered(shapes, ((p.path, p.start, p.stop, p.whole) for p in parts))
    if path is not None:
        shape = shapes[path]
        rows = shape[0] if shape else 1
        raise _Malformed(f"partition map: the parts of {path!r} do not cover its {rows} rows")


def _rows(x: Any, start: int, stop: int) -> Any:
    """Rows ``[start, stop)`` of a parameter or update (an :class:`Int8` keeps its one scale)."""
    if isinstance(x, Int8):
        return Int8(x.q[start:stop], x.scale)
    return x[start:stop]


def split(pmap: PartitionMap, flat: Mapping[str, Any]) -> list[dict[str, Any]]:
    """``flat`` (path -> array or :class:`Int8`, the map's paths and shapes) as one slice per
    pserver, ``key -> part``; a block is a view of its tensor's rows where the array allows."""
    if set(flat) != set(pmap.shapes):
        missing = sorted(set(pmap.shapes) - set(flat))[:3]
        extra = sorted(set(flat) - set(pmap.shapes))[:3]
        raise ValueError(
            f"tensors do not match the partition map: missing {missing}, extra {extra}"
        )
    out: list[dict[str, Any]] = [{} for _ in range(pmap.servers)]
    for p in pmap.parts:
        x = flat[p.path]
        got = tuple(x.q.shape if isinstance(x, Int8) else np.shape(x))
        if got != pmap.shapes[p.path]:
            raise ValueError(f"{p.path!r} has shape {got}; the map has {pmap.shapes[p.path]}")
        out[p.server][p.key] = x if p.whole else _rows(x, p.start, p.stop)
    return out


def join(pmap: PartitionMap, slices: Sequence[Mapping[str, Any]]) -> dict[str, np.ndarray]:
    """The slices (one per pserver, as :func:`split` cut them) back as ``path -> array``, in the
    map's order; blocks are concatenated along axis 0, nothing is computed (bit for bit)."""
    if len(slices) != pmap.servers:
        raise ValueError(f"{len(slices)} slices for {pmap.servers} pservers")
    pieces: dict[str, list[np.ndarray]] = {k: [] for k in pmap.shapes}
    for p in pmap.parts:
        if p.key not in slices[p.server]:
            raise ValueError(f"slice {p.server} lacks part {p.key!r}")
        pieces[p.path].append(np.asarray(slices[p.server][p.key]))
    out: dict[str, np.ndarray] = {}
    for path, arrays in pieces.items():
        joined = arrays[0] if len(arrays) == 1 else np.concatenate(arrays, axis=0)
        if joined.shape != pmap.shapes[path]:
            raise ValueError(f"{path!r} joins to {joined.shape}; the map has {pmap.shapes[path]}")
        out[path] = joined
    return out
