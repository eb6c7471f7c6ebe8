"""Wire protocol v1: the messages between daemon and workers, and their msgpack framing.

Every frame is one msgpack map ``{"v": 1, "type": ..., "id": request id, ...fields}`` sent as a
binary websocket message. Decoding is strict: the envelope, the message type and each field's type
are checked against :data:`SCHEMA`; anything else raises :class:`ProtocolError` with a code and a
message saying what was wrong. No pickle, no extension types, no ``assert`` on input.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Final, TypeVar

import msgpack

from hetd.protocol import pipeline
from hetd.protocol.text import clip

PROTOCOL_VERSION: Final = 1
DEFAULT_MAX_FRAME: Final = 64 * 1024 * 1024  # bytes; aiohttp's max_msg_size is set from this


class ProtocolError(ValueError):
    """A frame that breaks protocol v1. ``code`` is a short machine-readable reason."""

    def __init__(self, code: str, message: str, id_: int = 0) -> None:
        message = clip(message, MAX_ERROR_TEXT)  # it may quote what a peer sent: logged, replied
        super().__init__(message)
        self.code = code
        self.message = message
        self.id = id_  # the request id of the offending message, when it could be read


MAX_ERROR_TEXT: Final = 500  # characters of a ProtocolError's message


_NUM = (int, float)
_OPT_NUM = (int, float, type(None))
_OPT_INT = (int, type(None))
_OPT_STR = (str, type(None))
_OPT_MAP = (dict, type(None))

_REF: Final[dict[str, tuple[tuple[type, ...], bool]]] = {
    "segment": ((str,), True),
    "offset": ((int,), True),
    "length": ((int,), True),
    "gen": ((int,), True),
}

# type -> field -> (accepted python types, required). Fields not listed are rejected.
SCHEMA: Final[dict[str, dict[str, tuple[tuple[type, ...], bool]]]] = {
    # worker -> daemon
    "hello": {
        "token": (_OPT_STR, False),
        "name": ((str,), True),
        "device": ((dict,), True),
        "codecs": ((list,), True),
        "resume": (_OPT_MAP, False),
        # the optional fields and messages it takes (WORKER_FEATURES, "shm"); none: v1's base
        "features": ((list, type(None)), False),
    },
    "pull": {"have": (_OPT_INT, False)},
    "push": {
        "base": ((int,), True),
        "kind": ((str,), True),
        "tensors": ((dict,), True),
        "samples": ((int,), True),
        "steps": ((int,), True),
        "compute_s": (_NUM, True),
        "loss": (_OPT_NUM, False),
        "free_mem": (_OPT_INT, False),
        "pull_s": (_OPT_NUM, False),
        "sent_at": (_OPT_NUM, False),
        "idle_s": (_OPT_NUM, False),
        **pipeline.PUSH_FIELDS,  # a pipeline stage's slice of a replica step (all four or none)
    },
    "profile_result": {"result": ((dict,), True)},
    # either way: one piece of a message larger than the websocket frame cap (see chunks())
    "chunk": {"seq": ((int,), True), "last": ((bool,), True), "data": ((bytes,), True)},
    "heartbeat": {},
    "bye": {"reason": (_OPT_STR, False)},
    # same-host shared memory (protocol.shm), only with a worker whose hello named "shm":
    # the daemon names its ring; the worker proves it mapped it (the nonce in its header) and
    # names its own; then big frames travel as references to a slot of the sender's ring
    "shm_offer": {"segment": ((str,), True)},  # daemon -> worker
    "shm_ready": {"nonce": ((str,), True), "segment": ((str,), True)},  # worker -> daemon
    "params_ref": {"version": ((int,), True), **_REF},  # daemon -> worker: a params frame
    "push_ref": _REF,  # worker -> daemon: a push frame (the ref's id is the push's)
    # daemon -> worker
    "welcome": {
        "worker_id": ((int,), True),
        "model": ((dict,), True),
        "dataset": ((dict,), True),
        "shard": ((dict,), True),
        "plan": ((dict,), True),
        "heartbeat_s": (_NUM, True),
        "train": ((dict,), True),
        "secret": (_OPT_STR, False),
        "pservers": (_OPT_MAP, False),  # {map, addrs}: where a push's parts go (feature)
    },
    "params": {
        "version": ((int,), True),
        "full": ((bool,), True),
        "base": (_OPT_INT, False),
        "tensors": ((dict,), True),
        "plan": (_OPT_MAP, False),
        "hash": (_OPT_STR, False),  # full frames: the version's hash (protocol.params)
    },
    # with pservers, to a worker whose hello named "pulls": a full release of ``version`` that
    # stands at log ``position``; the worker fetches each pserver's slice there (protocol.pslink)
    "params_at": {
        "version": ((int,), True),
        "position": ((int,), True),
        # each pserver's slice hash, in pserver order (none: each pserver's answer carries it)
        "slices": ((list,), True),
        "hash": (_OPT_STR, False),  # the whole version's hash (protocol.params)
    },
    "ack": {
        "version": ((int,), True),
        "status": ((str,), True),
        "reason": (_OPT_STR, False),
        "plan": (_OPT_MAP, False),
    },
    "plan": {"plan": ((dict,), True)},
    # a user's Task: the data is cut again after a join or a leave (feature "reshard")
    "shard": {"index": ((int,), True), "count": ((int,), True)},
    "profile": {"spec": ((dict,), True)},
    "error": {"code": ((str,), True), "message": ((str,), True)},
    # pipeline replicas: stage, step, abort (daemon -> worker), act, gact (relayed worker to worker)
    **pipeline.SCHEMA,
}

ACK_STATUSES: Final = ("applied", "buffered", "dropped", "duplicate")
# Optional fields a worker can take, named in its hello's ``features``; the daemon sends a field
# only to workers that name it (a strict decoder refuses fields it does not know; docs/design.md,
# "Compatibility across 0.x"): "hash": full ``params`` frames carry the version's parameter hash; "stages": it runs pipeline
# stages (``stage``/``step``/``abort``, ``act``/``gact``): only such a worker is put in a replica;
# "reshard": it takes a ``shard`` message (its part of a Task's data, cut again when workers come
# and go); "pservers": it sends each push's parts to the pservers the welcome names (a daemon
# that runs pservers welcomes no other worker); "pulls": it takes a ``params_at`` (a release that
# names a log position: it fetches each slice from its pserver, checks each slice's hash and the
# whole's); "headers": when the welcome's ``pservers`` says ``headers``, it sends the daemon each
# push without its tensors (``tensors`` {}), which only its parts carry (such a daemon, whose
# pservers hold the parameters, welcomes no other worker).
WORKER_FEATURES: Final = ("hash", "stages", "reshard", "pservers", "pulls", "headers")
PUSH_KINDS: Final = ("grad", "delta")


@dataclass(frozen=True, slots=True)
class Message:
    """One decoded, validated message: its type, request id and fields."""

    type: str
    id: int
    body: dict[str, Any]

    def __getitem__(self, key: str) -> Any:
        return self.body[key]

    def get(self, key: str, default: Any = None) -> Any:
        return self.body.get(key, default)


def encode(type_: str, id_: int = 0, **fields: Any) -> bytes:
    """Pack one message. Tensor ``data`` may be a ``memoryview`` (packed without a copy)."""
    if type_ not in SCHEMA:
        raise ProtocolError("unknown_type", f"cannot encode unknown message type {type_!r}")
    msg: dict[str, Any] = {"v": PROTOCOL_VERSION, "type": type_, "id": id_}
    msg.update(fields)
    packed: bytes = msgpack.packb(msg, use_bin_type=True)
    return packed


ZERO_COPY_MIN: Final = 64 * 1024  # bytes values at least this big are not copied by pack_parts


@dataclass(frozen=True, slots=True)
class Parts:
    """A message packed as segments whose concatenation is exactly its msgpack frame (what
    :func:`encode` gives, byte for byte): large ``bytes`` values stay the caller's buffers.
    ``offsets[i]``: where the i-th such buffer starts in the frame."""

    segments: tuple[bytes | bytearray | memoryview, ...]
    offsets: tuple[int, ...]
    nbytes: int

    def join(self) -> bytes:
        """The frame: one copy of every segment, nothing else."""
        return b"".join(self.segments)


def pack_parts(type_: str, id_: int = 0, **fields: Any) -> Parts:
    """Pack one message like :func:`encode`, but leave each ``bytes``-like value of
    :data:`ZERO_COPY_MIN` bytes or more as its own segment (preceded by its msgpack ``bin``
    header) instead of copying it into a packer's buffer: a params frame is joined once from the
    snapshot's memory, and a sender can hand the segments to its transport as they are."""
    if type_ not in SCHEMA:
        raise ProtocolError("unknown_type", f"cannot encode unknown message type {type_!r}")
    msg: dict[str, Any] = {"v": PROTOCOL_VERSION, "type": type_, "id": id_}
    msg.update(fields)
    packing = _Packing()
    packing.add(msg)
    return packing.parts()


