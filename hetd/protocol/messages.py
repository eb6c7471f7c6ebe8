"""Typed messages across the engine boundary: what a session (or the simulator) hands the engine,
and the control replies the engine sends back through its :class:`hetd.core.engine.Peer`.

Owns the inputs :class:`JoinIn` and :class:`PushIn` (built and validated from worker frames by
:mod:`hetd.core.ingest`) and the replies :class:`Welcome`, :class:`Ack`, :class:`ErrorReply`,
:class:`PlanUpdate`, :class:`ProfileRequest` and :class:`Bye`. Each reply's
:meth:`~MessageBase.encode` gives exactly its protocol v1 frame (:func:`hetd.protocol.wire.encode`);
:meth:`~MessageBase.message` gives the same message as :func:`hetd.protocol.wire.decode` would return
it, without the bytes (the simulator's emulated workers read it). The other messages, parameter
and pipeline frames among them, are typed in :mod:`hetd.protocol.frames`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from hetd.protocol import wire
from policies.types import Plan

AckStatus = Literal["applied", "buffered", "dropped", "duplicate"]  # wire.ACK_STATUSES

EMULATED_LINK = "emulated_link_bps"
"""The hello's ``device`` key of a worker that emulates a link of that many bytes/s
(``hetd-worker --emulate-bandwidth``): on loopback it stands for a remote worker, so the downlink
treats it as one (:attr:`JoinIn.downlink_same_host`)."""


# --- worker -> engine ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class JoinIn:
    """A validated ``hello``: who the worker is, what it runs on, which codecs it decodes."""

    id: int  # the hello's request id (the welcome answers it)
    name: str
    device: Mapping[str, Any]  # short names to plain values (wire-checked)
    codecs: tuple[str, ...]  # codec names the worker offers
    resume_id: int | None = None  # the id it had before a reconnect, if it says so
    resume_secret: str | None = None  # ... and the secret its welcome gave it, to prove it
    free_mem: int | None = None  # bytes, the device's ``free_memory`` when it reports one
    same_host: bool = False  # it connected over loopback (parameters in full are cheaper)
    features: frozenset[str] = frozenset()  # the optional fields it takes (wire.WORKER_FEATURES)

    @property
    def downlink_same_host(self) -> bool:
        """Parameters in full are cheaper: it connected over loopback and emulates no slower link
        (a worker that does stands for a remote one, and gets what a remote one would)."""
        return self.same_host and EMULATED_LINK not in self.device


@dataclass(frozen=True, slots=True)
class PushIn:
    """A decoded, validated push from a session."""

    worker: int
    id: int
    base: int
    kind: str
    # path -> float32 array, or hetd.core.store.Int8 (an int8 view the store's step dequantizes);
    # typed loosely: the protocol layer sits below the core
    tensors: Mapping[str, Any]
    samples: int
    steps: int
    compute_s: float
    loss: float | None
    free_mem: int | None
    nbytes: int
    transfer_s: float | None = None  # s from the worker's send to our receipt, when known
    idle_s: float | None = None  # s the worker waited for parameters before this step
    # the L2 norm of the update over all its tensors as decoded (measured by ingest while it
    # checks finiteness; inf when its square overflows float32); None: not measured
    norm: float | None = None


# --- engine -> worker ------------------------------------------------------------------------------


class MessageBase:
    """What every typed message shares: a wire type, a request id and the wire fields."""

    __slots__ = ()
    type: ClassVar[str]

    @property
    def request_id(self) -> int:
        """The request id the frame carries (0 unless it answers a request)."""
        return 0

    def fields(self) -> dict[str, Any]:
        """The message's wire fields, in frame order."""
        raise NotImplementedError

    def message(self) -> wire.Message:
        """The message as :func:`hetd.protocol.wire.decode` returns it, without encoding."""
        return wire.Message(self.type, self.request_id, self.fields())

    def encode(self) -> bytes:
        """The protocol v1 frame."""
        return wire.encode(self.type, self.request_id, **self.fields())


@dataclass(frozen=True, slots=True)
class Welcome(MessageBase):
    """The answer to a hello: the worker's id, plan, heartbeat period and data shard, plus the
    model, dataset and training settings (``setup``: the engine config's ``welcome``)."""

    type: ClassVar[str] = "welcome"
    id: int  # the hello's request id
    worker_id: int
    plan: Plan
    heartbeat_s: float
    shard: int  # this worker's shard index
    shards: int  # how many shards the data is cut into
    setup: Mapping[str, Any]
    secret: str | None = None  # what the worker shows to resume this id (``hello.resume.secret``)

    @property
    def request_id(self) -> int:
        """The hello's request id."""
        return self.id

    def fields(self) -> dict[str, Any]:
        """The welcome's wire fields."""
        return {
            "worker_id": self.worker_id,
            "plan": self.plan.to_wire(),
            "heartbeat_s": self.heartbeat_s,
            "shard": {"index": self.shard, "count": self.shards},
            **self.setup,
            **({} if self.secret is None else {"secret": self.secret}),
        }


