"""Combining policies and their decisions.

Owns :func:`compose`, which chains concerns (a gate, a weight rule, a batch-share planner) like
``optax.chain``; :func:`resolve`, the rules that turn one event's decisions into the
:class:`Resolved` record the engine carries out; and two helpers policies share,
:func:`release_waiting` and :func:`describe_state`. Pure: no I/O, no clock.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from policies.types import (
    Apply,
    Buffer,
    ClusterView,
    Decision,
    Drop,
    Event,
    Flush,
    Policy,
    PushDecision,
    Regroup,
    Release,
    RestartOptimizer,
    Scale,
    SetPlan,
    SetStage,
    WorkerFacts,
    check_plan_fields,
)


def compose(*policies: Policy, name: str | None = None) -> Policy:
    """Chain concerns: each sees every event; their decisions are concatenated in order.

    The first is usually the gate (Apply/Buffer, Release); later ones add ``Scale`` (weights),
    ``SetPlan`` (batch shares, codecs) or ``SetStage``. The state is the tuple of member states.
    """
    if not policies:
        raise ValueError("compose needs at least one policy")

    def init(view: ClusterView) -> tuple[Any, ...]:
        return tuple(p.init(view) for p in policies)

    def update(
        event: Event, state: tuple[Any, ...], view: ClusterView
    ) -> tuple[Sequence[Decision], tuple[Any, ...]]:
        out: list[Decision] = []
        new_states = []
        for p, s in zip(policies, state, strict=True):
            decisions, s2 = p.update(event, s, view)
            out.extend(decisions)
            new_states.append(s2)
        return out, tuple(new_states)

    params = {p.name: dict(p.params) for p in policies}
    name = name or "+".join(p.name for p in policies)
    return Policy(name, init, update, params, reads_evals=any(p.reads_evals for p in policies))


@dataclass(frozen=True, slots=True)
class Resolved:
    """One event's decisions as the engine carries them out: ``plans`` first (so a worker released
    by this event computes under its new plan), then ``actions`` in order."""

    plans: tuple[SetStage | SetPlan | Regroup, ...] = ()  # in the order decided
    scale: float = 1.0  # the product of every Scale: multiplies the push decision's weight
    # Flushes, releases and optimizer restarts in the order decided, with at most one push
    # decision (the first) in its place; the engine ignores the push decision when the event
    # carries no push.
    actions: tuple[PushDecision | Flush | Release | RestartOptimizer, ...] = ()

    @property
    def push(self) -> PushDecision | None:
        """What becomes of the current push (None: nothing was decided)."""
        for a in self.actions:
            if isinstance(a, Apply | Buffer | Drop):
                return a
        return None


def resolve(decisions: Iterable[Decision]) -> Resolved:
    """The rules that combine one event's decisions:

    * ``Scale`` factors multiply (into :attr:`Resolved.scale`);
    * ``SetStage``, ``SetPlan`` and ``Regroup`` come first, in order; a ``SetPlan`` naming a field a plan does
      not have, or a value of the wrong kind, raises ValueError (a policy bug);
    * the first ``Apply``/``Buffer``/``Drop`` decides the push; later ones are ignored;
    * ``Flush``, ``Release`` and ``RestartOptimizer`` are kept in order, the push decision in
      its place among them.
    """
    scale = 1.0
    plans: list[SetStage | SetPlan | Regroup] = []
    actions: list[PushDecision | Flush | Release | RestartOptimizer] = []
    decided = False
    for d in decisions:
        if isinstance(d, Scale):
            scale *= d.factor
        elif isinstance(d, SetPlan):
            check_plan_fields(d.fields)
            plans.append(d)
        elif isinstance(d, SetStage | Regroup):
            plans.append(d)
        elif isinstance(d, Apply | Buffer | Drop):
            if not decided:
                decided = True
                actions.append(d)
        elif isinstance(d, Flush | Release | RestartOptimizer):
            actions.append(d)
        else:
            raise TypeError(f"not a decision: {d!r}")
    return Resolved(tuple(plans), scale, tuple(actions))


def describe_state(state: Any, depth: int = 0) -> Any:
    """A policy state as plain JSON values for status pages: its own ``describe()`` when it has one,
    else its fields (mappings with string keys, sequences as lists)."""
    if depth > 6:
        return None
    describe = getattr(state, "describe", None)
    if callable(describe):
        return describe()
    if dataclasses.is_dataclass(state) and not isinstance(state, type):
        return {
            f.name: describe_state(getattr(state, f.name), depth + 1)
            for f in dataclasses.fields(state)
        }
    if isinstance(state, Mapping):
        return {str(k): describe_state(v, depth + 1) for k, v in state.items()}
    if isinstance(state, list | tuple):
        return [describe_state(v, depth + 1) for v in state]
    if state is None or isinstance(state, bool | int | float | str):
        return state
    return repr(state)


def release_waiting(view: ClusterView, may_proceed: Callable[[WorkerFacts], bool]) -> list[Release]:
    """Release every waiting replica for which ``may_proceed`` holds."""
    return [Release(w) for w, f in view.workers.items() if f.waiting and may_proceed(f)]