def pack_value(obj: Any, min_bytes: int = ZERO_COPY_MIN) -> Parts:
    """Any msgpack-able value packed as :func:`pack_parts` packs a message: exactly
    ``msgpack.packb(obj)`` as segments, each ``bytes``-like value of ``min_bytes`` or more left
    as the caller's buffer (a record written to a file as it came off a socket)."""
    packing = _Packing(min_bytes)
    packing.add(obj)
    return packing.parts()


class _Packing:
    """The state of one :func:`pack_parts`. An object, not a closure calling itself: such a
    closure is a reference cycle (the function, its cell) holding every segment, so each packed
    frame's tensors (at 100M parameters, a whole model) stayed alive until the cyclic garbage
    collector ran (the daemon's RSS sawtooth, docs/benchmark.md)."""

    def __init__(self, min_bytes: int = ZERO_COPY_MIN) -> None:
        self.min_bytes = min_bytes
        self.packer = msgpack.Packer(use_bin_type=True)
        self.segments: list[bytes | bytearray | memoryview] = []
        self.offsets: list[int] = []
        self.small = bytearray()
        self.size = 0

    def add(self, obj: Any) -> None:
        if isinstance(obj, dict):
            self.small += self.packer.pack_map_header(len(obj))
            for k, v in obj.items():
                self.small += self.packer.pack(k)
                self.add(v)
        elif isinstance(obj, list | tuple):
            self.small += self.packer.pack_array_header(len(obj))
            for v in obj:
                self.add(v)
        elif isinstance(obj, bytes | bytearray | memoryview) and _nbytes(obj) >= self.min_bytes:
            n = _nbytes(obj)
            self.small += (
                b"\xc6" + n.to_bytes(4, "big") if n >= 1 << 16 else b"\xc5" + n.to_bytes(2, "big")
            )
            self.size += len(self.small)
            self.segments.append(bytes(self.small))
            self.small = bytearray()
            self.offsets.append(self.size)
            self.segments.append(obj)
            self.size += n
        else:
            self.small += self.packer.pack(obj)

    def parts(self) -> Parts:
        if self.small:
            self.segments.append(bytes(self.small))
            self.size += len(self.small)
            self.small = bytearray()
        return Parts(tuple(self.segments), tuple(self.offsets), self.size)


