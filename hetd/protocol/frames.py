"""Every protocol v1 message as a typed value, read once from a validated frame.

Owns one frozen record per message type that is not an engine reply (those are
:mod:`hetd.protocol.messages`): the parameters (:class:`Params`, :class:`ParamsRef`), the
shared-memory handshake (:class:`ShmOffer`, :class:`ShmReady`, :class:`PushRef`), the pipeline
frames (:class:`StageOrder`, :class:`StepOrder`, :class:`Abort`, :class:`Act`, :class:`Gact`), and
what a worker sends (:class:`Hello`, :class:`Push`, :class:`Pull`, :class:`ProfileResult`,
:class:`Heartbeat`, :class:`Chunk`). :func:`read` turns a message that
:func:`hetd.protocol.wire.decode` (or :func:`hetd.protocol.aligned.decode_aligned`) checked into
its record, and :func:`decode` does both: after it, nobody reads a field by its name in a dict.

Reading copies nothing: a tensor's ``data`` stays the object the decoder made (``bytes``, or the
read-only ``memoryview`` of an aligned buffer on the shared-memory paths), and the ``tensors``
maps are the decoder's own. Each record's :meth:`~hetd.protocol.messages.MessageBase.encode`
packs its frame again; optional fields that are None are left out of it (but for the few that
each record's ``fields`` names).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from hetd.protocol import shm, wire
from hetd.protocol.messages import MessageBase, Reply, read_reply
from policies.types import Plan

WireTensors = Mapping[str, Mapping[str, Any]]
"""path -> wire tensor (a codec's fields, :mod:`hetd.codecs`), as decoded."""


def _some(**fields: Any) -> dict[str, Any]:
    """The fields whose value is not None (optional fields travel only when set)."""
    return {k: v for k, v in fields.items() if v is not None}


# --- daemon -> worker -------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Params(MessageBase):
    """Parameters: a full set of ``version``, or a delta from version ``base`` to it (empty:
    "go on with what you have"). ``hash``: a full frame's parameter hash (:mod:`.params`)."""

    type: ClassVar[str] = "params"
    version: int
    full: bool
    tensors: WireTensors
    base: int | None = None
    plan: Plan | None = None
    hash: str | None = None

    def fields(self) -> dict[str, Any]:
        """The params frame's wire fields."""
        plan = None if self.plan is None else self.plan.to_wire()
        return {
            "version": self.version,
            "full": self.full,
            **_some(base=self.base),
            "tensors": self.tensors,
            **_some(plan=plan, hash=self.hash),
        }


@dataclass(frozen=True, slots=True)
class ParamsRef(MessageBase):
    """A full ``params`` frame of ``version`` in the daemon's shared-memory ring."""

    type: ClassVar[str] = "params_ref"
    version: int
    ref: shm.Ref

    def fields(self) -> dict[str, Any]:
        """The reference's wire fields."""
        return {"version": self.version, **self.ref.fields()}


@dataclass(frozen=True, slots=True)
class ParamsAt(MessageBase):
    """A full release of ``version`` held by the pservers at log ``position``: the worker fetches
    each pserver's slice there (:mod:`hetd.protocol.pslink`'s ``pull``) and checks it against
    ``slices`` (one :func:`hetd.protocol.params.param_hash` per pserver, over its parts' keys),
    then the joined whole against ``hash``."""

    type: ClassVar[str] = "params_at"
    version: int
    position: int
    slices: tuple[str, ...]
    hash: str | None = None

    def fields(self) -> dict[str, Any]:
        """The release's wire fields."""
        return {
            "version": self.version,
            "position": self.position,
            "slices": list(self.slices),
            **_some(hash=self.hash),
        }


@dataclass(frozen=True, slots=True)
class ShmOffer(MessageBase):
    """The daemon's ring, offered to a same-host worker whose hello named ``shm``."""

    type: ClassVar[str] = "shm_offer"
    segment: str

    def fields(self) -> dict[str, Any]:
        """The offer's wire fields."""
        return {"segment": self.segment}


@dataclass(frozen=True, slots=True)
class StageOrder(MessageBase):
    """``stage``: be stage ``stage`` of ``of`` in replica ``replica``, generation ``gen``, holding
    blocks ``[blocks[0], blocks[1])``; ``prev``/``next``: the neighbours' worker ids."""

    type: ClassVar[str] = "stage"
    replica: int
    gen: int
    stage: int
    of: int
    blocks: tuple[int, int]
    micro: int  # samples per micro-batch
    inflight: int  # micro-batches between a forward and its backward
    prev: int | None
    next: int | None

    def fields(self) -> dict[str, Any]:
        """The stage message's wire fields."""
        return {
            "replica": self.replica,
            "gen": self.gen,
            "stage": self.stage,
            "of": self.of,
            "blocks": list(self.blocks),
            "micro": self.micro,
            "inflight": self.inflight,
            "prev": self.prev,
            "next": self.next,
        }


@dataclass(frozen=True, slots=True)
class StepOrder(MessageBase):
    """``step``: run step ``step`` of the replica on version ``base``: ``micro_batches``
    micro-batches of ``micro`` samples from shard ``shard``, starting at sample ``offset``."""

    type: ClassVar[str] = "step"
    replica: int
    gen: int
    step: int
    base: int
    micro_batches: int
    micro: int
    shard: int
    offset: int

    def fields(self) -> dict[str, Any]:
        """The step message's wire fields."""
        return {
            "replica": self.replica,
            "gen": self.gen,
            "step": self.step,
            "base": self.base,
            "micro_batches": self.micro_batches,
            "micro": self.micro,
            "shard": self.shard,
            "offset": self.offset,
        }


@dataclass(frozen=True, slots=True)
class Abort(MessageBase):
    """``abort``: forget step ``step``; ``dissolve``: the replica generation ends too."""

    type: ClassVar[str] = "abort"
    replica: int
    gen: int
    step: int
    reason: str | None = None
    dissolve: bool = False

    def fields(self) -> dict[str, Any]:
        """The abort's wire fields."""
        return {
            "replica": self.replica,
            "gen": self.gen,
            "step": self.step,
            **_some(reason=self.reason),
            **({"dissolve": True} if self.dissolve else {}),
        }


@dataclass(frozen=True, slots=True)
class Act(MessageBase):
    """``act``: micro-batch ``mb``'s activation, for the next stage (relayed by the daemon)."""

    type: ClassVar[str] = "act"
    replica: int
    gen: int
    step: int
    mb: int
    tensor: Mapping[str, Any]  # one wire tensor, its bytes the receiver's to decode

    def fields(self) -> dict[str, Any]:
        """The relayed frame's wire fields."""
        return {
            "replica": self.replica,
            "gen": self.gen,
            "step": self.step,
            "mb": self.mb,
            "tensor": self.tensor,
        }


@dataclass(frozen=True, slots=True)
class Gact(Act):
    """``gact``: micro-batch ``mb``'s gradient, for the stage before."""

    type: ClassVar[str] = "gact"


# --- worker -> daemon -------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Hello(MessageBase):
    """A worker's first message: its name, device, the codecs it decodes and the features it
    takes (:data:`hetd.protocol.wire.WORKER_FEATURES`, ``shm``)."""

    type: ClassVar[str] = "hello"
    id: int
    name: str
    device: Mapping[str, Any]  # short names to plain values (wire-checked)
    codecs: tuple[str, ...]
    features: tuple[str, ...]
    resume: Mapping[str, Any] | None = None  # ``worker_id`` and ``secret`` after a reconnect
    token: str | None = None

    @property
    def request_id(self) -> int:
        """The hello's request id (its welcome answers it)."""
        return self.id

    def fields(self) -> dict[str, Any]:
        """The hello's wire fields."""
        return {
            "name": self.name,
            "device": dict(self.device),
            "codecs": list(self.codecs),
            "features": list(self.features),
            **_some(resume=self.resume, token=self.token),
        }


@dataclass(frozen=True, slots=True)
class Push(MessageBase):
    """An update computed from version ``base``; with ``replica``, ``gen``, ``step`` and
    ``stage``, one pipeline stage's slice of a replica step."""

    type: ClassVar[str] = "push"
    id: int
    base: int
    kind: str  # wire.PUSH_KINDS
    tensors: WireTensors
    samples: int
    steps: int
    compute_s: float
    loss: float | None = None
    free_mem: int | None = None  # bytes
    pull_s: float | None = None
    sent_at: float | None = None  # s, the worker's wall clock when it sent the push
    idle_s: float | None = None
    replica: int | None = None
    gen: int | None = None
    step: int | None = None
    stage: int | None = None

    @property
    def request_id(self) -> int:
        """The push's request id (its ack answers it)."""
        return self.id

    def fields(self) -> dict[str, Any]:
        """The push's wire fields; ``loss`` and ``free_mem`` always (None when unknown, as every
        worker has sent them: the simulator's byte counts rest on it), the rest when set."""
        return {
            "base": self.base,
            "kind": self.kind,
            "tensors": self.tensors,
            "samples": self.samples,
            "steps": self.steps,
            "compute_s": self.compute_s,
            "loss": self.loss,
            "free_mem": self.free_mem,
            **_some(
                pull_s=self.pull_s,
                sent_at=self.sent_at,
                idle_s=self.idle_s,
                replica=self.replica,
                gen=self.gen,
                step=self.step,
                stage=self.stage,
            ),
        }


@dataclass(frozen=True, slots=True)
class PushRef(MessageBase):
    """Push ``id`` lies in the worker's own shared-memory ring."""

    type: ClassVar[str] = "push_ref"
    id: int
    ref: shm.Ref

    @property
    def request_id(self) -> int:
        """The push's request id."""
        return self.id

    def fields(self) -> dict[str, Any]:
        """The reference's wire fields."""
        return self.ref.fields()


@dataclass(frozen=True, slots=True)
class ShmReady(MessageBase):
    """The worker mapped the daemon's ring (``nonce``, read from it, proves it) and made its own
    (``segment``)."""

    type: ClassVar[str] = "shm_ready"
    nonce: str
    segment: str

    def fields(self) -> dict[str, Any]:
        """The answer's wire fields."""
        return {"nonce": self.nonce, "segment": self.segment}


@dataclass(frozen=True, slots=True)
class Pull(MessageBase):
    """Ask for parameters: ``have`` is the version held, None for a full set."""

    type: ClassVar[str] = "pull"
    have: int | None = None

    def fields(self) -> dict[str, Any]:
        """The pull's wire fields (``have`` always present)."""
        return {"have": self.have}


@dataclass(frozen=True, slots=True)
class ProfileResult(MessageBase):
    """What a profile request measured: seconds per sample, per push, per pull, to compress."""

    type: ClassVar[str] = "profile_result"
    result: Mapping[str, Any]

    def fields(self) -> dict[str, Any]:
        """The result's wire fields."""
        return {"result": dict(self.result)}


@dataclass(frozen=True, slots=True)
class Heartbeat(MessageBase):
    """The worker is alive."""

    type: ClassVar[str] = "heartbeat"

    def fields(self) -> dict[str, Any]:
        """No fields."""
        return {}


@dataclass(frozen=True, slots=True)
class Chunk(MessageBase):
    """One piece of a message over the frame cap (either way; :class:`wire.Reassembler`)."""

    type: ClassVar[str] = "chunk"
    seq: int
    last: bool
    data: bytes | memoryview

    def fields(self) -> dict[str, Any]:
        """The chunk's wire fields."""
        return {"seq": self.seq, "last": self.last, "data": self.data}


Pipeline = StageOrder | StepOrder | Abort | Act | Gact
"""The pipeline messages a worker's stage host takes."""

Typed = (
    Reply
    | Params
    | ParamsAt
    | ParamsRef
    | ShmOffer
    | Pipeline
    | Hello
    | Push
    | PushRef
    | ShmReady
    | Pull
    | ProfileResult
    | Heartbeat
    | Chunk
)
"""Any protocol v1 message, typed."""


def _opt_int(value: Any) -> int | None:
    return None if value is None else int(value)


def _opt_float(value: Any) -> float | None:
    return None if value is None else float(value)


def _ref(b: Mapping[str, Any]) -> shm.Ref:
    return shm.Ref(str(b["segment"]), int(b["offset"]), int(b["length"]), int(b["gen"]))


def _ids(b: Mapping[str, Any]) -> tuple[int, int, int]:
    return int(b["replica"]), int(b["gen"]), int(b["step"])


def _params(m: wire.Message, b: Mapping[str, Any]) -> Params:
    plan = b.get("plan")
    return Params(
        int(b["version"]),
        bool(b["full"]),
        b["tensors"],
        _opt_int(b.get("base")),
        None if plan is None else Plan.from_wire(plan),
        b.get("hash"),
    )


def _params_at(m: wire.Message, b: Mapping[str, Any]) -> ParamsAt:
    slices = b["slices"]
    if not all(isinstance(h, str) for h in slices):
        raise TypeError("params_at: slices must be strings")
    return ParamsAt(int(b["version"]), int(b["position"]), tuple(slices), b.get("hash"))


def _stage(m: wire.Message, b: Mapping[str, Any]) -> StageOrder:
    lo, hi = b["blocks"]  # wire-checked: two ints, lo < hi
    return StageOrder(
        int(b["replica"]),
        int(b["gen"]),
        int(b["stage"]),
        int(b["of"]),
        (int(lo), int(hi)),
        int(b["micro"]),
        int(b["inflight"]),
        _opt_int(b["prev"]),
        _opt_int(b["next"]),
    )


def _step(m: wire.Message, b: Mapping[str, Any]) -> StepOrder:
    return StepOrder(
        *_ids(b),
        int(b["base"]),
        int(b["micro_batches"]),
        int(b["micro"]),
        int(b["shard"]),
        int(b["offset"]),
    )


def _hello(m: wire.Message, b: Mapping[str, Any]) -> Hello:
    return Hello(
        m.id,
        str(b["name"]),
        b["device"],
        tuple(b["codecs"]),
        tuple(f for f in b.get("features") or () if isinstance(f, str)),
        b.get("resume"),
        b.get("token"),
    )


def _push(m: wire.Message, b: Mapping[str, Any]) -> Push:
    return Push(
        m.id,
        int(b["base"]),
        str(b["kind"]),
        b["tensors"],
        int(b["samples"]),
        int(b["steps"]),
        float(b["compute_s"]),
        _opt_float(b.get("loss")),
        _opt_int(b.get("free_mem")),
        _opt_float(b.get("pull_s")),
        _opt_float(b.get("sent_at")),
        _opt_float(b.get("idle_s")),
        *(_opt_int(b.get(k)) for k in ("replica", "gen", "step", "stage")),
    )


_READERS: dict[str, Any] = {
    "params": _params,
    "params_at": _params_at,
    "params_ref": lambda m, b: ParamsRef(int(b["version"]), _ref(b)),
    "shm_offer": lambda m, b: ShmOffer(str(b["segment"])),
    "stage": _stage,
    "step": _step,
    "abort": lambda m, b: Abort(*_ids(b), b.get("reason"), bool(b.get("dissolve"))),
    "act": lambda m, b: Act(*_ids(b), int(b["mb"]), b["tensor"]),
    "gact": lambda m, b: Gact(*_ids(b), int(b["mb"]), b["tensor"]),
    "hello": _hello,
    "push": _push,
    "push_ref": lambda m, b: PushRef(m.id, _ref(b)),
    "shm_ready": lambda m, b: ShmReady(str(b["nonce"]), str(b["segment"])),
    "pull": lambda m, b: Pull(_opt_int(b.get("have"))),
    "profile_result": lambda m, b: ProfileResult(b["result"]),
    "heartbeat": lambda m, b: Heartbeat(),
    "chunk": lambda m, b: Chunk(int(b["seq"]), bool(b["last"]), b["data"]),
}


def read(msg: wire.Message) -> Typed:
    """The typed message ``msg`` is (as :func:`hetd.protocol.wire.decode` checked it). A field the
    wire's schema does not check deeply (a nested map, say) that is missing or of the wrong kind
    raises :class:`hetd.protocol.wire.ProtocolError` (``malformed``), never another error."""
    try:
        reply = read_reply(msg)
        if reply is not None:
            return reply
        reader = _READERS.get(msg.type)
        if reader is None:  # a type wire.SCHEMA has and this table lacks: a bug here, not input
            raise wire.ProtocolError("unknown_type", f"no typed form of {msg.type!r}", msg.id)
        typed: Typed = reader(msg, msg.body)
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise wire.ProtocolError(
            "malformed", f"{msg.type}: {type(exc).__name__}: {exc}", msg.id
        ) from None
    return typed


def as_params(msg: Params | wire.Message) -> Params:
    """A ``params`` message typed (read when it comes as :func:`hetd.protocol.wire.decode` gave
    it); :class:`hetd.protocol.wire.ProtocolError` for another message."""
    typed = msg if isinstance(msg, Params) else read(msg)
    if not isinstance(typed, Params):
        raise wire.ProtocolError("unexpected", f"a params message was expected, not {typed.type}")
    return typed


def decode(data: bytes | bytearray | memoryview, max_size: int = wire.DEFAULT_MAX_FRAME) -> Typed:
    """Unpack, validate and type one frame; :class:`hetd.protocol.wire.ProtocolError` saying what
    was wrong."""
    return read(wire.decode(data, max_size))
