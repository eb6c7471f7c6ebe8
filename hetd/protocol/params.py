"""Parameters a worker holds, and how a ``params`` frame changes them.

Owns :class:`Held` and :func:`apply_params`, shared by the real worker (``workers.client``) and the
emulated one (:mod:`hetd.sim.agent`): a full frame replaces what is held; a delta frame adds to the
version it names, and only to that one.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from hetd.codecs import registry as codecs
from hetd.protocol import wire


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