@dataclass(frozen=True, slots=True)
class Ack(MessageBase):
    """What became of a push, with the version after it."""

    type: ClassVar[str] = "ack"
    id: int  # the push's request id
    version: int
    status: AckStatus
    reason: str | None = None

    @property
    def request_id(self) -> int:
        """The push's request id."""
        return self.id

    def fields(self) -> dict[str, Any]:
        """The ack's wire fields (``reason`` always present, None when there is none)."""
        return {"version": self.version, "status": self.status, "reason": self.reason}


@dataclass(frozen=True, slots=True)
class ErrorReply(MessageBase):
    """A frame the engine refuses (e.g. a push out of range): nothing of it was applied."""

    type: ClassVar[str] = "error"
    id: int  # the refused frame's request id
    code: str
    text: str  # the wire's ``message``: what was wrong

    @property
    def request_id(self) -> int:
        """The refused frame's request id."""
        return self.id

    def fields(self) -> dict[str, Any]:
        """The error's wire fields."""
        return {"code": self.code, "message": self.text}


@dataclass(frozen=True, slots=True)
class PlanUpdate(MessageBase):
    """A worker's plan changed: it follows the new one from its next step."""

    type: ClassVar[str] = "plan"
    plan: Plan

    def fields(self) -> dict[str, Any]:
        """The plan message's wire fields."""
        return {"plan": self.plan.to_wire()}


@dataclass(frozen=True, slots=True)
class ShardUpdate(MessageBase):
    """A worker's part of the data changed (a join or a leave cut it again): it reads part
    ``index`` of ``count`` from its next step."""

    type: ClassVar[str] = "shard"
    index: int
    count: int

    def fields(self) -> dict[str, Any]:
        """The shard message's wire fields."""
        return {"index": self.index, "count": self.count}


@dataclass(frozen=True, slots=True)
class ProfileRequest(MessageBase):
    """Ask a joining worker to time ``steps`` steps of ``batch_size`` samples."""

    type: ClassVar[str] = "profile"
    steps: int
    batch_size: int

    @classmethod
    def from_spec(cls, spec: Mapping[str, Any]) -> ProfileRequest:
        """The request a ``spec`` map makes (a missing count is 0: the worker's own default)."""
        return cls(int(spec.get("steps", 0)), int(spec.get("batch_size", 0)))

    def spec(self) -> dict[str, int]:
        """The request's ``spec`` map."""
        return {"steps": self.steps, "batch_size": self.batch_size}

    def fields(self) -> dict[str, Any]:
        """The profile message's wire fields."""
        return {"spec": self.spec()}


@dataclass(frozen=True, slots=True)
class Bye(MessageBase):
    """The daemon ends the session (the worker may reconnect later)."""

    type: ClassVar[str] = "bye"
    reason: str

    def fields(self) -> dict[str, Any]:
        """The bye's wire fields."""
        return {"reason": self.reason}


Reply = Welcome | Ack | ErrorReply | PlanUpdate | ShardUpdate | ProfileRequest | Bye
"""A control message the engine sends a worker."""


def read_reply(msg: wire.Message) -> Reply | None:
    """The typed control reply a worker received (``msg`` as :func:`hetd.protocol.wire.decode`
    checked it); None for the frames that stay messages (parameters, stage and shared-memory
    frames, whose binary fields are read in place)."""
    t = msg.type
    if t == "ack":
        status: AckStatus = msg["status"]
        return Ack(msg.id, int(msg["version"]), status, msg.get("reason"))
    if t == "error":
        return ErrorReply(msg.id, str(msg["code"]), str(msg["message"]))
    if t == "plan":
        return PlanUpdate(Plan.from_wire(msg["plan"]))
    if t == "shard":
        return ShardUpdate(int(msg["index"]), int(msg["count"]))
    if t == "profile":
        return ProfileRequest.from_spec(msg["spec"])
    if t == "bye":
        return Bye(str(msg.get("reason") or ""))
    if t == "welcome":
        shard = msg["shard"]
        known = {"worker_id", "plan", "heartbeat_s", "shard", "secret"}
        return Welcome(
            msg.id,
            int(msg["worker_id"]),
            Plan.from_wire(msg["plan"]),
            float(msg["heartbeat_s"]),
            int(shard["index"]),
            int(shard["count"]),
            {k: v for k, v in msg.body.items() if k not in known},
            msg.get("secret"),
        )
    return None
