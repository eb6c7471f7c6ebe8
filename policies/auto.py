"""``auto``: a policy that runs one of its candidates and switches to another on a planner's forecast.

Owns the ``auto`` factory, its state (:class:`AutoState`) and how it weighs a forecast
(:class:`Scored`, :class:`Choice`); parsing the candidates is :mod:`policies.auto_choice`.

``auto`` wraps an inner policy and hands it every event; its decisions pass through unchanged. On a
:class:`Forecast` (a planner's predictions of the candidates) it discounts each prediction by the
model's recent error, and switches when the best beats the running policy by a margin after a
minimum dwell. A switch is made safe as the engine's swap makes it: buffered pushes are flushed,
every plan goes back to its default, and the new policy sees every worker start its first round
together (auto keeps per-worker clock offsets and shows the inner policy levelled clocks).
docs/policies.md §15 says why each rule is as it is.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any

from policies.auto_choice import (
    DEFAULT_CANDIDATES,
    Choice,
    ErrorLog,
    Key,
    Scored,
    canonical,
    check_candidates,
    key_of,
    label,
    parse_candidates,
    weigh,
)
from policies.compose import describe_state, resolve
from policies.efficiency import ADAPTIVE
from policies.registry import make_policy, register
from policies.twin_worker import exchange_s, moved_s
from policies.types import (
    Apply,
    Buffer,
    ClusterView,
    Decision,
    Drop,
    Event,
    Flush,
    Forecast,
    Join,
    Leave,
    Plan,
    Policy,
    Push,
    Regroup,
    RestartOptimizer,
    SetPlan,
    SetStage,
    Tick,
)

HISTORY = 8  # switches kept in the state, for status pages
# What a switch is taken to cost [D]: this many rounds of the slowest worker (the round the old
# policy leaves half done and the new policy's first, whose plans and batches change), to be
# paid back within the dwell.
SWITCH_ROUNDS = 2
# The policy run before the first forecast [D]: ashl, whose profiling stage trains without a
# barrier (ASP-style pushes, no worker waits on one whose speed nobody knows yet: lbbsp's first
# round gives every worker the same batch and holds the fast ones for the slowest) while it times
# the workers, so where the first forecast keeps ashl (the best fixed policy on most clusters we
# measured) nothing is switched and auto is ashl alone, to the decision. Measured against the asp
# warm-up before it (sim, 3 seeds, auto/ashl where ashl was chosen): the packaged SGD scenarios
# 0.90-1.00 with asp, 1.00 with ashl; twelve held-out SGD clusters (heavy-ball and Nesterov
# momentum among them) up to 1.20 with asp (1.35 at 7 seeds on one), 1.00 with ashl: the asp
# warm-up moved the start of ashl's AHL stage to the forecast, a perturbation whose sign varies
# by cluster and seed; docs/policies.md §15. Where ashl is not a candidate, asp (under an
# adaptive optimizer none: see below).
WARMUP = "ashl"
WARMUP_FALLBACK = "asp"
# Under an adaptive optimizer (Adam) a switch that ends the warm-up restarts the daemon's
# optimizer: Adam's moments averaged over the warm-up's small, stale steps (its bias correction
# weighs every step alike for the first thousand) would scale the next policy's larger updates
# down for the rest of the run (peer_adam, 7 seeds: lbbsp after a warm-up 1.05x lbbsp alone,
# after a warm-up and a restart 0.83x), docs/policies.md §15.


def _empty() -> Mapping[Any, Any]:
    return MappingProxyType({})


@dataclass(frozen=True, slots=True)
class AutoState:
    """The running inner policy and what a switch needs."""

    name: str  # the inner policy's registered name
    params: tuple[tuple[str, Any], ...]  # its parameters as given, (key, value) sorted by key
    inner: Any  # its state
    since: float  # s, engine clock: when it started
    checks: int = 0  # times its throughput was checked against a prediction since it started
    # Clocks the inner policy sees: a worker's clock plus its offset (absent: 0).
    offsets: Mapping[int, int] = field(default_factory=_empty)
    # Each worker's batch before any policy changed it (at auto's start, or at its join).
    base_batch: Mapping[int, int] = field(default_factory=_empty)
    # The running policy's realized throughput since the last forecast, against its prediction.
    window_start: float | None = None  # s; None: no prediction to check yet
    window_samples: int = 0  # samples of the pushes the inner policy applied or buffered since
    window_predicted: float = 0.0  # samples/s the last forecast predicted for the running policy
    errors: ErrorLog = field(default_factory=ErrorLog)
    # A candidate that failed to start: label -> (s, forecasts_total then); it sits out a dwell.
    failed: Mapping[str, tuple[float, int]] = field(default_factory=_empty)
    forecasts_total: int = 0  # forecasts received since auto started
    # True while the warm-up policy runs: before the first forecast (or the warm-up's end)
    warming: bool = False
    # True when a forecast chose the running policy (a dwell holds it), not the start or warm-up
    chosen: bool = False
    last: Choice | None = None  # the last forecast's weighing
    switches: tuple[tuple[float, str, str, str], ...] = ()  # (s, from, to, why), last HISTORY

    def describe(self) -> dict[str, Any]:
        """The running policy, its dwell, the last weighing and the switches, as plain values."""
        return {
            "policy": canonical(key_of(self.name, self.params)),
            "warming_up": self.warming,
            "since_s": self.since,
            "checks": self.checks,
            "offsets": {str(w): o for w, o in sorted(self.offsets.items())},
            "model_error": self.errors.describe(),
            "failed": {k: t for k, (t, _) in sorted(self.failed.items())},
            "last_choice": None if self.last is None else self.last.describe(),
            "switches": [
                {"at_s": t, "from": a, "to": b, "why": why} for t, a, b, why in self.switches
            ],
            "inner": describe_state(self.inner),
        }

    def shifted(self, dt: float) -> AutoState:
        """The same state with every engine-clock time moved by ``dt`` s (a checkpoint restored
        under another clock), the inner policy's state included."""
        return replace(
            self,
            inner=_shift(self.inner, dt),
            since=self.since + dt,
            window_start=None if self.window_start is None else self.window_start + dt,
            failed=MappingProxyType({k: (t + dt, n) for k, (t, n) in self.failed.items()}),
            last=None if self.last is None else replace(self.last, at=self.last.at + dt),
            switches=tuple((t + dt, a, b, why) for t, a, b, why in self.switches),
        )


