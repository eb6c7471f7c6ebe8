"""The policy in the engine, a part of :class:`hetd.core.engine.Engine` (:class:`PolicyHost`): the
running policy and its state, the training stage and its switches; asking the policy about an
event (a policy's bug falls back to asynchronous training, never stops it); and the trial run of a
policy to swap in, which refuses before anything changes.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from hetd.core.peers import Clock
from hetd.core.store import make_outer
from policies.compose import Resolved, resolve
from policies.registry import PolicyError, make_policy
from policies.types import (
    Apply,
    ClusterView,
    Event,
    Plan,
    Policy,
    SetPlan,
    SetStage,
    Tick,
    WorkerFacts,
)

log = logging.getLogger("hetd.core.engine")  # one logger for the engine and its parts


@dataclass(frozen=True)
class Known:
    """What the engine's view says of the model and the training, carried into a swap's trial
    view: the model's blocks, the gradient noise scale, the workers' optimizer
    (:class:`policies.types.ClusterView`'s fields of those names)."""

    blocks: tuple[tuple[float, float, float], ...] = ()
    noise_scale: float | None = None
    optimizer: str | None = None


@dataclass(frozen=True)
class Trial:
    """A policy that started on a trial view: what a swap then installs."""

    policy: Policy
    state: Any
    stage: str
    plans: dict[int, Plan]  # each worker's plan under it
    first: Resolved  # its first decisions (its releases and flushes are carried out)
    outer: str | None  # the outer optimizer spec it runs with (None: unchanged)
    top: int  # the clock every worker starts its first round on


class PolicyHost:
    """The policy, its state and the stage."""

    def __init__(self, policy: Policy, clock: Clock, started_at: float) -> None:
        self.policy = policy
        self.state: Any = None  # the engine sets policy.init(its view) once it can make one
        self.clock = clock
        self.started_at = started_at
        self.stage = "main"
        self.stages: list[tuple[float, str]] = []  # (t since start, stage entered), each switch

    def decide(self, event: Event, view: ClusterView, push: bool) -> Resolved:
        """The policy's resolved decisions on ``event`` (its state moves on). A policy that fails
        keeps its state, and a push is applied asynchronously."""
        try:
            decisions, state = self.policy.update(event, self.state, view)
            resolved = resolve(decisions)  # raises on a policy bug (e.g. an unknown plan field)
        except Exception:
            log.exception(
                "policy %s failed on %s; applying asynchronously", self.policy.name, event
            )
            fallback = (Apply(1.0 / max(1, len(view.workers))),) if push else ()
            return resolve(fallback)
        self.state = state
        return resolved

    def enter(self, stage: str, why: str = "") -> bool:
        """Switch to ``stage`` (recorded with its time); whether it changed."""
        if stage == self.stage:
            return False
        at = self.clock.now() - self.started_at
        log.info("stage %s -> %s at %.2f s%s", self.stage, stage, at, f" ({why})" if why else "")
        self.stage = stage
        self.stages.append((at, stage))
        return True

    def trial(
        self,
        name: str,
        params: Mapping[str, Any] | None,
        visible: Mapping[int, WorkerFacts],
        default_plan: Callable[[WorkerFacts], Plan],
        version: int,
        global_batch: int,
        outer_for: Callable[[str, Mapping[str, Any]], str] | None,
        known: Known = Known(),
    ) -> Trial:
        """Build policy ``name``, initialise it and ask for its first decisions (a ``Tick``) on a
        trial view in which every worker of ``visible`` has its default plan, the stage is
        ``"main"`` and nothing is buffered; ``known``: what the engine's own view says of the
        model and the training that no swap changes (a policy swapped in sees what one built
        at the start sees). Raises :class:`PolicyError` on any error; nothing here changes."""
        new = make_policy(name, params)
        now = self.clock.now()
        plans = {wid: default_plan(f) for wid, f in visible.items()}
        # Every worker starts the new policy's first round together: clocks counted under the
        # old one (under asp the fast workers run rounds ahead) would make a synchronous policy
        # hold them until the slowest caught up (seen: 2 s without an update after asp -> bsp).
        top = max((f.clock for f in visible.values()), default=0)
        view = ClusterView(
            now=now,
            version=version,
            workers={
                wid: dataclasses.replace(f, batch_size=plans[wid].batch_size, clock=top)
                for wid, f in visible.items()
            },
            global_batch=global_batch,
            buffered=0,
            stage="main",
            blocks=known.blocks,
            noise_scale=known.noise_scale,
            optimizer=known.optimizer,
        )
        stage = "main"
        try:
            outer = None if outer_for is None else outer_for(name, new.params)
            if outer is not None:
                make_outer(outer)  # a bad spec refuses the swap here
            decisions, state = new.update(Tick(now), new.init(view), view)
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
        return Trial(new, state, stage, plans, first, outer, top)

    def install(self, policy: Policy, state: Any) -> None:
        self.policy, self.state = policy, state