def _nbytes(buf: bytes | bytearray | memoryview) -> int:
    return buf.nbytes if isinstance(buf, memoryview) else len(buf)


def _reject_ext(code: int, data: bytes) -> Any:
    raise ValueError(f"extension type {code} is not allowed")


def decode(frame: bytes | bytearray | memoryview, max_size: int = DEFAULT_MAX_FRAME) -> Message:
    """Unpack and validate one frame; raises :class:`ProtocolError` saying what was wrong."""
    if len(frame) > max_size:
        raise ProtocolError("too_large", f"frame of {len(frame)} bytes exceeds the {max_size} cap")
    try:
        raw = msgpack.unpackb(
            frame,
            raw=False,
            strict_map_key=True,
            max_bin_len=max_size,
            max_str_len=1 << 20,
            max_array_len=1 << 20,
            max_map_len=1 << 20,
            max_ext_len=0,
            ext_hook=_reject_ext,
        )
    except Exception as exc:  # msgpack raises several unrelated types on garbage
        raise ProtocolError("malformed", f"frame is not valid msgpack: {exc}") from None
    if not isinstance(raw, dict):
        raise ProtocolError("malformed", f"frame must be a map, got {type(raw).__name__}")
    return validate(raw)


def validate(raw: Mapping[str, Any]) -> Message:
    """Check the envelope and fields of an unpacked message. A :class:`ProtocolError` carries the
    message's request id whenever the id itself is an int (0 otherwise)."""
    id_ = raw.get("id")
    try:
        return _validate(raw)
    except ProtocolError as exc:
        if isinstance(id_, int) and not isinstance(id_, bool) and not exc.id:
            raise ProtocolError(exc.code, exc.message, id_) from None
        raise