def _shift(state: Any, dt: float) -> Any:
    """``state`` with its times moved by ``dt``: each object's own ``shifted``, through tuples,
    lists and mappings (as the checkpoint does for a policy's state)."""
    shifted = getattr(state, "shifted", None)
    if callable(shifted) and not isinstance(state, type):
        return shifted(dt)
    if isinstance(state, tuple) and hasattr(type(state), "_fields"):
        return type(state)(*(_shift(x, dt) for x in state))
    if isinstance(state, tuple | list):
        return type(state)(_shift(x, dt) for x in state)
    if isinstance(state, MappingProxyType):
        return MappingProxyType({k: _shift(v, dt) for k, v in state.items()})
    if isinstance(state, dict):
        return {k: _shift(v, dt) for k, v in state.items()}
    return state


def levelled(view: ClusterView, offsets: Mapping[int, int]) -> ClusterView:
    """The view the inner policy sees: each worker's clock plus its offset."""
    if not any(offsets.get(w, 0) for w in view.workers):
        return view
    workers = {
        w: replace(f, clock=f.clock + offsets[w]) if offsets.get(w, 0) else f
        for w, f in view.workers.items()
    }
    return replace(view, workers=workers)


def join_offset(view: ClusterView, offsets: Mapping[int, int], worker: int) -> int:
    """The offset of a worker that joins: the engine placed it relative to the slowest of the
    others (a newcomer at the slowest clock, one that returns at its own, never below); the inner
    view keeps that place relative to the slowest of the others' levelled clocks."""
    others = [(f.clock, offsets.get(w, 0)) for w, f in view.workers.items() if w != worker]
    if not others:
        return 0
    return min(c + o for c, o in others) - min(c for c, _ in others)


