"""Pipeline replicas in the engine's view, a part of :class:`hetd.core.engine.Engine`
(docs/policies.md §11).

A replica is an ordered group of workers, one stage each, that trains as one data-parallel unit.
Policies see only replicas: the group's head (stage 0) stands for it in the
:class:`~policies.types.ClusterView` with one clock, and its later stages leave the view (the
policy is told ``Leave``), so a barrier counts a replica once, whatever its number of stages. The
head's pushes are the replica's assembled steps; releasing the head releases the replica as a
whole: once the release's updates are applied, :attr:`EngineBase.replica_release` (the daemon's
replica driver) sends every stage the same version and the next step. When the replica
dissolves (a member left, or its driver gave up), its surviving later stages come back into the
view as data-parallel workers (``Join``) on the slowest clock.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping, Sequence
from types import MappingProxyType

from hetd.core.entries import EngineBase
from policies.types import Join, Leave, ReplicaShape

log = logging.getLogger("hetd.core.engine")


class ReplicaMixin(EngineBase):
    """:meth:`form_replica`, :meth:`dissolve_replica` and the replicas' releases."""

    @property
    def replicas(self) -> Mapping[int, tuple[int, ...]]:
        """The pipeline replicas, head -> members in stage order (read-only, live)."""
        return MappingProxyType(self._replicas)

    def replica_of(self, wid: int) -> int | None:
        """The head of the replica worker ``wid`` is a member of (None: it is none's)."""
        if wid in self._replicas:
            return wid
        return self._stages.get(wid)

    def form_replica(self, members: Sequence[int]) -> None:
        """Make connected workers ``members`` (stage order) one replica, headed by the first.

        The later stages leave the policy's view; the head stays in it as the replica, released
        (its driver sends the first step itself). Raises ValueError, before anything changes,
        when a member is not connected, is named twice, is in a replica already or does not run
        pipeline stages (its hello did not name the ``stages`` feature).
        """
        members = tuple(members)
        if len(members) < 2 or len(set(members)) != len(members):
            raise ValueError(f"a replica needs >= 2 distinct members, got {list(members)}")
        gone = [w for w in members if w not in self._workers]
        if gone:
            raise ValueError(f"members must be connected workers; not connected: {gone}")
        taken = [w for w in members if self.replica_of(w) is not None]
        if taken:
            raise ValueError(f"workers {taken} are in a replica already")
        unable = [w for w in members if not self._workers[w].facts.stages]
        if unable:
            raise ValueError(
                f"workers {unable} do not run pipeline stages (their hello did not name the "
                "'stages' feature: an older hetd-worker)"
            )
        head = members[0]
        now = self.clock.now()
        self._replicas[head] = members
        entry = self._workers[head]
        # The driver sends the stages the parameters in full; its first step is the release.
        entry.held_ref = None
        self._put(
            entry,
            dataclasses.replace(entry.facts, version=-1, waiting=False, waiting_since=None),
        )
        for wid in members[1:]:
            self._stages[wid] = head
            self._releases.pop(wid, None)
            if self._facts.pop(wid, None) is not None:
                self._dispatch(Leave(now, wid, f"stage of replica {head}"))
        log.info("replica %d formed: stages %s", head, list(members))

    def dissolve_replica(self, head: int, reason: str = "") -> None:
        """End replica ``head`` (nothing happens when there is none): its later stages still
        connected come back into the view as data-parallel workers on the slowest clock; what
        they and the head hold is unknown, so their next parameters go in full."""
        members = self._replicas.pop(head, None)
        if members is None:
            return
        self._replica_releases.pop(head, None)
        now = self.clock.now()
        lead = self._workers.get(head)
        if lead is not None:
            lead.held_ref = None
            # Its timings were the replica's steps (and the first one's compiles), not its own:
            # a planner reading them as the worker's speed would think it slow and leave it idle
            # for good. Its next pushes (or its profile) measure it again.
            self._put(
                lead,
                dataclasses.replace(lead.facts, version=-1, sample_s=None, compute_s=None),
            )
        for wid in members[1:]:
            del self._stages[wid]
            entry = self._workers.get(wid)
            if entry is None:
                continue
            entry.held_ref = None
            clock = self.view().min_clock() if self._facts else entry.facts.clock
            # A dissolved stage computes at once on the parameters it holds: not waiting.
            self._put(
                entry,
                dataclasses.replace(
                    entry.facts, clock=clock, version=-1, waiting=False, waiting_since=None
                ),
            )
            self._dispatch(Join(now, wid))
        log.info("replica %d dissolved%s", head, f": {reason}" if reason else "")

    def _release_replica(self, head: int) -> None:
        """The policy released replica ``head``: its driver runs the next step once the updates
        before it are applied (at this batch's publish, or now when commands publish at once)."""
        if self._deferred:
            self._replica_releases[head] = None
        else:
            self.store.flush()
            self._run_replica(head)

    def _send_replica_releases(self) -> None:
        """After a publish: the released replicas' next steps."""
        heads, self._replica_releases = list(self._replica_releases), {}
        for head in heads:
            self._run_replica(head)

    def _run_replica(self, head: int) -> None:
        if head not in self._replicas:
            return
        if self.replica_release is None:
            log.warning("replica %d released but nothing runs replicas; dissolving it", head)
            self.dissolve_replica(head, "no replica driver")
            return
        try:
            self.replica_release(head)
        except Exception:  # the driver's bug must not stop the engine
            log.exception("replica %d: its next step could not be sent", head)

    def _regroup(self, shapes: tuple[ReplicaShape, ...]) -> None:
        """A policy's Regroup: the replica driver forms and dissolves replicas to match."""
        if self.replica_regroup is None:
            log.warning("policy %s regroups, but nothing runs replicas here", self.policy.name)
            return
        try:
            self.replica_regroup(shapes)
        except Exception:  # the driver's bug must not stop the engine
            log.exception("regroup to %s failed", shapes)
