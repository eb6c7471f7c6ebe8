"""Policy decisions, a part of :class:`hetd.core.engine.Engine`: each event goes to the policy
(:meth:`DecisionsMixin._dispatch`), and its resolved decisions are carried out — plans and the
stage first, then flushes, releases and the push's apply, buffer or drop, each push acked; and
:meth:`DecisionsMixin.swap_policy` replaces the policy between two events, all or nothing.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from typing import Any

from hetd.core.publish import PublishMixin
from hetd.core.store import Aggregator, make_outer
from hetd.protocol.messages import Ack, AckStatus, PlanUpdate, PushIn
from policies.compose import Resolved, resolve
from policies.registry import PolicyError, make_policy
from policies.types import (
    Apply,
    Buffer,
    ClusterView,
    Drop,
    Event,
    Flush,
    Plan,
    PushDecision,
    Regroup,
    Release,
    SetPlan,
    SetStage,
    Tick,
    WorkerFacts,
)

log = logging.getLogger("hetd.core.engine")  # one logger for the engine and its parts


class DecisionsMixin(PublishMixin):
    """:meth:`swap_policy` and the carrying out of a policy's decisions."""

    def swap_policy(self, name: str, params: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """Replace the policy between two events, all or nothing.

        The new policy is built, initialised and asked for its first decisions (a ``Tick``) on a
        trial view in which every active worker's plan is back at its defaults (a join's plan),
        the stage is ``"main"`` and nothing is buffered; its plans and stage are worked out from
        those decisions. Any error on the way raises :class:`PolicyError` and nothing has changed:
        the old policy, its state, the stage and every plan stay. Then the swap is carried out:
        buffered pushes are applied (never lost), the policy, its state, the stage and the plans
        change together (each worker whose plan changed is told once), and the first decisions'
        releases and flushes are carried out.
        """
        new = make_policy(name, params)
        now = self.clock.now()
        # the replicas and data-parallel workers the policy sees (not a replica's later stages)
        visible = {wid: e for wid, e in self._workers.items() if wid in self._facts}
        plans = {wid: self._default_plan(e.facts, "main") for wid, e in visible.items()}
        # Every worker starts the new policy's first round together: clocks counted under the
        # old one (under asp the fast workers run rounds ahead) would make a synchronous policy
        # hold them until the slowest caught up (seen: 2 s without an update after asp -> bsp).
        top = max((e.facts.clock for e in visible.values()), default=0)
        trial = ClusterView(
            now=now,
            version=self.store.version,
            workers={
                wid: dataclasses.replace(e.facts, batch_size=plans[wid].batch_size, clock=top)
                for wid, e in visible.items()
            },
            global_batch=self.config.global_batch,
            buffered=0,
            stage="main",
        )
        stage = "main"
        try:
            outer = (
                None if self.config.outer_for is None else self.config.outer_for(name, new.params)
            )
            if outer is not None:
                make_outer(outer)  # a bad spec refuses the swap here
            decisions, state = new.update(Tick(now), new.init(trial), trial)
            first = resolve(decisions)  # raises on an unknown plan field or a wrong value
            for d in first.plans:
                if isinstance(d, SetStage):
                    stage = d.stage
                    plans = {wid: plan.merge({"stage": stage}) for wid, plan in plans.items()}
                elif isinstance(d, SetPlan) and d.worker in plans:
                    plans[d.worker] = plans[d.worker].merge(d.fields)
        except Exception as exc:
            raise PolicyError(
                f"policy {name!r} failed to start: {type(exc).__name__}: {exc}"
            ) from exc
        # Nothing below refuses: the swap happens as a whole.
        if self.buffered():  # never lose buffered updates: apply them before the change
            self._flush(Flush(normalize=True))
        old = self.policy.name
        self.policy, self.policy_state = new, state
        # after the flush, which applied the old policy's rounds through the old one
        if outer is not None and self.store.set_outer(outer):
            log.info("outer optimizer -> %s (state reset)", self.store.outer_spec)
        if stage != self.stage:
            at = now - self.started_at
            log.info("stage %s -> %s at %.2f s (policy swap)", self.stage, stage, at)
            self.stage = stage
            self.stages.append((at, stage))
        for wid, plan in plans.items():
            entry = self._workers[wid]
            changed = plan != entry.plan
            entry.plan = plan
            self._put(
                entry, dataclasses.replace(entry.facts, batch_size=plan.batch_size, clock=top)
            )
            if changed and entry.peer is not None:
                entry.peer.send(PlanUpdate(plan))
        for entry in self._departed.values():  # one that returns rejoins the same round
            entry.facts = dataclasses.replace(entry.facts, clock=min(entry.facts.clock, top))
        log.info("policy swapped: %s -> %s %s", old, new.name, dict(new.params))
        self._execute(Resolved((), first.scale, first.actions), None)
        return new.describe()

    def _default_plan(self, facts: WorkerFacts, stage: str) -> Plan:
        """A worker's plan before any policy changes it: the configured batch, pushes in the
        codec its parameters come in, nothing else set."""
        return Plan(batch_size=self.config.batch_size, codec=facts.codec, stage=stage)

    def _dispatch(self, event: Event, push: PushIn | None = None) -> None:
        try:
            decisions, state = self.policy.update(event, self.policy_state, self.view())
            resolved = resolve(decisions)  # raises on a policy bug (e.g. an unknown plan field)
        except Exception:
            log.exception(
                "policy %s failed on %s; applying asynchronously", self.policy.name, event
            )
            state = self.policy_state
            fallback = () if push is None else (Apply(1.0 / max(1, len(self.facts))),)
            resolved = resolve(fallback)
        self.policy_state = state
        self._execute(resolved, push)

    def _execute(self, r: Resolved, push: PushIn | None) -> None:
        """Carry out one event's resolved decisions (the rules are :func:`policies.resolve`'s)."""
        # Plans first, so a worker released by this event computes under its new plan.
        for d in r.plans:
            if isinstance(d, SetStage):
                self._set_stage(d.stage)
            elif isinstance(d, Regroup):
                self._regroup(d.replicas)
            else:
                self._set_plan(d.worker, d.fields)
        for a in r.actions:
            if isinstance(a, Flush):
                self._flush(a)
            elif isinstance(a, Release):
                self._release(a.worker)
            elif push is not None:
                self._decide_push(a, push, r.scale)
        if push is not None and r.push is None:
            # A policy that says nothing about a push must not lose it.
            log.warning("policy %s made no decision on a push; applying it", self.policy.name)
            self._decide_push(Apply(1.0 / max(1, len(self.facts))), push, r.scale)

    def _decide_push(self, d: PushDecision, p: PushIn, factor: float) -> None:
        st = self.stats[p.worker]
        if isinstance(d, Apply):
            self.store.apply(p.kind, p.tensors, d.weight * factor)
            self.updates_applied += 1
            st.applied += 1
            self._ack(p, "applied")
        elif isinstance(d, Buffer):
            self.buffers.setdefault(d.group, Aggregator()).add(p.kind, p.tensors, d.weight * factor)
            st.buffered += 1
            self._ack(p, "buffered")
        elif isinstance(d, Drop):
            st.dropped += 1
            self._ack(p, "dropped", d.reason)

    def _flush(self, d: Flush) -> None:
        groups = sorted(g for g in self.buffers if d.upto is None or g <= d.upto)
        for g in groups:
            agg = self.buffers.pop(g, None)
            if agg is None or not agg.count:
                continue
            for kind, tensors in agg.take(d.normalize):
                self.store.apply(kind, tensors, d.scale)
            self.updates_applied += 1

    def _set_plan(self, wid: int, fields: Mapping[str, Any]) -> None:
        entry = self._workers.get(wid)
        if entry is None:
            return
        plan = entry.plan
        new = plan.merge(fields)  # checked: resolve() raised on unknown fields already
        if new == plan:
            return
        entry.plan = new
        self._put(entry, dataclasses.replace(entry.facts, batch_size=new.batch_size))
        if entry.peer is not None:
            entry.peer.send(PlanUpdate(new))

    def _set_stage(self, stage: str) -> None:
        if stage == self.stage:
            return
        at = self.clock.now() - self.started_at
        log.info("stage %s -> %s at %.2f s", self.stage, stage, at)
        self.stage = stage
        self.stages.append((at, stage))
        for wid in list(self._workers):
            self._set_plan(wid, {"stage": stage})

    def _ack(self, p: PushIn, status: AckStatus, reason: str | None = None) -> None:
        entry = self._workers.get(p.worker)
        if entry is not None and entry.peer is not None:
            entry.peer.send(Ack(p.id, self.store.version, status, reason))