def default_plan_fields(batch_size: int, codec: str) -> dict[str, Any]:
    """Every plan field at its default: the worker's own batch and negotiated codec, one local
    step, no pipelining, stage ``main``, no optional field set."""
    plan = Plan(batch_size=batch_size, codec=codec)
    return {f.name: getattr(plan, f.name) for f in dataclasses.fields(Plan)}


def switch_cost_s(view: ClusterView) -> float:
    """Seconds a switch costs the cluster: :data:`SWITCH_ROUNDS` rounds of its slowest worker,
    each worker's round its compute time (the engine's average) and its push's round trip (the
    links as measured and what the twin reads beyond them, :func:`exchange_s`), else, before
    it reported one, its last two pushes apart. Not the last cycle alone: in real mode one
    cycle holds whatever stalled it (a compile at a new batch shape, the first planning round's
    CPU), and on peer_adam one of 0.26 s made a switch look to cost half of a 1 s dwell."""
    extra = exchange_s(view)
    rounds = [0.0]
    for f in view.workers.values():
        if f.compute_s is not None:
            rounds.append(max(0.0, f.compute_s) + moved_s(f) + extra)
        elif f.last_push_at is not None and f.prev_push_at is not None:
            rounds.append(f.last_push_at - f.prev_push_at)
    return SWITCH_ROUNDS * max(rounds)


def adaptive(optimizer: str | None) -> bool:
    """Whether ``optimizer`` (``name[:options]``) keeps per-coordinate moments (Adam and its
    kind, :data:`policies.efficiency.ADAPTIVE`)."""
    return (optimizer or "").partition(":")[0].strip().lower() in ADAPTIVE


def _warmup(
    warmup: str, allowed: frozenset[Key], start: Key, default: bool = False
) -> tuple[str, tuple[tuple[str, Any], ...]] | None:
    """The warm-up candidate as (name, params), or None: none asked for (``""``), the start
    policy itself, or a ``default`` (:data:`WARMUP`, :data:`WARMUP_FALLBACK`) where it is not a
    candidate. Raises ValueError for another policy that is not a candidate."""
    if not isinstance(warmup, str):
        raise ValueError(f"warmup must name a candidate or be empty, got {warmup!r}")
    if not warmup.strip():
        return None
    parsed = parse_candidates(warmup)
    if len(parsed) != 1:
        raise ValueError(f"warmup must name one policy, got {warmup!r}")
    key = key_of(*parsed[0])
    if key not in allowed:
        if default:
            return None
        raise ValueError(f"warmup {warmup!r} must be one of the candidates (or empty)")
    return None if key == start else parsed[0]


def _net(scored: Scored, running: Key, cost: float) -> float:
    """A candidate's discounted goodput less the switch it takes (none for the running policy):
    during the warm-up the start policy is a switch too, so it pays as the best does."""
    return scored.discounted if scored.key == running else scored.discounted * (1.0 - cost)


def _after(net: float, scored: Scored, running: Key, cost: float, lead: str = "") -> str:
    """How :func:`_net` came out, for a choice's reason ("" for the running policy)."""
    if scored.key == running:
        return "no switch" if not lead else ""
    return f"{lead}{net:.4g} after {cost:.0%} for the switch"


def _applied_samples(event: Push, decisions: Sequence[Decision]) -> int:
    """The push's samples unless the inner policy dropped it (no decision: the engine applies)."""
    for d in decisions:
        if isinstance(d, Drop):
            return 0
        if isinstance(d, Apply | Buffer):
            return event.samples
    return event.samples


