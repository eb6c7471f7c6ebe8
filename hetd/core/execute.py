"""The policy's decisions carried out, a part of :class:`hetd.core.engine.Engine` (:class:`Executor`).

One event's resolved decisions (:func:`policies.resolve`) change the parts in a fixed order:
plans and the stage first (a worker released by the same event computes under its new plan),
then flushes, releases and the push's own decision (apply, buffer or drop, each answered with an
ack). A policy swap is carried out here too, all or nothing. What this causes that the policy must
hear of (a replica dissolved for want of a driver) is returned as events; the engine hands them on.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from typing import Any, Protocol

from hetd.core.applier import Applier
from hetd.core.entries import EngineConfig, WorkerEntry
from hetd.core.members import Members
from hetd.core.noise import GradientNoise
from hetd.core.peers import Clock
from hetd.core.policy_host import Known, PolicyHost
from hetd.core.rates import Meters
from hetd.core.replicas import Replicas
from hetd.core.store import Store
from hetd.protocol.messages import Ack, AckStatus, PlanUpdate, PushIn
from policies.compose import Resolved
from policies.types import (
    Apply,
    Buffer,
    Drop,
    Event,
    Flush,
    PushDecision,
    Regroup,
    Release,
    RestartOptimizer,
    SetStage,
)

log = logging.getLogger("hetd.core.engine")  # one logger for the engine and its parts


class Releaser(Protocol):
    """What the executor needs of the publisher (:class:`hetd.core.publish.Publisher`)."""

    deferred: bool  # releases wait for the batch's publish

    def release(self, entry: WorkerEntry) -> None: ...


class Executor:
    """Carries resolved decisions into the members, the applier, the publisher and the replicas."""

    def __init__(
        self,
        members: Members,
        host: PolicyHost,
        applier: Applier,
        publisher: Releaser,
        pipelines: Replicas,
        store: Store,
        config: EngineConfig,
        meters: Meters,
        clock: Clock,
        noise: GradientNoise | None = None,
    ) -> None:
        """``noise``: where plain gradient pushes applied or buffered are paired (None: not)."""
        self.members = members
        self.host = host
        self.applier = applier
        self.publisher = publisher
        self.pipelines = pipelines
        self.store = store
        self.config = config
        self.meters = meters
        self.clock = clock
        self.noise = noise

    def run(self, r: Resolved, push: PushIn | None) -> list[Event]:
        """Carry out one event's resolved decisions (``push``: the push the event was)."""
        # Plans first, so a worker released by this event computes under its new plan.
        for d in r.plans:
            if isinstance(d, SetStage):
                if self.host.enter(d.stage):
                    for wid in list(self.members.active):
                        self.set_plan(wid, {"stage": d.stage})
            elif isinstance(d, Regroup):
                self.pipelines.regroup(d.replicas, self.host.policy.name)
            else:
                self.set_plan(d.worker, d.fields)
        events: list[Event] = []
        for a in r.actions:
            if isinstance(a, Flush):
                self.applier.flush(a)
            elif isinstance(a, Release):
                events += self.release(a.worker)
            elif isinstance(a, RestartOptimizer):
                self.store.restart_optimizer()
                log.info("optimizer restarted (policy %s)", self.host.policy.name)
            elif push is not None:
                self.decide(a, push, r.scale)
        if push is not None and r.push is None:
            # A policy that says nothing about a push must not lose it.
            log.warning("policy %s made no decision on a push; applying it", self.host.policy.name)
            self.decide(Apply(1.0 / max(1, len(self.members.view_facts))), push, r.scale)
        return events

    def decide(self, d: PushDecision, p: PushIn, factor: float) -> None:
        """Apply, buffer or drop one push, and answer it."""
        st = self.members.stats[p.worker]
        named = (p.worker, p.id)  # what a decision log records of the push
        if isinstance(d, Apply):
            self.applier.apply(p.kind, p.tensors, d.weight * factor, named)
            st.applied += 1
            self.ack(p, "applied")
            self._measure(p)
        elif isinstance(d, Buffer):
            self.applier.buffer(d.group, p.kind, p.tensors, d.weight * factor, named)
            st.buffered += 1
            self.ack(p, "buffered")
            self._measure(p)
        elif isinstance(d, Drop):
            self.applier.discard(*named)
            st.dropped += 1
            self.ack(p, "dropped", d.reason)

    def _measure(self, p: PushIn) -> None:
        """A plain gradient push (one step, not a pipeline replica's) to the noise scale."""
        if self.noise is None or p.kind != "grad" or p.steps != 1:
            return
        if self.pipelines.of(p.worker) is not None:
            return
        self.noise.push(p.worker, p.base, p.samples, p.tensors, p.norm)

    def ack(self, p: PushIn, status: AckStatus, reason: str | None = None) -> None:
        self.members.send(p.worker, Ack(p.id, self.store.version, status, reason))

    def set_plan(self, wid: int, fields: Mapping[str, Any]) -> None:
        """Merge ``fields`` into a worker's plan; it is told when the plan changed."""
        entry = self.members.active.get(wid)
        if entry is None:
            return
        new = entry.plan.merge(fields)  # checked: resolve() raised on unknown fields already
        if new == entry.plan:
            return
        entry.plan = new
        self.members.update(entry, batch_size=new.batch_size)
        self.members.send(wid, PlanUpdate(new))

    def release(self, wid: int) -> list[Event]:
        """A waiting worker may go on: parameters out (or its replica's next step)."""
        entry = self.members.active.get(wid)
        if entry is None or not entry.facts.waiting or wid in self.pipelines.head_of:
            return []  # a replica's later stage is released with its head
        f, now = entry.facts, self.clock.now()
        gap = f.clock - min(x.clock for x in self.members.view_facts.values())
        self.meters.max_release_gap = max(self.meters.max_release_gap, gap)
        idle = now - f.waiting_since if f.waiting_since is not None else 0.0
        self.members.update(entry, waiting=False, waiting_since=None, idle_s=f.idle_s + idle)
        if wid not in self.pipelines.groups:
            self.publisher.release(entry)
        elif self.publisher.deferred:  # its driver runs the step once this batch is applied
            self.pipelines.pending[wid] = None
        else:
            self.store.flush()
            if not self.pipelines.run(wid):
                return self.pipelines.dissolve(wid, "no replica driver", now)
        return []

    def swap(self, name: str, params: Mapping[str, Any] | None) -> tuple[Resolved, dict[str, Any]]:
        """Replace the policy, all or nothing: its first decisions (for :meth:`run`) and its
        description.

        The new policy is built, initialised and asked for its first decisions on a trial view
        (:meth:`PolicyHost.trial`); any error raises :class:`PolicyError` and nothing has
        changed. Then the swap is carried out: buffered pushes are applied (never lost), the
        policy, its state, the stage and the plans change together (each worker whose plan
        changed is told once).
        """
        members, active = self.members, self.members.active
        visible = {wid: e.facts for wid, e in active.items() if wid in members.view_facts}
        t = self.host.trial(
            name,
            params,
            visible,
            lambda f: members.default_plan(f.codec, "main"),
            self.store.version,
            self.config.global_batch,
            self.config.outer_for,
            Known(
                self.pipelines.blocks,
                None if self.noise is None else self.noise.value,
                self.config.inner_optimizer,
            ),
        )
        # Nothing below refuses: the swap happens as a whole.
        if self.applier.buffered():  # never lose buffered updates: apply them before the change
            self.applier.flush(Flush(normalize=True))
        old = self.host.policy.name
        self.host.install(t.policy, t.state)
        # after the flush, which applied the old policy's rounds through the old one
        if t.outer is not None and self.store.set_outer(t.outer):
            log.info("outer optimizer -> %s (state reset)", self.store.outer_spec)
        self.host.enter(t.stage, "policy swap")
        for wid, plan in t.plans.items():
            entry = active[wid]
            changed = plan != entry.plan
            entry.plan = plan
            members.update(entry, batch_size=plan.batch_size, clock=t.top)
            if changed:
                members.send(wid, PlanUpdate(plan))
        for gone in members.gone.values():  # one that returns rejoins the same round
            gone.facts = dataclasses.replace(gone.facts, clock=min(gone.facts.clock, t.top))
        log.info("policy swapped: %s -> %s %s", old, t.policy.name, dict(t.policy.params))
        return Resolved((), t.first.scale, t.first.actions), t.policy.describe()
