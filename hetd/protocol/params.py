"""Parameters a worker holds, and how a ``params`` frame changes them.

Owns :class:`Held` and :func:`apply_params`, shared by the real worker (``workers.client``) and the
emulated one (:mod:`hetd.sim.agent`): a full frame replaces what is held; a delta frame adds to the
version it names, and only to that one. :func:`param_hash` is the short hash (SHA-256, 64 bits) of a parameter set that
the daemon puts in each full ``params`` frame (field ``hash``) and a worker checks after a full pull.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from hetd.codecs import registry as codecs
from hetd.protocol import wire

HASH_BYTES = 8  # the first 64 bits of SHA-256


def param_hash(tensors: Mapping[str, np.ndarray]) -> str:
    """SHA-256 truncated to 64 bits (16 hex digits) over the parameters as float32, in sorted path
    order; each tensor's path and shape are hashed with its bytes, so a renamed or reshaped tensor
    differs too. The daemon computes it once per published version; a worker after a full pull.
    SHA-256 rather than blake2b: with the CPU's SHA extensions it takes ~2.3 ms per 1M parameters
    against blake2b's ~6.1 ms (a full frame's encode: ~5.8 ms)."""
    h = hashlib.sha256()
    for path in sorted(tensors):
        arr = np.ascontiguousarray(tensors[path], dtype=np.float32)
        h.update(f"{path}\0{arr.shape}\0".encode())
        h.update(arr.data)
    return h.hexdigest()[: 2 * HASH_BYTES]


def hash_matches(held: Held, msg: wire.Message) -> bool | None:
    """Whether parameters applied from a full ``params`` frame are what the daemon published:
    None when there is nothing to check (a delta, which is lossy by design, or no ``hash``)."""
    expected = msg.get("hash")
    if not msg["full"] or expected is None:
        return None
    return bool(param_hash(held.tensors) == expected)


@dataclass(frozen=True, slots=True)
class Held:
    """Parameters a worker holds: a version and its tensors (never changed in place)."""

    version: int
    tensors: Mapping[str, np.ndarray]


def apply_params(held: Held | None, msg: wire.Message) -> Held | None:
    """The parameters after a ``params`` message: full ones replace; a delta adds to the version it
    names, or returns None when that is not the version held."""
    decoded = codecs.decode_tree(msg["tensors"])
    if msg["full"]:
        return Held(msg["version"], decoded)
    if held is None or msg.get("base") != held.version:
        return None
    tensors = dict(held.tensors)
    for path, d in decoded.items():
        if path not in tensors or tensors[path].shape != d.shape:
            return None
        tensors[path] = tensors[path] + d
    return Held(msg["version"], tensors)
