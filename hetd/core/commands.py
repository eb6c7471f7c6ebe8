"""What the engine's single writer is asked to do: one frozen value per command, put on its queue
by the sessions, the admin API, the replica driver, the timers and the simulator, and carried out
by :meth:`hetd.core.engine.Engine.handle` on the engine task.

Only :class:`Call` carries code: a read or a change by the admin API or the replica driver that
must see (or make) the state between two events. Everything a worker causes is data.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from hetd.core.peers import FrameSink, Peer
from hetd.protocol.messages import JoinIn, PushIn
from policies import types as policy_types

__all__ = [
    "Call",
    "Command",
    "DissolveReplica",
    "EvalDone",
    "EvalDue",
    "Forecast",
    "Heartbeat",
    "Join",
    "Leave",
    "ProfileResult",
    "Pull",
    "Push",
    "Resend",
    "Tick",
    "Transport",
]


@dataclass(frozen=True, slots=True)
class Join:
    """A worker's hello on session ``peer``; ``on_id`` hears its id before the policy does."""

    hello: JoinIn
    peer: Peer
    on_id: Callable[[int], None] | None = None


@dataclass(frozen=True, slots=True)
class Push:
    """One decoded, validated update."""

    push: PushIn


@dataclass(frozen=True, slots=True)
class Pull:
    """A worker asks for parameters (``have``: the version it holds; None: in full)."""

    worker: int
    have: int | None = None


@dataclass(frozen=True, slots=True)
class Heartbeat:
    worker: int


@dataclass(frozen=True, slots=True)
class Leave:
    """Session ``peer`` of worker ``worker`` ended (None: whichever it is on)."""

    worker: int
    reason: str
    peer: Peer | None = None


@dataclass(frozen=True, slots=True)
class ProfileResult:
    worker: int
    result: Mapping[str, Any]


@dataclass(frozen=True, slots=True)
class Resend:
    """Send the newest parameters in full again (the outbox dropped a full frame)."""

    worker: int
    peer: Peer | None = None


@dataclass(frozen=True, slots=True)
class Transport:
    """The worker's session now carries its big frames by ``transport`` (``"ws"``, ``"shm"``);
    ``sink``: where the store packs snapshots from now on (the daemon's shared memory)."""

    worker: int
    peer: Peer
    transport: str
    sink: FrameSink | None = None


@dataclass(frozen=True, slots=True)
class Tick:
    """Time passed: heartbeats, evaluations, gates."""


@dataclass(frozen=True, slots=True)
class EvalDue:
    """A point of the evaluation grid may be due."""


@dataclass(frozen=True, slots=True)
class EvalDone:
    """An evaluation of the parameters snapshotted at ``taken`` (engine clock; None: now)
    finished."""

    result: tuple[float, float]
    taken: float | None = None


@dataclass(frozen=True, slots=True)
class Forecast:
    """A planner's forecast (:mod:`hetd.core.planner`), for a policy that reads forecasts; any
    other policy never hears of it (one swapped in while it was made included)."""

    forecast: policy_types.Forecast


@dataclass(frozen=True, slots=True)
class DissolveReplica:
    head: int
    reason: str = ""


@dataclass(frozen=True, slots=True)
class Call:
    """Run ``fn`` between two events; its result (or error) goes to ``done`` when given."""

    fn: Callable[[], Any]
    done: asyncio.Future[Any] | None = field(default=None, compare=False)

    def answer(self) -> Any:
        """Run ``fn``: its result (no ``done``: its error raises), or set into ``done``."""
        if self.done is None:
            return self.fn()
        try:
            result = self.fn()
        except Exception as exc:
            if not self.done.done():
                self.done.set_exception(exc)
        else:
            if not self.done.done():
                self.done.set_result(result)
        return None


Command = (
    Join
    | Push
    | Pull
    | Heartbeat
    | Leave
    | ProfileResult
    | Resend
    | Transport
    | Tick
    | EvalDue
    | EvalDone
    | Forecast
    | DissolveReplica
    | Call
)
