"""The engine's whole training state as a restart needs it (:class:`EngineState`, what a
checkpoint stores), taken from an engine's parts by :func:`capture` and put back by
:func:`restore`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

from hetd.core.applier import Applier
from hetd.core.entries import WorkerEntry, WorkerStats
from hetd.core.members import Members
from hetd.core.policy_host import PolicyHost
from policies.registry import PolicyError, make_policy
from policies.types import ClusterView, Plan, WorkerFacts

log = logging.getLogger("hetd.core.engine")  # one logger for the engine and its parts


@dataclass(frozen=True, slots=True)
class SavedWorker:
    """A worker as a restart remembers it: enough to give it its clock back when it returns."""

    name: str
    clock: int
    samples: int = 0
    idle_s: float = 0.0
    batch_size: int = 32
    codec: str = "none"
    active: bool = False  # it was connected when the state was taken
    last_push: int = 0  # the request id of its last push answered (exactly-once)
    secret: str = ""  # what it must show to resume its id ("": nobody can)


@dataclass(frozen=True, slots=True)
class EngineState:
    """Everything a restart needs (what a checkpoint stores), as host values.

    ``policy_state`` is the policy's own state object; a checkpoint stores a serialised form of it
    (or None: the restored policy's ``init`` rebuilds one), turned back by :meth:`Engine.restore`'s
    ``revive``.
    """

    params: Mapping[str, np.ndarray]  # host copies
    opt_state: Any  # the store's optimizer state (host pytree)
    version: int
    buffers: Mapping[int, Mapping[str, Any]]  # round -> Aggregator.state(), non-empty ones only
    policy: str
    policy_params: Mapping[str, Any]
    policy_state: Any
    stage: str
    updates_applied: int
    next_id: int  # the id the next new worker gets
    workers: Mapping[int, SavedWorker]  # every worker known, active or departed


def capture(members: Members, applier: Applier, host: PolicyHost) -> EngineState:
    """Everything a restart needs, as host copies: parameters, optimizer state and version,
    the non-empty aggregation buffers (a half-finished round is not lost), the policy's name,
    parameters and state, the stage, the counters, and every worker's clock by id and name,
    departed or active (so a reconnecting worker gets its clock back). Run on the engine task."""
    params, opt_state, version = applier.store.state()
    workers: dict[int, SavedWorker] = {}
    for active, table in ((False, members.gone), (True, members.active)):
        for wid, entry in table.items():
            f = entry.facts
            workers[wid] = SavedWorker(
                name=f.name,
                clock=f.clock,
                samples=f.samples,
                idle_s=f.idle_s,
                batch_size=f.batch_size,
                codec=f.codec,
                active=active,
                last_push=entry.last_push,
                secret=entry.secret,
            )
    return EngineState(
        params={k: np.array(v, copy=True) for k, v in params.items()},
        # the next step may donate (reuse) the buffers a host view would share
        opt_state=jax.tree.map(lambda x: np.array(x, copy=True), opt_state),
        version=version,
        buffers=applier.saved_buffers(),
        policy=host.policy.name,
        policy_params=dict(host.policy.params),
        policy_state=host.state,
        stage=host.stage,
        updates_applied=applier.updates_applied,
        next_id=members.next_id,
        workers=workers,
    )


def restore(
    state: EngineState,
    members: Members,
    applier: Applier,
    host: PolicyHost,
    view: Callable[[], ClusterView],
    revive: Callable[[Any, Any], Any] | None = None,
) -> None:
    """Put a saved state into an engine's parts before it serves anyone. Every saved worker is
    known as departed (it gets its id and clock back when it reconnects).

    Raises ValueError, before anything changes, when the parameters do not fit the store's
    model. A saved policy that cannot be made here (:class:`policies.PolicyError`: a plug-in
    went missing) leaves the current one in place, with a warning. ``revive(fresh, saved)``
    turns a saved policy state back into the policy's own (``fresh``: the restored policy's
    ``init``); without it the saved state is taken as it is; a saved None means ``fresh``.
    """
    store = applier.store
    store.restore(state.params, state.opt_state, state.version)
    applier.restore_buffers(state.buffers)
    host.stage = state.stage
    applier.updates_applied = state.updates_applied
    now = members.clock.now()
    for wid, w in state.workers.items():
        facts = WorkerFacts(
            worker=wid,
            name=w.name,
            clock=w.clock,
            version=store.version,
            waiting=True,
            joined_at=now,
            samples=w.samples,
            batch_size=w.batch_size,
            codec=w.codec,
            idle_s=w.idle_s,
        )
        plan = Plan(batch_size=w.batch_size, codec=w.codec, stage=host.stage)
        members.gone[wid] = WorkerEntry(
            facts,
            WorkerStats(),
            plan,
            peer=None,
            last_push=w.last_push,
            secret=w.secret,
            left_at=now,  # retention counts from the restart
        )
    members.next_id = max([members.next_id, state.next_id, *(w + 1 for w in state.workers)])
    try:
        policy = make_policy(state.policy, state.policy_params)
    except PolicyError as exc:
        log.warning("saved policy not restored (%s); keeping %s", exc, host.policy.name)
        return
    fresh = policy.init(view())
    policy_state = fresh
    if state.policy_state is not None:
        policy_state = state.policy_state if revive is None else revive(fresh, state.policy_state)
    host.install(policy, policy_state)
