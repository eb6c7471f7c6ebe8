"""Ingest: a worker's decoded frames (:func:`hetd.protocol.wire.decode`) turned into the engine's
typed inputs, checked strictly.

Owns :func:`decode_hello` (a hello as a :class:`~hetd.protocol.messages.JoinIn`),
:func:`decode_push` (a push's tensors checked against the model's paths and shapes, their codecs
and their finiteness, as a :class:`~hetd.protocol.messages.PushIn` with the update's norm,
measured in the same pass, for the engine's update guard) and :func:`decode_header` (a push
without tensors, for a head whose pservers take them). Nothing here trusts its input or crashes
on it: what is wrong raises :class:`hetd.protocol.wire.ProtocolError` with a code and a message
saying what, and nothing of a refused push reaches the store. The daemon's sessions and the
simulator both ingest through this module.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from typing import Any

import numpy as np

from hetd.codecs import registry as codecs
from hetd.codecs.tensor import (
    check_fields,
    read_bytes,
    read_choice,
    read_scales,
    read_shape,
    size_of,
)
from hetd.core.store import Int8, Update
from hetd.protocol import wire
from hetd.protocol.messages import JoinIn, PushIn

MAX_INT8_SCALE = float(np.finfo(np.float32).max) / 128  # above it, q * scale may overflow


def decode_hello(msg: wire.Message, same_host: bool = False) -> JoinIn:
    """A validated ``hello`` (the wire checked its fields) as a :class:`JoinIn`. ``same_host``:
    the worker connected over loopback."""
    resume = msg.get("resume") or {}
    old_id = resume.get("worker_id")
    secret = resume.get("secret")
    device = msg["device"]
    free_mem = device.get("free_memory")
    return JoinIn(
        id=msg.id,
        name=msg["name"],
        device=dict(device),
        codecs=tuple(c for c in msg["codecs"] if isinstance(c, str)),
        resume_id=old_id if isinstance(old_id, int) and not isinstance(old_id, bool) else None,
        resume_secret=secret if isinstance(secret, str) and 0 < len(secret) <= 200 else None,
        free_mem=free_mem if isinstance(free_mem, int) else None,
        same_host=same_host,
        features=frozenset(
            f for f in msg.get("features") or () if isinstance(f, str) and f in wire.WORKER_FEATURES
        ),
    )


def decode_push(
    shapes: Mapping[str, tuple[int, ...]],
    wid: int,
    msg: wire.Message,
    nbytes: int,
    *,
    fused: bool = False,
    norm: bool = True,
) -> PushIn:
    """Validate a push's tensors against the model's ``shapes``; raises ProtocolError saying what
    is wrong.

    ``fused`` (the daemon's sessions): an ``int8`` tensor with one scale is checked as strictly
    as :func:`hetd.codecs.registry.decode_tensor` would, but kept as :class:`hetd.core.store.Int8`
    (a view of the frame) for the jitted step to dequantize: no float32 copy is written or scanned.

    ``norm`` false (a daemon whose update guard is off): such ``int8`` views are not scanned for
    the update's norm either (their scale already proves them finite), and ``norm`` is None when
    there are any; every other tensor still gets its one pass, which checks its finiteness.
    """
    wire_tensors = msg["tensors"]
    tensors: dict[str, Update] = {}
    try:
        if fused and isinstance(wire_tensors, dict) and set(wire_tensors) == set(shapes):
            for path, t in wire_tensors.items():
                view = int8_view(t, path, shapes[path])
                if view is not None:
                    tensors[path] = view
        rest = {p: t for p, t in wire_tensors.items() if p not in tensors}
        decoded = codecs.decode_tree(rest, {p: shapes[p] for p in shapes if p not in tensors})
    except codecs.CodecError as exc:
        raise wire.ProtocolError("bad_tensor", str(exc)) from None
    sq = 0.0  # the update's squared norm: one pass per tensor, which also checks finiteness
    for path, t in decoded.items():
        s = _sq_dense(t)
        if not math.isfinite(s) and not np.isfinite(t).all():  # else finite, its square overflows
            raise wire.ProtocolError("not_finite", f"tensor {path!r} holds NaN or Inf; not applied")
        sq += s
    measured = norm or not tensors
    if measured:
        for t in tensors.values():
            sq += _sq(t)
    tensors.update(decoded)
    return _push_in(wid, msg, nbytes, tensors, math.sqrt(sq) if measured else None)


def decode_header(wid: int, msg: wire.Message, nbytes: int) -> PushIn:
    """A push's header, for a head whose pservers hold the parameters (``[pservers] headers``):
    its tensors went to the pservers, in parts, and the frame must carry none. The norm is
    theirs to report (:class:`hetd.server.pserver_parts.PartsWait` fills it in)."""
    if msg["tensors"]:
        raise wire.ProtocolError(
            "malformed",
            "push: this daemon takes push headers only (tensors {}); the update goes to the "
            "pservers in parts",
        )
    return _push_in(wid, msg, nbytes, {}, None)


def _push_in(
    wid: int, msg: wire.Message, nbytes: int, tensors: Mapping[str, Update], norm: float | None
) -> PushIn:
    return PushIn(
        worker=wid,
        id=msg.id,
        base=msg["base"],
        kind=msg["kind"],
        tensors=tensors,
        samples=msg["samples"],
        steps=msg["steps"],
        compute_s=float(msg["compute_s"]),
        loss=None if msg.get("loss") is None else float(msg["loss"]),
        free_mem=msg.get("free_mem"),
        nbytes=nbytes,
        transfer_s=_transfer_s(msg.get("sent_at")),
        idle_s=None if msg.get("idle_s") is None else float(msg["idle_s"]),
        norm=norm,
    )


def update_norm(tensors: Mapping[str, Update]) -> float:
    """The L2 norm of an update over all its tensors (float32 arrays or :class:`Int8` views), as
    :func:`decode_push` measures it: each tensor's squares accumulated in float32 (inf when they
    overflow float32: a step no float32 model survives; NaN when a value is NaN)."""
    return math.sqrt(sum(_sq(t) for t in tensors.values()))


# int8 values widened to float32 at a time, into one reused buffer (no copy of the whole tensor,
# no allocation per piece). Large, because each piece's BLAS call lets go of the GIL, and in the
# daemon a publish runs in another thread: fewer pieces, fewer waits to get it back.
_CHUNK = 1 << 20


def _sq_dense(t: np.ndarray) -> float:
    """Sum of squares of a float32 array: one BLAS pass, no temporary; NaN or inf when a value is
    not finite (or the sum overflows float32)."""
    flat = t.reshape(-1)
    with np.errstate(over="ignore", invalid="ignore"):
        return float(np.dot(flat, flat))


def _sq(t: Update) -> float:
    if not isinstance(t, Int8):
        return _sq_dense(np.asarray(t, np.float32))
    q = t.q.reshape(-1)
    buf = np.empty(min(q.size, _CHUNK), np.float32)
    total = 0.0
    for i in range(0, q.size, _CHUNK):
        part = buf[: min(_CHUNK, q.size - i)]
        np.copyto(part, q[i : i + _CHUNK], casting="unsafe")
        total += float(np.dot(part, part))
    return total * float(t.scale) ** 2


def int8_view(t: Any, path: str, shape: tuple[int, ...]) -> Int8 | None:
    """``t`` as :class:`Int8` when it is an ``int8`` tensor with one scale (``block`` 0), checked
    field by field like the ``int8`` decoder; None for any other codec or block (decoded as
    usual). A scale that would make ``127 * scale`` overflow is refused as non-finite."""
    if not isinstance(t, Mapping) or t.get("codec") != "int8" or type(t.get("block")) is not int:
        return None
    if t["block"] != 0:
        return None
    try:
        check_fields(t, "int8", ("bits", "block", "scales", "data"))
        if t.get("dtype") != "float32":
            raise codecs.CodecError(f"dtype {t.get('dtype')!r} is not 'float32'")
        got = read_shape(t)
        if got != tuple(shape):
            raise codecs.CodecError(f"shape {list(got)} does not match the expected {list(shape)}")
        read_choice(t, "bits", "int8", (8,))
        scale = read_scales(t, "int8", 1)[0]
        data = read_bytes(t, "data", "int8", size_of(got))
    except codecs.CodecError as exc:
        raise codecs.CodecError(f"tensor {path!r}: {exc}") from None
    if not scale <= MAX_INT8_SCALE:
        raise wire.ProtocolError("not_finite", f"tensor {path!r} holds NaN or Inf; not applied")
    return Int8(np.frombuffer(data, dtype=np.int8).reshape(got), np.float32(scale))


def _transfer_s(sent_at: float | None) -> float | None:
    """Send-to-receipt seconds from the worker's wall-clock stamp; None when the clocks disagree
    too much to trust it (workers on other hosts without synchronised clocks)."""
    if sent_at is None:
        return None
    dt = time.time() - sent_at
    return dt if 0.0 < dt < 60.0 else None