def _validate(raw: Mapping[str, Any]) -> Message:
    version = raw.get("v")
    if type(version) is not int or version != PROTOCOL_VERSION:
        raise ProtocolError(
            "bad_version",
            f"protocol version {version!r} is not supported (this side speaks"
            f" {PROTOCOL_VERSION}): a worker and its daemon must speak the same protocol version",
        )
    type_ = raw.get("type")
    if not isinstance(type_, str) or type_ not in SCHEMA:
        raise ProtocolError(
            "unknown_type", f"unknown message type {type_!r}; known: {', '.join(sorted(SCHEMA))}"
        )
    id_ = raw.get("id")
    if not isinstance(id_, int) or isinstance(id_, bool):
        raise ProtocolError("malformed", f"{type_}: request id must be an int, got {id_!r}")
    schema = SCHEMA[type_]
    body = {k: v for k, v in raw.items() if k not in ("v", "type", "id")}
    unknown = sorted(map(repr, set(body) - set(schema)))
    if unknown:
        raise ProtocolError("malformed", f"{type_}: unknown fields {unknown}")
    for field, (types, required) in schema.items():
        if field not in body:
            if required:
                raise ProtocolError("malformed", f"{type_}: missing field {field!r}")
            continue
        value = body[field]
        # bool is an int subclass: only accept it where bool is listed.
        if (isinstance(value, bool) and bool not in types) or not isinstance(value, types):
            names = "/".join(t.__name__ for t in types)
            raise ProtocolError(
                "malformed", f"{type_}: field {field!r} must be {names}, got {type(value).__name__}"
            )
    if type_ == "hello":
        _check_hello(body)
    if type_ == "chunk" and body["seq"] < 0:
        raise ProtocolError("malformed", "chunk: seq must be >= 0")
    if type_ == "push":
        if body["kind"] not in PUSH_KINDS:
            raise ProtocolError("malformed", f"push: kind must be one of {PUSH_KINDS}")
        if body["samples"] < 0 or body["steps"] < 1 or not 0 <= body["compute_s"] < math.inf:
            raise ProtocolError("malformed", "push: samples >= 0, steps >= 1, 0 <= compute_s < inf")
        for name in ("loss", "pull_s", "sent_at", "idle_s"):
            value = body.get(name)
            if value is not None and not math.isfinite(value):
                raise ProtocolError("malformed", f"push: {name} must be finite, got {value!r}")
    wrong = pipeline.check(type_, body)
    if wrong is not None:
        raise ProtocolError("malformed", wrong)
    return Message(type_, id_, body)


