"""A push's way in, a part of :class:`hetd.core.engine.Engine` (:class:`Intake`).

Before the policy hears of a push, it is checked here, in this order: a push id seen before is
answered ``duplicate`` and never applied twice; a data-parallel step that ended after its worker
became a replica's stage is ``dropped``; the :class:`~hetd.core.guard.UpdateGuard` may refuse it
(nothing of it counts, but with a decision log its id is spent); from then on it is answered exactly once, its counters and timing facts go
into the worker table, and one based on a version from the future or staler than
``max_staleness`` is ``dropped``. What passes becomes the policy's :class:`~policies.types.Push`.
A push refused or dropped here is a drop in the decision log, when one is kept (a pserver frees
its part); so is one whose parts did not all reach the pservers (:attr:`Intake.partless`).
"""

from __future__ import annotations

import logging
import math
from typing import Literal

from hetd.core.applier import Applier
from hetd.core.entries import EngineConfig, WorkerEntry
from hetd.core.guard import UpdateGuard
from hetd.core.ingest import update_norm
from hetd.core.members import Members
from hetd.core.rates import Meters
from hetd.core.replicas import Replicas
from hetd.protocol.messages import Ack, ErrorReply, PushIn, Reply
from policies.types import Event, Pull, Push, Tick

log = logging.getLogger("hetd.core.engine")  # one logger for the engine and its parts

STALENESS_KEPT = 4096  # per worker, the staleness of its last pushes (halved when full)


class Intake:
    """Checks pushes against the worker table, the replicas, the guard and the version."""

    def __init__(
        self,
        members: Members,
        pipelines: Replicas,
        guard: UpdateGuard,
        applier: Applier,
        config: EngineConfig,
        meters: Meters,
    ) -> None:
        self.members = members
        self.applier = applier
        self.pipelines = pipelines
        self.guard = guard
        self.store = applier.store
        self.config = config
        self.meters = meters
        # pushes (worker, id) whose parts did not all reach the pservers: dropped, as a drop in
        # the decision log (the daemon's pservers' link names them before it submits them)
        self.partless: set[tuple[int, int]] = set()

    def push(self, p: PushIn, now: float) -> tuple[Reply | None, Event | None]:
        """The answer the push gets now (if any) and the event the policy hears (if any): a
        :class:`~policies.types.Push` for one that passed, a ``Tick`` for one dropped as stale
        (the clock moved: gates may open)."""
        entry = self.members.active.get(p.worker)
        if entry is None:
            self.partless.discard((p.worker, p.id))
            return None, None
        st = entry.stats
        st.last_seen = now
        version = self.store.version
        if p.id <= entry.last_push:  # seen before (sent again, or after a reconnect): never twice
            st.duplicates += 1
            why = (
                f"push {p.id} was received before (last push {entry.last_push}); not applied again"
            )
            return Ack(p.id, version, "duplicate", why), None
        if (p.worker, p.id) in self.partless:  # applied everywhere or nowhere: nowhere
            self.partless.discard((p.worker, p.id))
            st.dropped += 1
            entry.last_push = max(entry.last_push, p.id)
            self.applier.discard(p.worker, p.id)
            return Ack(p.id, version, "dropped", "its parts did not all reach the pservers"), None
        if p.worker in self.pipelines.head_of:  # a data-parallel step that ended after its
            st.dropped += 1  # worker became a replica's stage: the policy no longer counts it
            entry.last_push = max(entry.last_push, p.id)
            self.applier.discard(p.worker, p.id)
            return Ack(
                p.id, version, "dropped", "the worker is a stage of a pipeline replica now"
            ), None
        refusal = self._guard(p)
        if refusal is not None:  # nothing of it counts: the worker goes on from what it holds
            st.refused += 1
            log.warning("worker %d: push %d refused: %s", p.worker, p.id, refusal)
            if self.store.decisions is not None:  # its id is spent, so that a push sent again
                # under it (a worker never does) is a duplicate, not a second log entry
                entry.last_push = max(entry.last_push, p.id)
                self.applier.discard(p.worker, p.id)
            return ErrorReply(p.id, "out_of_range", refusal), None
        self._count(entry, p, now)
        if p.base > version or version - p.base > self.config.max_staleness:
            why = "base version from the future" if p.base > version else "too stale"
            st.dropped += 1
            self.applier.discard(p.worker, p.id)
            return Ack(p.id, version, "dropped", why), Tick(now)
        kind: Literal["grad", "delta"] = "grad" if p.kind == "grad" else "delta"
        return None, Push(now, p.worker, p.base, kind, p.samples, p.steps, p.compute_s, p.loss)

    def _guard(self, p: PushIn) -> str | None:
        if p.norm is not None and math.isnan(p.norm):  # (ingest refuses such a push itself; a
            # header's norm is its pservers' report: NaN when a part holds NaN or Inf)
            return "the update holds NaN or Inf, or overflows float32; not applied"
        if not self.guard.on:
            return None
        return self.guard.check(p.kind, p.norm if p.norm is not None else update_norm(p.tensors))

    def _count(self, entry: WorkerEntry, p: PushIn, now: float) -> None:
        """From here on the push is answered with an ack: its counters and timing facts."""
        entry.last_push = p.id
        if entry.facts.waiting:  # one release ends the wait: it answers this push too
            entry.joined_pushes += 1
        self.meters.bytes_in += p.nbytes
        st = entry.stats
        st.staleness.append(max(0, self.store.version - p.base))
        if len(st.staleness) > STALENESS_KEPT:
            del st.staleness[: STALENESS_KEPT // 2]
        self.members.pushed(entry, p, now)

    def pull(self, wid: int, have: int | None, now: float) -> Event | None:
        """A worker asks for parameters (``have``: the version it holds); the policy's ``Pull``
        (None: the worker is not active, or is a replica's member, whose parameters go out in
        full and outside any gate: the caller resends them)."""
        entry = self.members.active.get(wid)
        if entry is None:
            return None
        entry.stats.last_seen = now
        if self.pipelines.of(wid) is not None:
            return None
        f = entry.facts
        held = f.version if have is not None and have == f.version else -1
        self.members.update(entry, waiting=True, waiting_since=f.waiting_since or now, version=held)
        return Pull(now, wid)
