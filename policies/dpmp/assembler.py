"""The assembler: per-stage partial pushes of a pipeline replica become one whole update, or none.

A replica of ``S`` stages pushes ``S`` *parts* per step, each its stage's accumulated gradient
slice. The assembler keeps them by ``(replica, gen, step)`` and emits :class:`Assembled` only
when every stage's part has arrived, all for the step the engine released with the same base
version and sample count, and their path sets are disjoint and cover the model. Anything else
is :class:`Dropped` with a reason and never reaches the policy: a part of a stale generation, of
a step not released or already aborted or assembled, a duplicate, a stage out of range; a
complete set that overlaps or misses paths aborts its step. :func:`abort` (a stage died) and
:func:`regroup` (a new generation) discard what was pending. Nothing partial is ever applied.

At most one step per replica is pending: releasing step ``t`` aborts an unfinished earlier one.

The state is immutable; every call returns a new one. Tensors ride along untouched as each
part's opaque ``payload``. No clock (times come in), no arrays.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

Key = tuple[int, int, int]  # (replica, gen, step)


@dataclass(frozen=True, slots=True)
class Part:
    """One stage's push for one step."""

    replica: int
    gen: int
    step: int
    stage: int
    base_version: int
    samples: int
    paths: frozenset[str]
    payload: Any = None  # the tensors, by path (opaque here)
    compute_s: float = 0.0  # the stage's own compute time


@dataclass(frozen=True, slots=True)
class Released:
    base_version: int
    samples: int
    at: float  # s, when the engine released it


@dataclass(frozen=True, slots=True)
class Assembled:
    """A whole update: every stage's part, in stage order."""

    replica: int
    gen: int
    step: int
    base_version: int
    samples: int
    parts: tuple[Part, ...]
    wall_s: float  # s from release to the last part
    stage_s: tuple[float, ...]


@dataclass(frozen=True, slots=True)
class Waiting:
    """The part is kept; ``missing`` stages are still to come."""

    missing: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Dropped:
    reason: str


Outcome = Assembled | Waiting | Dropped


@dataclass(frozen=True, slots=True)
class AssemblerState:
    model: frozenset[str]  # every parameter path
    routes: Mapping[int, tuple[int, int]] = field(default_factory=dict)  # replica -> (gen, S)
    released: Mapping[Key, Released] = field(default_factory=dict)
    pending: Mapping[Key, Mapping[int, Part]] = field(default_factory=dict)
    latest: Mapping[int, int] = field(default_factory=dict)  # replica -> last released step
    aborted: int = 0  # steps aborted so far (bounded state: O(replicas) whatever arrives)

    def pending_steps(self) -> int:
        return len(self.released)


def regroup(state: AssemblerState, replica: int, gen: int, stages: int) -> AssemblerState:
    """Replica ``replica`` is now generation ``gen`` with ``stages`` stages (0 removes it): its
    pending steps of any earlier generation are discarded."""
    old = state.routes.get(replica)
    if old is not None and gen <= old[0] and stages > 0:
        raise ValueError(f"replica {replica}: generation {gen} is not newer than {old[0]}")
    if stages < 0:
        raise ValueError(f"stages must be >= 0, got {stages}")
    routes = dict(state.routes)
    latest = dict(state.latest)
    latest.pop(replica, None)
    if stages == 0:
        routes.pop(replica, None)
    else:
        routes[replica] = (gen, stages)
    gone = [k for k in state.released if k[0] == replica]
    return _discard(replace(state, routes=routes, latest=latest), gone)


def _discard(state: AssemblerState, keys: list[Key]) -> AssemblerState:
    if not keys:
        return state
    released = {k: v for k, v in state.released.items() if k not in keys}
    pending = {k: v for k, v in state.pending.items() if k not in keys}
    return replace(state, released=released, pending=pending, aborted=state.aborted + len(keys))


def release(
    state: AssemblerState,
    replica: int,
    step: int,
    base_version: int,
    samples: int,
    now: float,
) -> AssemblerState:
    """The engine released ``step`` of ``replica`` (its current generation) from
    ``base_version`` for ``samples`` samples. An unfinished earlier step is aborted."""
    route = state.routes.get(replica)
    if route is None:
        raise ValueError(f"replica {replica} has no route; regroup it first")
    last = state.latest.get(replica)
    if last is not None and step <= last:
        raise ValueError(
            f"step {step} of replica {replica} gen {route[0]} is not after its last release {last}"
        )
    if samples < 1:
        raise ValueError(f"a release needs samples >= 1, got {samples}")
    state = _discard(state, [k for k in state.released if k[0] == replica])
    released = {**state.released, (replica, route[0], step): Released(base_version, samples, now)}
    return replace(state, released=released, latest={**state.latest, replica: step})


def abort(state: AssemblerState, replica: int, reason: str = "") -> AssemblerState:
    """A stage of ``replica`` died or the step was cancelled: discard its pending step."""
    del reason  # recorded by the caller; nothing partial survives either way
    return _discard(state, [k for k in state.released if k[0] == replica])


def offer(state: AssemblerState, part: Part, now: float) -> tuple[Outcome, AssemblerState]:
    """Take one part: :class:`Waiting`, :class:`Assembled` (the step closes) or
    :class:`Dropped` (the state unchanged, or the step aborted when its parts do not fit)."""
    route = state.routes.get(part.replica)
    if route is None:
        return Dropped(f"unknown replica {part.replica}"), state
    gen, stages = route
    if part.gen != gen:
        return Dropped(f"stale generation {part.gen} (replica {part.replica} is at {gen})"), state
    key = (part.replica, part.gen, part.step)
    rel = state.released.get(key)
    if rel is None:
        last = state.latest.get(part.replica)
        if last is not None and part.step <= last:
            return Dropped(f"step {part.step} already assembled, aborted or superseded"), state
        return Dropped(f"step {part.step} of replica {part.replica} was not released"), state
    if not 0 <= part.stage < stages:
        return Dropped(f"stage {part.stage} out of range 0..{stages - 1}"), state
    have = state.pending.get(key, {})
    if part.stage in have:
        return Dropped(f"duplicate part from stage {part.stage}"), state
    if part.base_version != rel.base_version or part.samples != rel.samples:
        return Dropped(
            f"part of stage {part.stage} is for base {part.base_version}/{part.samples} samples; "
            f"the release was {rel.base_version}/{rel.samples}"
        ), state
    have = {**have, part.stage: part}
    if len(have) < stages:
        pending = {**state.pending, key: have}
        missing = tuple(s for s in range(stages) if s not in have)
        return Waiting(missing), replace(state, pending=pending)
    parts = tuple(have[s] for s in range(stages))
    seen: set[str] = set()
    for p in parts:
        if seen & p.paths:
            return Dropped(f"parts overlap on {sorted(seen & p.paths)[:3]}"), _discard(state, [key])
        seen |= p.paths
    if seen != state.model:
        missing_paths = sorted(state.model - seen)[:3]
        extra = sorted(seen - state.model)[:3]
        why = f"parts miss {missing_paths}" if missing_paths else f"parts carry unknown {extra}"
        return Dropped(why), _discard(state, [key])
    done = Assembled(
        replica=part.replica,
        gen=gen,
        step=part.step,
        base_version=rel.base_version,
        samples=rel.samples,
        parts=parts,
        wall_s=max(0.0, now - rel.at),
        stage_s=tuple(p.compute_s for p in parts),
    )
    released = {k: v for k, v in state.released.items() if k != key}
    pending = {k: v for k, v in state.pending.items() if k != key}
    return done, replace(state, released=released, pending=pending)