CHUNK_OVERHEAD: Final = 64  # bytes a chunk frame adds around its piece (envelope, seq, headers)
MAX_MESSAGE: Final = (1 << 32) - 1  # the largest message chunks may carry (msgpack bin32)


_Frame = TypeVar("_Frame", bound=bytes | memoryview)


def chunks(frame: _Frame, cap: int) -> Iterator[_Frame | bytes]:
    """The frames that carry ``frame`` over a link whose frame cap is ``cap``: the frame itself
    when it fits, else ``chunk`` messages (``seq`` 0, 1, ..., the last with ``last`` true) each at
    most ``cap`` bytes, whose ``data`` joined is the frame."""
    if len(frame) <= cap:
        yield frame
        return
    if cap <= CHUNK_OVERHEAD:
        raise ValueError(f"a frame cap of {cap} bytes leaves no room for a chunk")
    piece = cap - CHUNK_OVERHEAD
    view = memoryview(frame)
    count = -(-len(frame) // piece)
    for i in range(count):
        data = view[i * piece : (i + 1) * piece]
        yield encode("chunk", 0, seq=i, last=i == count - 1, data=data)


class Reassembler:
    """Joins the ``chunk`` messages of one peer back into the message they carry, in order, up to
    ``max_bytes``. A chunk out of order or a message over ``max_bytes`` raises
    :class:`ProtocolError` once, drops what was gathered and ignores the rest of that message
    (until the next ``seq`` 0, which always starts a new one)."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._parts: list[bytes] = []
        self._size = 0
        self._skipping = False

    @property
    def pending(self) -> int:
        """Bytes gathered for a message not yet complete."""
        return self._size

    def feed(self, msg: Message) -> bytes | None:
        """Take one validated ``chunk``; the whole message's frame once its last chunk came."""
        seq, data = msg["seq"], msg["data"]
        if seq == 0:
            self._parts, self._size, self._skipping = [], 0, False
        elif self._skipping:
            return None
        if seq != len(self._parts):
            self._drop()
            raise ProtocolError(
                "malformed", f"chunk {seq} out of order (expected {len(self._parts)}); dropped"
            )
        self._size += len(data)
        if self._size > self.max_bytes:
            self._drop()
            raise ProtocolError(
                "too_large", f"chunked message over the {self.max_bytes}-byte cap; dropped"
            )
        self._parts.append(data)
        if not msg["last"]:
            return None
        whole = b"".join(self._parts)
        self._parts, self._size = [], 0
        return whole

    def _drop(self) -> None:
        self._parts, self._size, self._skipping = [], 0, True


def error_frame(code: str, message: str, id_: int = 0) -> bytes:
    """An ``error`` message."""
    return encode("error", id_, code=code, message=message)


_SCALAR = (str, int, float, bool, type(None))


def _check_hello(body: Mapping[str, Any]) -> None:
    """A hello's name, device description and codec list hold plain values only (they are shown
    to operators as JSON and compared by name)."""
    if not 0 < len(body["name"]) <= 200:
        raise ProtocolError("malformed", "hello: name must be 1-200 characters")
    device = body["device"]
    if len(device) > 32 or not all(
        isinstance(k, str)
        and len(k) <= 64
        and isinstance(v, _SCALAR)
        and (not isinstance(v, str) or len(v) <= 200)
        for k, v in device.items()
    ):
        raise ProtocolError(
            "malformed",
            "hello: device must map at most 32 short names to short strings or numbers",
        )
    codecs = body["codecs"]
    if len(codecs) > 64 or not all(isinstance(c, str) and len(c) <= 64 for c in codecs):
        raise ProtocolError("malformed", "hello: codecs must be a list of codec names")
