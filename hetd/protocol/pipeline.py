"""The wire messages of pipeline replicas (joint data + model parallelism, docs/policies.md §11):
their field schema and the checks beyond field types. :mod:`hetd.protocol.wire` merges
:data:`SCHEMA` into its own and calls :func:`check` on every decoded message of these types, so
they are as strict as the rest of protocol v1; a v1 peer that never sends or receives them is
unaffected (they are new types, and the new ``push`` fields are optional).

* ``stage`` (daemon → worker): the worker is stage ``stage`` of ``of`` in replica ``replica``,
  generation ``gen``, holding blocks ``[blocks[0], blocks[1])``, with micro-batches of ``micro``
  samples and at most ``inflight`` of them between its forward and its backward; ``prev`` and
  ``next`` are the worker ids of its neighbours (None at the ends).
* ``step`` (daemon → worker): run step ``step`` of the replica on parameter version ``base``:
  ``micro_batches`` micro-batches of ``micro`` samples from shard ``shard`` at sample ``offset``.
* ``abort`` (daemon → worker): forget step ``step`` (nothing of it will be applied); with
  ``dissolve`` the replica generation ends and the worker goes back to data-parallel steps.
* ``act`` / ``gact`` (worker → daemon → worker): micro-batch ``mb``'s activation for the next
  stage, or its gradient for the stage before. The daemon reads the header only and forwards
  the frame's bytes as they came; ``tensor`` is one wire tensor (:mod:`hetd.codecs`).
* ``push`` may carry ``replica``, ``gen``, ``step`` and ``stage`` (all four or none): a stage's
  slice of a replica step's gradient.

Each check returns what is wrong, or None; the wire layer turns it into a ``malformed`` error.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

MAX_STAGES: Final = 64  # stages in one replica
MAX_MICRO: Final = 1 << 16  # samples in a micro-batch, and micro-batches in a step
MAX_INFLIGHT: Final = 1 << 10
MAX_ID: Final = (1 << 63) - 1  # replica, generation, step and worker ids fit an int64
MAX_DIMS: Final = 8  # dimensions of a relayed tensor

_INT = (int,)
_OPT_INT = (int, type(None))
_OPT_STR = (str, type(None))

SCHEMA: Final[dict[str, dict[str, tuple[tuple[type, ...], bool]]]] = {
    "stage": {
        "replica": (_INT, True),
        "gen": (_INT, True),
        "stage": (_INT, True),
        "of": (_INT, True),
        "blocks": ((list,), True),
        "micro": (_INT, True),
        "inflight": (_INT, True),
        "prev": (_OPT_INT, True),
        "next": (_OPT_INT, True),
    },
    "step": {
        "replica": (_INT, True),
        "gen": (_INT, True),
        "step": (_INT, True),
        "base": (_INT, True),
        "micro_batches": (_INT, True),
        "micro": (_INT, True),
        "shard": (_INT, True),
        "offset": (_INT, True),
    },
    "abort": {
        "replica": (_INT, True),
        "gen": (_INT, True),
        "step": (_INT, True),
        "reason": (_OPT_STR, False),
        "dissolve": ((bool,), False),  # the replica generation ends: back to data parallel
    },
    "act": {
        "replica": (_INT, True),
        "gen": (_INT, True),
        "step": (_INT, True),
        "mb": (_INT, True),
        "tensor": ((dict,), True),
    },
}
SCHEMA["gact"] = dict(SCHEMA["act"])

PUSH_FIELDS: Final[dict[str, tuple[tuple[type, ...], bool]]] = {
    "replica": (_OPT_INT, False),
    "gen": (_OPT_INT, False),
    "step": (_OPT_INT, False),
    "stage": (_OPT_INT, False),
}
"""Optional ``push`` fields: which replica step and stage the pushed slice belongs to."""

RELAYED: Final = ("act", "gact")
TO_WORKER: Final = ("stage", "step", "abort")


def _ids(type_: str, body: Mapping[str, Any], names: tuple[str, ...]) -> str | None:
    for name in names:
        value = body.get(name)
        if value is not None and not 0 <= value <= MAX_ID:
            return f"{type_}: {name} must be in [0, 2^63), got {value}"
    return None


def _stage(body: Mapping[str, Any]) -> str | None:
    s, of = body["stage"], body["of"]
    if not 1 <= of <= MAX_STAGES or not 0 <= s < of:
        return f"stage: need 0 <= stage < of <= {MAX_STAGES}, got stage {s} of {of}"
    blocks = body["blocks"]
    if (
        len(blocks) != 2
        or not all(type(b) is int for b in blocks)
        or not 0 <= blocks[0] < blocks[1] <= MAX_ID
    ):
        return f"stage: blocks must be [lo, hi) with 0 <= lo < hi, got {blocks!r}"
    if not 1 <= body["micro"] <= MAX_MICRO:
        return f"stage: micro must be in [1, {MAX_MICRO}]"
    if not 1 <= body["inflight"] <= MAX_INFLIGHT:
        return f"stage: inflight must be in [1, {MAX_INFLIGHT}]"
    if (body["prev"] is None) != (s == 0):
        return "stage: prev is None exactly for stage 0"
    if (body["next"] is None) != (s == of - 1):
        return "stage: next is None exactly for the last stage"
    return _ids("stage", body, ("replica", "gen", "prev", "next"))


def _step(body: Mapping[str, Any]) -> str | None:
    for name in ("micro_batches", "micro"):
        if not 1 <= body[name] <= MAX_MICRO:
            return f"step: {name} must be in [1, {MAX_MICRO}]"
    return _ids("step", body, ("replica", "gen", "step", "base", "shard", "offset"))


def _tensor(type_: str, tensor: Mapping[str, Any]) -> str | None:
    """The header of a relayed tensor (its bytes are the receiver's to decode)."""
    if not isinstance(tensor.get("codec"), str) or tensor.get("dtype") != "float32":
        return f"{type_}: tensor needs a codec name and dtype 'float32'"
    shape = tensor.get("shape")
    if (
        not isinstance(shape, list)
        or len(shape) > MAX_DIMS
        or not all(type(d) is int and 0 <= d <= MAX_ID for d in shape)
    ):
        return f"{type_}: tensor shape must be a list of at most {MAX_DIMS} sizes >= 0"
    if len(tensor) > 16 or not all(isinstance(k, str) for k in tensor):
        return f"{type_}: tensor must be a small map of named fields"
    return None


def _relayed(type_: str, body: Mapping[str, Any]) -> str | None:
    if not 0 <= body["mb"] < MAX_MICRO:
        return f"{type_}: mb must be in [0, {MAX_MICRO})"
    return _ids(type_, body, ("replica", "gen", "step")) or _tensor(type_, body["tensor"])


def check_push(body: Mapping[str, Any]) -> str | None:
    """A push's replica fields: all four or none, each in range."""
    present = [name for name in PUSH_FIELDS if body.get(name) is not None]
    if present and len(present) != len(PUSH_FIELDS):
        return f"push: replica, gen, step and stage come together (got only {present})"
    if present and body["stage"] >= MAX_STAGES:
        return f"push: stage must be below {MAX_STAGES}"
    return _ids("push", body, tuple(PUSH_FIELDS))


def check(type_: str, body: Mapping[str, Any]) -> str | None:
    """What is wrong with a message of one of these types whose field types are right."""
    if type_ == "stage":
        return _stage(body)
    if type_ == "step":
        return _step(body)
    if type_ == "abort":
        return _ids("abort", body, ("replica", "gen", "step"))
    if type_ in RELAYED:
        return _relayed(type_, body)
    if type_ == "push":
        return check_push(body)
    return None
