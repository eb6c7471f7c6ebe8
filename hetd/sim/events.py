"""The simulator's event heap: what happens next in virtual time, one typed event at a time.

Owns the virtual clock (:class:`VirtualClock`), the events (what the harness,
:mod:`hetd.sim.loop`, and the server model, :mod:`hetd.sim.server_model`, schedule) and
:class:`EventHeap`, which hands them out in time order; events at the same virtual time come out
in the order they were scheduled, so a run is the same every time.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hetd.protocol import wire
    from hetd.protocol.frames import Params
    from hetd.sim.agent import EmuWorker, InFlight
    from hetd.sim.scenario import ChurnEvent


class VirtualClock:
    """The engine's clock in the simulator: seconds of virtual time, moved by the harness."""

    def __init__(self) -> None:
        self.t = 0.0

    def now(self) -> float:
        return self.t


@dataclass(frozen=True, slots=True)
class Deliver:
    """A release's ``params`` frames reach their worker (link and decode time included)."""

    worker: EmuWorker
    frames: list[Params]


@dataclass(frozen=True, slots=True)
class Arrive:
    """A push reaches the daemon (or would, had its codec not made it bigger: it is sent again)."""

    push: InFlight


@dataclass(frozen=True, slots=True)
class Decoded:
    """A push the daemon decoded in a thread is ready for the engine's queue."""

    push: InFlight
    msg: wire.Message


@dataclass(frozen=True, slots=True)
class Profiled:
    """A worker's profile result reaches the daemon (seconds per step, by what it timed)."""

    worker: EmuWorker
    result: dict[str, float]


@dataclass(frozen=True, slots=True)
class Repull:
    """A worker that could not apply a delta asks for the parameters in full."""

    worker: EmuWorker


@dataclass(frozen=True, slots=True)
class Wake:
    """A pipelined worker's device is free: it may start its next step."""

    worker: EmuWorker


@dataclass(frozen=True, slots=True)
class Tick:
    """The engine's ``k``-th periodic tick (at ``k × tick_s``)."""

    k: int


@dataclass(frozen=True, slots=True)
class Forecast:
    """A planning round for a policy that reads forecasts: ``k = 0`` probes for the first (made
    once every worker has a timing estimate), the ``k``-th comes ``k × plan_every_s`` after it."""

    k: int


@dataclass(frozen=True, slots=True)
class Evaluate:
    """An evaluation of the parameters as they are now."""


@dataclass(frozen=True, slots=True)
class Record:
    """An evaluation's result, back from the daemon's evaluation thread."""

    loss: float
    accuracy: float


@dataclass(frozen=True, slots=True)
class Free:
    """The daemon finished its batch: it takes the next one."""


@dataclass(frozen=True, slots=True)
class Churn:
    """A scenario's ``[[events]]`` entry at its time: a worker joins, or one goes away."""

    event: ChurnEvent


@dataclass(frozen=True, slots=True)
class Bye:
    """A worker that was stopped cleanly says bye: it reaches the daemon after its last push.
    ``reason``: why it left ("": stopped, as on SIGTERM)."""

    worker: EmuWorker
    reason: str = ""


@dataclass(frozen=True, slots=True)
class Later:
    """Something a part of the simulator scheduled for itself (a pipeline replica's step ends:
    :mod:`hetd.sim.replicas`)."""

    run: Callable[[], None]


Event = (
    Deliver
    | Arrive
    | Decoded
    | Profiled
    | Repull
    | Wake
    | Tick
    | Forecast
    | Evaluate
    | Record
    | Free
    | Churn
    | Bye
    | Later
)


class EventHeap:
    """Events by virtual time (s); those at the same time in the order they were scheduled."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, Event]] = []
        self._seq = 0  # breaks ties: the order of scheduling, never the events themselves

    def schedule(self, t: float, event: Event) -> None:
        """Let ``event`` happen at ``t``."""
        heapq.heappush(self._heap, (t, self._seq, event))
        self._seq += 1

    def pop(self) -> tuple[float, Event]:
        """The next event and its time. Raises IndexError when none is left."""
        t, _, event = heapq.heappop(self._heap)
        return t, event

    def __len__(self) -> int:
        return len(self._heap)