@register("auto")
def auto(
    start: str = "lbbsp",
    candidates: str | Sequence[str] = ",".join(DEFAULT_CANDIDATES),
    margin: float = 0.10,
    dwell_s: float = 30.0,
    dwell_checks: int = 1,
    warmup: str = WARMUP,
    warmup_s: float = 5.0,
) -> Policy:
    """Run ``start`` (a candidate, ``name[:key=value;...]``) and switch among ``candidates`` (a
    comma-separated string or a sequence of such items) on a planner's forecasts: to the best
    shortfall-discounted goodput when, less the switch's cost (:func:`switch_cost_s` over the
    dwell), it beats the running policy's by ``margin`` (0.10: 10 %, the model's error where no
    check measured it; the switch's own cost is charged apart) and the running policy has run at least ``dwell_s`` seconds and its throughput was checked
    against a prediction at least ``dwell_checks`` times (from one forecast to the next). The
    start policy is a default, not a choice: no dwell holds it, and the first forecast may move
    auto off it. Until that first forecast auto runs ``warmup`` (ashl, whose profiling stage
    trains without a barrier while it times the workers, so no worker waits on one the twin
    cannot time yet, and where the forecast keeps ashl nothing switches; where ashl is not a
    candidate asp, or under an adaptive optimizer none; under an adaptive optimizer a switch off
    the warm-up restarts the daemon's optimizer; ``""`` or the start policy: none), and the
    first forecast weighs the best candidate
    against ``start``, not against the warm-up: auto goes to the best when it beats ``start`` by
    the margin, else to ``start``. Without a forecast in ``warmup_s`` seconds, ``start``. Candidates that need an outer optimizer of their own (the DiLoCo family)
    cannot be switched to here: the engine sets that optimizer on its own swap."""
    cands = parse_candidates(candidates)
    check_candidates(cands)
    first = parse_candidates(start)
    if len(first) != 1:
        raise ValueError(f"start must name one policy, got {start!r}")
    first_key = key_of(*first[0])
    if first_key not in {key_of(n, p) for n, p in cands}:
        raise ValueError(f"start {start!r} must be one of the candidates ({candidates!r})")
    if isinstance(margin, bool) or not isinstance(margin, int | float) or not margin >= 0:
        raise ValueError(f"margin must be >= 0 (0.1: a 10 % better prediction), got {margin!r}")
    if isinstance(dwell_s, bool) or not isinstance(dwell_s, int | float) or not dwell_s >= 0:
        raise ValueError(f"dwell_s must be >= 0 (seconds), got {dwell_s!r}")
    if not isinstance(dwell_checks, int) or isinstance(dwell_checks, bool) or dwell_checks < 0:
        raise ValueError(f"dwell_checks must be an int >= 0, got {dwell_checks!r}")
    allowed = frozenset(key_of(n, p) for n, p in cands)
    warm = _warmup(warmup, allowed, first_key, default=warmup == WARMUP)
    # the default's forms where ashl is no candidate: asp, and under an adaptive optimizer (the
    # view's, known at init) none
    warm_adaptive = warm
    if warmup == WARMUP and key_of(WARMUP, ()) not in allowed:
        warm = _warmup(WARMUP_FALLBACK, allowed, first_key, True)
    if isinstance(warmup_s, bool) or not isinstance(warmup_s, int | float) or not warmup_s >= 0:
        raise ValueError(f"warmup_s must be >= 0 (seconds), got {warmup_s!r}")
    built: dict[tuple[str, str], Policy] = {}  # memo of a pure function: name, params -> Policy

    def policy_of(name: str, params: tuple[tuple[str, Any], ...]) -> Policy:
        k = (name, repr(params))
        if k not in built:
            built[k] = make_policy(name, dict(params))
        return built[k]

    def warmup_of(view: ClusterView) -> tuple[str, tuple[tuple[str, Any], ...]] | None:
        """The warm-up for the view's optimizer family (the default differs under Adam)."""
        return warm_adaptive if adaptive(view.optimizer) else warm

    def init(view: ClusterView) -> AutoState:
        warm_policy = warmup_of(view)
        warming = warm_policy is not None
        name, params = warm_policy if warm_policy is not None else first[0]
        inner = policy_of(name, params).init(view)
        base = MappingProxyType({w: f.batch_size for w, f in view.workers.items()})
        return AutoState(name, params, inner, view.now, base_batch=base, warming=warming)

    def delegate(
        event: Event, st: AutoState, view: ClusterView
    ) -> tuple[Sequence[Decision], AutoState]:
        offsets, base = dict(st.offsets), dict(st.base_batch)
        if isinstance(event, Join) and event.worker in view.workers:
            offsets[event.worker] = join_offset(view, offsets, event.worker)
            base[event.worker] = view.workers[event.worker].batch_size
        elif isinstance(event, Leave):
            offsets.pop(event.worker, None)
            base.pop(event.worker, None)
        offsets = {w: o for w, o in offsets.items() if o}
        inner = policy_of(st.name, st.params)
        decisions, inner_state = inner.update(event, st.inner, levelled(view, offsets))
        samples = st.window_samples
        if isinstance(event, Push):
            samples += _applied_samples(event, decisions)
        return decisions, replace(
            st,
            inner=inner_state,
            offsets=MappingProxyType(offsets),
            base_batch=MappingProxyType(base),
            window_samples=samples,
        )

    def start_policy(
        name: str, params: tuple[tuple[str, Any], ...], st: AutoState, view: ClusterView, now: float
    ) -> tuple[list[Decision], Any, dict[int, int]]:
        """The new policy's state and the switch's decisions; raises what it raises. A switch
        that ends the warm-up under an adaptive optimizer restarts the daemon's optimizer
        (the comment at :data:`WARMUP` says why)."""
        top = view.max_clock()
        offsets = {w: top - f.clock for w, f in view.workers.items() if top != f.clock}
        base = {w: st.base_batch.get(w, f.batch_size) for w, f in view.workers.items()}
        fresh = replace(
            view,
            workers={w: replace(f, clock=top, batch_size=base[w]) for w, f in view.workers.items()},
            buffered=0,
            stage="main",
        )
        new = policy_of(name, params)
        first_decisions, state = new.update(Tick(now), new.init(fresh), fresh)
        resolve(first_decisions)  # an unknown plan field or a wrong value refuses the switch
        out: list[Decision] = []
        if view.buffered:
            out.append(Flush(normalize=True))
        if st.warming and adaptive(view.optimizer):
            out.append(RestartOptimizer())
        if view.replicas:
            out.append(Regroup(()))
        out.append(SetStage("main"))
        for w, f in sorted(view.workers.items()):
            out.append(SetPlan(w, default_plan_fields(base[w], f.codec)))
        out.extend(first_decisions)
        return out, state, offsets

    def on_forecast(
        event: Forecast, st: AutoState, view: ClusterView
    ) -> tuple[Sequence[Decision], AutoState]:
        now = event.now
        current = key_of(st.name, st.params)
        errors, checks = st.errors, st.checks
        if st.window_start is not None and st.window_predicted > 0 and now > st.window_start:
            realized = st.window_samples / (now - st.window_start)
            errors = errors.add(canonical(current), realized, st.window_predicted)
            checks += 1
        total = st.forecasts_total + 1
        failed = {
            k: (t, n)
            for k, (t, n) in st.failed.items()
            if now - t < dwell_s or total - n <= max(1, dwell_checks)
        }
        scored = weigh(event.predictions, allowed, errors, frozenset(failed))
        mine = next((s for s in scored if s.key == current), None)
        st = replace(
            st,
            checks=checks,
            forecasts_total=total,
            errors=errors,
            failed=MappingProxyType(failed),
            window_start=now,
            window_samples=0,
            window_predicted=mine.samples_per_s if mine is not None else 0.0,
        )
        best = scored[0] if scored else None
        ran = now - st.since
        # the switch's cost, a share of the time it has to pay itself back in: the dwell (the
        # forecast's horizon without one)
        payback = dwell_s if dwell_s > 0 else event.horizon_s
        cost = min(1.0, switch_cost_s(view) / payback) if payback > 0 else 0.0
        # what the best must beat: the running policy, or during the warm-up the start policy
        # (the warm-up is no choice to keep; the start policy is the default that is)
        base = mine
        if st.warming:
            base = next((s for s in scored if s.key == first_key), None) or best
        target: Scored | None = None
        if best is None:
            why = "no candidate was predicted"
        elif base is None:
            why = "the forecast has no prediction for the running policy"
        elif best.key == base.key:
            target = best
            why = (
                "the running policy is the best"
                if best.key == current
                else (f"{best.label} is the best: the warm-up ends")
            )
        elif st.chosen and (ran < dwell_s or checks < dwell_checks):
            why = (
                f"dwell: ran {ran:.1f} s, its prediction checked {checks} time(s); a switch "
                f"needs {dwell_s:g} s and {dwell_checks}"
            )
        elif (net := _net(best, current, cost)) <= (1.0 + margin) * (
            base_net := _net(base, current, cost)
        ):
            target = base if st.warming else None
            why = (
                f"{best.label} ({best.discounted:.4g}, {_after(net, best, current, cost)}) is not "
                f"{margin:.0%} better than {base.label} ({base.discounted:.4g}"
                f"{_after(base_net, base, current, cost, ', ')})"
            )
        else:
            target = best
            why = (
                f"{best.label} ({best.discounted:.4g}, {_after(net, best, current, cost)}) beats "
                f"{base.label} ({base.discounted:.4g}{_after(base_net, base, current, cost, ', ')}) "
                f"by more than {margin:.0%}"
            )
        running = canonical(current)
        if target is not None and target.key == current:
            target = None  # it runs already (the warm-up ends on it)
        elif target is not None:
            try:
                out, inner, offsets = start_policy(target.name, target.params, st, view, now)
            except Exception as exc:  # the new policy failed to start: stay on the old one
                why = f"{target.label} failed to start: {type(exc).__name__}: {exc}"
                failed[target.label] = (now, total)
                choice = Choice(now, running, scored, None, why)
                return (), replace(st, failed=MappingProxyType(failed), last=choice)
            switch = (now, running, target.label, why)
            return out, replace(
                st,
                name=target.name,
                params=target.params,
                inner=inner,
                since=now,
                checks=0,
                offsets=MappingProxyType(offsets),
                window_predicted=target.samples_per_s,
                last=Choice(now, running, scored, target.label, why),
                switches=(*st.switches, switch)[-HISTORY:],
                warming=False,
                chosen=target is best,
            )
        warming = st.warming and best is None
        return (), replace(st, last=Choice(now, running, scored, None, why), warming=warming)

    def update(
        event: Event, state: AutoState | None, view: ClusterView
    ) -> tuple[Sequence[Decision], AutoState]:
        st = state if state is not None else init(view)
        if isinstance(event, Forecast):
            return on_forecast(event, st, view)
        if st.warming and isinstance(event, Tick) and event.now - st.since >= warmup_s:
            return end_warmup(event.now, st, view)
        return delegate(event, st, view)

    def end_warmup(
        now: float, st: AutoState, view: ClusterView
    ) -> tuple[Sequence[Decision], AutoState]:
        """No forecast in ``warmup_s``: the start policy, as a default (no dwell holds it)."""
        name, params = first[0]
        why = f"no forecast in {warmup_s:g} s of warm-up: the start policy"
        out, inner, offsets = start_policy(name, params, st, view, now)
        switch = (now, canonical(key_of(st.name, st.params)), canonical(first_key), why)
        return out, replace(
            st,
            name=name,
            params=params,
            inner=inner,
            since=now,
            checks=0,
            offsets=MappingProxyType(offsets),
            window_start=None,
            window_samples=0,
            warming=False,
            switches=(*st.switches, switch)[-HISTORY:],
        )

    reads_evals = any(policy_of(n, p).reads_evals for n, p in cands)
    params = {
        "start": start,
        "candidates": ",".join(label(n, p) for n, p in cands),
        "margin": margin,
        "dwell_s": dwell_s,
        "dwell_checks": dwell_checks,
        "warmup": "" if warm is None else label(*warm),
        "warmup_s": warmup_s,
    }
    return Policy("auto", init, update, params, reads_evals=reads_evals, reads_forecasts=True)


__all__ = ["AutoState", "Key", "auto", "default_plan_fields", "join_offset", "levelled"]
