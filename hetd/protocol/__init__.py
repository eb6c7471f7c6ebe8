"""Wire protocol v1: message framing, typed messages in both directions, and the worker's plan.

What the other rooms use, re-exported here: framing and strict validation (:mod:`.wire`:
:func:`encode`, :func:`decode`, :class:`Message`, :class:`ProtocolError`, :func:`error_frame`,
:func:`chunks`, :class:`Reassembler`); the typed messages at the engine's boundary
(:mod:`.messages`: the inputs :class:`JoinIn` and :class:`PushIn`, the replies :class:`Welcome`,
:class:`Ack`, :class:`ErrorReply`, :class:`PlanUpdate`, :class:`ShardUpdate`,
:class:`ProfileRequest`, :class:`Bye`, their union :data:`Reply`); the worker's plan and how a
worker reads it (:mod:`.plan`: :class:`Plan`, :func:`codec_for`, :func:`local_steps_for`,
:func:`data_range`); the parameters a worker holds and the ``params`` frames that change them
(:mod:`.params`: :class:`Held`, :func:`apply_params`, :func:`full_frame`, :func:`param_hash`,
:func:`hash_matches`, :func:`with_hash`); aligned decoding (:func:`decode_aligned`); the
shared-memory rings (:mod:`.shm`: :class:`Ring`, :class:`RingReader`, :class:`ShmError`); the
pipeline messages' checks (:mod:`.pipeline`); the endpoints' header (:mod:`.endpoints`).

The names load lazily, on first use: importing ``hetd.protocol`` or one light submodule (the
sessions' auth imports :mod:`.endpoints` while the daemon starts) imports neither msgpack, numpy
nor the policies. Import from the submodules inside ``hetd``; the package is for users and
other rooms that want one place to look.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hetd.protocol.aligned import decode_aligned
    from hetd.protocol.endpoints import ADMIN_ENDPOINT, ENDPOINT_HEADER, WORKER_ENDPOINT
    from hetd.protocol.messages import (
        EMULATED_LINK,
        Ack,
        AckStatus,
        Bye,
        ErrorReply,
        JoinIn,
        PlanUpdate,
        ProfileRequest,
        PushIn,
        Reply,
        ShardUpdate,
        Welcome,
    )
    from hetd.protocol.params import (
        Held,
        apply_params,
        full_frame,
        full_frame_into,
        hash_matches,
        param_hash,
        params_envelope,
        with_hash,
    )
    from hetd.protocol.plan import Plan, codec_for, data_range, local_steps_for
    from hetd.protocol.shm import Ring, RingReader, ShmError
    from hetd.protocol.wire import (
        Message,
        ProtocolError,
        Reassembler,
        chunks,
        decode,
        encode,
        error_frame,
        validate,
    )

# name -> the submodule that defines it
_WHERE = {
    "decode_aligned": "aligned",
    **dict.fromkeys(("ADMIN_ENDPOINT", "ENDPOINT_HEADER", "WORKER_ENDPOINT"), "endpoints"),
    **dict.fromkeys(
        (
            "EMULATED_LINK",
            "Ack",
            "AckStatus",
            "Bye",
            "ErrorReply",
            "JoinIn",
            "PlanUpdate",
            "ProfileRequest",
            "PushIn",
            "Reply",
            "ShardUpdate",
            "Welcome",
        ),
        "messages",
    ),
    **dict.fromkeys(
        (
            "Held",
            "apply_params",
            "full_frame",
            "full_frame_into",
            "hash_matches",
            "param_hash",
            "params_envelope",
            "with_hash",
        ),
        "params",
    ),
    **dict.fromkeys(("Plan", "codec_for", "data_range", "local_steps_for"), "plan"),
    **dict.fromkeys(("Ring", "RingReader", "ShmError"), "shm"),
    **dict.fromkeys(
        (
            "Message",
            "ProtocolError",
            "Reassembler",
            "chunks",
            "decode",
            "encode",
            "error_frame",
            "validate",
        ),
        "wire",
    ),
}

__all__ = [
    "ADMIN_ENDPOINT",
    "EMULATED_LINK",
    "ENDPOINT_HEADER",
    "WORKER_ENDPOINT",
    "Ack",
    "AckStatus",
    "Bye",
    "ErrorReply",
    "Held",
    "JoinIn",
    "Message",
    "Plan",
    "PlanUpdate",
    "ProfileRequest",
    "ProtocolError",
    "PushIn",
    "Reassembler",
    "Reply",
    "Ring",
    "RingReader",
    "ShardUpdate",
    "ShmError",
    "Welcome",
    "apply_params",
    "chunks",
    "codec_for",
    "data_range",
    "decode",
    "decode_aligned",
    "encode",
    "error_frame",
    "full_frame",
    "full_frame_into",
    "hash_matches",
    "local_steps_for",
    "param_hash",
    "params_envelope",
    "validate",
    "with_hash",
]


def __getattr__(name: str) -> object:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
