"""The activation relay of pipeline replicas: ``act`` and ``gact`` frames from one stage's worker
to its neighbour's, through the daemon, over the workers' own authenticated websockets.

It lives in the websocket layer, not the engine: the engine (or an operator's test) installs an
immutable route table ``(replica, gen, stage) -> worker id`` with :meth:`Relay.install`, and each
session hands the relay the ``act``/``gact`` frames its worker sends. The session has decoded the
frame's header (:mod:`hetd.protocol.wire` checks it strictly); the relay forwards the frame's
bytes as they came, tensor included, to the next stage (``act``) or the one before (``gact``) of
the sender's replica and generation. A frame with no route (the sender is not a stage of that
replica generation, the neighbour does not exist or its worker is not connected) is dropped and
the sender gets an ``error`` saying why; nothing else happens, so a dead or stale route never
stalls the daemon or another session.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Protocol

from hetd.protocol import wire
from hetd.protocol.frames import Act

Route = tuple[int, int, int]
"""``(replica, gen, stage)``."""


class Sink(Protocol):
    """Where a relayed frame goes: a session's outbox (:class:`hetd.server.sessions.Outbox`)."""

    def send_relayed(self, frame: bytes) -> None: ...


class NoRoute(Exception):
    """A relayed frame was dropped: ``code`` and ``message`` are the sender's ``error``."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass(frozen=True, slots=True)
class RelayStats:
    """Frames and bytes forwarded, and frames dropped for want of a route."""

    frames: int
    bytes: int
    dropped: int


class Relay:
    """Routes ``act``/``gact`` frames between the stages of pipeline replicas (one per daemon)."""

    def __init__(self) -> None:
        self._routes: Mapping[Route, int] = MappingProxyType({})
        self._stage_of: Mapping[tuple[int, int, int], tuple[int, int]] = MappingProxyType({})
        self._sinks: dict[int, Sink] = {}
        self._frames = self._bytes = self._dropped = 0
        # who takes a stage's slice of a replica step (a push with ``stage``): the worker id and
        # the checked message, tensors still on the wire; None: such pushes are refused
        self.on_part: Callable[[int, wire.Message], None] | None = None
        # told the id of a worker whose session ended (a stage may be lost)
        self.on_detach: Callable[[int], None] | None = None

    @property
    def routes(self) -> Mapping[Route, int]:
        """The installed table (read-only)."""
        return self._routes

    def install(self, routes: Mapping[Route, int]) -> None:
        """Replace the route table as a whole. Every replica generation in it must have stages
        ``0..S-1`` with one distinct worker each; a bad table raises ``ValueError`` and leaves
        the old one in place."""
        table = dict(routes)
        stage_of: dict[tuple[int, int, int], tuple[int, int]] = {}
        by_replica: dict[tuple[int, int], list[int]] = {}
        for (replica, gen, stage), wid in table.items():
            by_replica.setdefault((replica, gen), []).append(stage)
            if (replica, gen, wid) in stage_of:
                raise ValueError(f"worker {wid} holds two stages of replica {replica} gen {gen}")
            stage_of[(replica, gen, wid)] = (stage, 0)
        for (replica, gen), stages in by_replica.items():
            if sorted(stages) != list(range(len(stages))):
                raise ValueError(
                    f"replica {replica} gen {gen} has stages {sorted(stages)}, not 0..S-1"
                )
        of = {key: len(stages) for key, stages in by_replica.items()}
        stage_of = {k: (s, of[(k[0], k[1])]) for k, (s, _) in stage_of.items()}
        self._stage_of = MappingProxyType(stage_of)
        self._routes = MappingProxyType(table)

    def attach(self, wid: int, sink: Sink) -> None:
        """Worker ``wid``'s session is up: frames routed to it go to ``sink``."""
        self._sinks[wid] = sink

    def detach(self, wid: int, sink: Sink) -> None:
        """Worker ``wid``'s session ended (a newer session of the same id is kept)."""
        if self._sinks.get(wid) is sink:
            del self._sinks[wid]
            if self.on_detach is not None:
                self.on_detach(wid)

    def send(self, wid: int, frame: bytes) -> None:
        """Send worker ``wid`` a pipeline control frame (``stage``, ``step``, ``abort``) after
        what its session has queued; :class:`NoRoute` when it is not connected."""
        sink = self._sinks.get(wid)
        if sink is None:
            raise NoRoute("route_down", f"worker {wid} is not connected")
        sink.send_relayed(frame)

    def stats(self) -> RelayStats:
        return RelayStats(self._frames, self._bytes, self._dropped)

    def target(self, sender: int, msg: Act) -> int:
        """The worker an ``act``/``gact`` from ``sender`` goes to; :class:`NoRoute` if none."""
        replica, gen = msg.replica, msg.gen
        member = self._stage_of.get((replica, gen, sender))
        if member is None:
            raise NoRoute(
                "no_route",
                f"{msg.type}: worker {sender} is no stage of replica {replica} generation {gen}"
                " (a stale generation, or not assigned)",
            )
        stage, of = member
        to = stage + 1 if msg.type == "act" else stage - 1
        if not 0 <= to < of:
            raise NoRoute(
                "no_route",
                f"{msg.type}: stage {stage} of {of} has no {'next' if to > stage else 'previous'}"
                " stage",
            )
        return self._routes[(replica, gen, to)]

    def forward(self, sender: int, msg: Act, frame: bytes) -> None:
        """Send ``frame`` (an ``act``/``gact`` from worker ``sender``, as it came) on; raises
        :class:`NoRoute` (the frame dropped) when it has nowhere to go."""
        try:
            wid = self.target(sender, msg)
            sink = self._sinks.get(wid)
            if sink is None:
                raise NoRoute(
                    "route_down",
                    f"{msg.type}: worker {wid}, the next hop of replica {msg.replica}"
                    f" generation {msg.gen}, is not connected; frame dropped",
                )
        except NoRoute:
            self._dropped += 1
            raise
        sink.send_relayed(frame)
        self._frames += 1
        self._bytes += len(frame)
