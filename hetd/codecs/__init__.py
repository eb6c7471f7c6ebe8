"""Tensor codecs: how one float32 tensor travels as bytes.

What the other rooms use: the registry by name (:func:`get_codec`, :func:`from_spec`,
:func:`names`, :func:`negotiate`, :func:`register`), a whole parameter tree encoded and decoded
with strict checks (:func:`encode_tree`, :func:`decode_tree`, :func:`decode_tensor`), the
:class:`Codec` record and its :class:`CodecError`, and error feedback for lossy pushes
(:class:`ErrorFeedback`, :func:`encode_with_feedback`). The submodules: :mod:`.registry` (the
registry, ``none``, ``fp16``, ``bf16``), :mod:`.tensor` (a tensor's wire form and checked field
readers), :mod:`.quant` (``int8``, ``int4``, ``sign``), :mod:`.topk` and :mod:`.feedback`.
Importing this package imports numpy and nothing of hetd's other rooms.
"""

from hetd.codecs.feedback import ErrorFeedback, encode_with_feedback
from hetd.codecs.registry import (
    Codec,
    CodecError,
    WireTensor,
    decode_tensor,
    decode_tree,
    encode_tree,
    from_spec,
    get_codec,
    names,
    negotiate,
    payload_nbytes,
    register,
    spec_name,
)

__all__ = [
    "Codec",
    "CodecError",
    "ErrorFeedback",
    "WireTensor",
    "decode_tensor",
    "decode_tree",
    "encode_tree",
    "encode_with_feedback",
    "from_spec",
    "get_codec",
    "names",
    "negotiate",
    "payload_nbytes",
    "register",
    "spec_name",
]
