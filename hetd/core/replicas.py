"""Pipeline replicas in the engine's view, a part of :class:`hetd.core.engine.Engine`
(:class:`Replicas`; docs/policies.md §11).

A replica is an ordered group of workers, one stage each, that trains as one data-parallel unit.
Policies see only replicas: the group's head (stage 0) stands for it in the
:class:`~policies.types.ClusterView` with one clock, and its later stages leave the view (the
policy is told ``Leave``), so a barrier counts a replica once, whatever its number of stages. The
head's pushes are the replica's assembled steps; releasing the head releases the replica as a
whole: once the release's updates are applied, :attr:`Replicas.run_step` (the daemon's replica
driver) sends every stage the same version and the next step. When the replica dissolves (a
member left, or its driver gave up), its surviving later stages come back into the view as
data-parallel workers (``Join``) on the slowest clock.

The policy events a change causes are returned; the engine hands them to the policy.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType
from typing import Any, Protocol

from hetd.core.entries import WorkerEntry
from policies.types import Event, Join, Leave, ReplicaShape, WorkerFacts

log = logging.getLogger("hetd.core.engine")


class WorkerTable(Protocol):
    """What replicas read and change of the worker table (:class:`hetd.core.members.Members`)."""

    @property
    def active(self) -> Mapping[int, WorkerEntry]: ...

    @property
    def view_facts(self) -> Mapping[int, WorkerFacts]:
        """The active workers the policy sees."""

    @property
    def hidden(self) -> set[int]:
        """Active workers kept out of the policy's view."""

    def update(self, entry: WorkerEntry, **changes: Any) -> None:
        """Replace an active worker's facts with ``changes``."""

    def hide(self, wid: int) -> bool:
        """Take an active worker out of the policy's view; whether it was in it."""

    def min_clock(self) -> int:
        """The slowest clock in the policy's view."""


class Replicas:
    """Replicas by head, the later stages' heads, and the released heads whose step is still
    to be sent."""

    def __init__(
        self, members: WorkerTable, blocks: tuple[tuple[float, float, float], ...] = ()
    ) -> None:
        self.members = members
        self.groups: dict[int, tuple[int, ...]] = {}  # head -> members in stage order
        self.head_of: dict[int, int] = {}  # a replica's later stages -> its head
        self.pending: dict[int, None] = {}  # heads released, their step not yet sent
        self.blocks = blocks  # what planners of replicas know of the model
        # Who forms and dissolves pipeline replicas on a policy's Regroup (the daemon's driver).
        self.regroup_to: Callable[[tuple[ReplicaShape, ...]], None] | None = None
        # Who runs a released replica's next step (the daemon's replica driver): called with the
        # head's id once the release's updates are applied.
        self.run_step: Callable[[int], None] | None = None

    @property
    def view(self) -> Mapping[int, tuple[int, ...]]:
        """The pipeline replicas, head -> members in stage order (read-only, live)."""
        return MappingProxyType(self.groups)

    def of(self, wid: int) -> int | None:
        """The head of the replica worker ``wid`` is a member of (None: it is none's)."""
        if wid in self.groups:
            return wid
        return self.head_of.get(wid)

    def row(self, wid: int) -> list[int] | None:
        """[head, stage] of the replica ``wid`` is a stage of (None: data parallel)."""
        head = self.of(wid)
        return None if head is None else [head, self.groups[head].index(wid)]

    def form(self, members: Sequence[int], now: float) -> list[Event]:
        """Make connected workers ``members`` (stage order) one replica, headed by the first.

        The later stages leave the policy's view; the head stays in it as the replica, released
        (its driver sends the first step itself). Raises ValueError, before anything changes,
        when a member is not connected, is named twice, is in a replica already or does not run
        pipeline stages (its hello did not name the ``stages`` feature).
        """
        members = tuple(members)
        active = self.members.active
        if len(members) < 2 or len(set(members)) != len(members):
            raise ValueError(f"a replica needs >= 2 distinct members, got {list(members)}")
        gone = [w for w in members if w not in active]
        if gone:
            raise ValueError(f"members must be connected workers; not connected: {gone}")
        taken = [w for w in members if self.of(w) is not None]
        if taken:
            raise ValueError(f"workers {taken} are in a replica already")
        unable = [w for w in members if not active[w].facts.stages]
        if unable:
            raise ValueError(
                f"workers {unable} do not run pipeline stages (their hello did not name the "
                "'stages' feature: an older hetd-worker)"
            )
        head = members[0]
        self.groups[head] = members
        entry = active[head]
        # The driver sends the stages the parameters in full; its first step is the release.
        entry.held_ref = None
        self.members.update(entry, version=-1, waiting=False, waiting_since=None)
        events: list[Event] = []
        for wid in members[1:]:
            self.head_of[wid] = head
            if self.members.hide(wid):
                events.append(Leave(now, wid, f"stage of replica {head}"))
        log.info("replica %d formed: stages %s", head, list(members))
        return events

    def dissolve(self, head: int, reason: str, now: float) -> list[Event]:
        """End replica ``head`` (nothing happens when there is none): its later stages still
        connected come back into the view as data-parallel workers on the slowest clock; what
        they and the head hold is unknown, so their next parameters go in full."""
        members = self.groups.pop(head, None)
        if members is None:
            return []
        self.pending.pop(head, None)
        lead = self.members.active.get(head)
        if lead is not None:
            lead.held_ref = None
            # Its timings were the replica's steps (and the first one's compiles), not its own:
            # a planner reading them as the worker's speed would think it slow and leave it idle
            # for good. Its next pushes (or its profile) measure it again.
            self.members.update(lead, version=-1, sample_s=None, compute_s=None)
        events: list[Event] = []
        for wid in members[1:]:
            del self.head_of[wid]
            self.members.hidden.discard(wid)
            entry = self.members.active.get(wid)
            if entry is None:
                continue
            entry.held_ref = None
            clock = self.members.min_clock() if self.members.view_facts else entry.facts.clock
            # A dissolved stage computes at once on the parameters it holds: not waiting.
            self.members.update(entry, clock=clock, version=-1, waiting=False, waiting_since=None)
            events.append(Join(now, wid))
        log.info("replica %d dissolved%s", head, f": {reason}" if reason else "")
        return events

    def run_pending(self, now: float) -> list[Event]:
        """After a publish: the released heads' next steps; a replica with no driver is
        dissolved (its events returned)."""
        heads, self.pending = list(self.pending), {}
        events: list[Event] = []
        for head in heads:
            if not self.run(head):
                events += self.dissolve(head, "no replica driver", now)
        return events

    def run(self, head: int) -> bool:
        """Send replica ``head``'s next step through its driver; False when nothing runs
        replicas here (the caller dissolves it)."""
        if head not in self.groups:
            return True
        if self.run_step is None:
            log.warning("replica %d released but nothing runs replicas; dissolving it", head)
            return False
        try:
            self.run_step(head)
        except Exception:  # the driver's bug must not stop the engine
            log.exception("replica %d: its next step could not be sent", head)
        return True

    def regroup(self, shapes: tuple[ReplicaShape, ...], policy: str) -> None:
        """A policy's Regroup: the replica driver forms and dissolves replicas to match."""
        if self.regroup_to is None:
            log.warning("policy %s regroups, but nothing runs replicas here", policy)
            return
        try:
            self.regroup_to(shapes)
        except Exception:  # the driver's bug must not stop the engine
            log.exception("regroup to %s failed", shapes)
