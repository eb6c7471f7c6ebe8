"""DSSP and DynSGD (ALGORITHMS.md §5–6) as tables of events -> decisions, plus scripted runs.

The engine's contract these tables follow (as in ``test_policies.py``): on a Push the pusher's
facts in the view already count it (clock + 1, waiting, ``last_push_at = now`` and the previous
arrival moved to ``prev_push_at``); on a Leave the leaver is already gone from the view.
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from policies import ClusterView, Policy, PolicyError, WorkerFacts, make_policy
from policies.staleness import DsspState, closest_stop, dssp, staleness_weight
from policies.types import (
    Apply,
    Decision,
    Eval,
    Event,
    Join,
    Leave,
    Pull,
    Push,
    Release,
    Scale,
    Tick,
)

T, F = True, False


def fact(
    w: int, clock: int, waiting: bool = False, last: float | None = None, prev: float | None = None
) -> WorkerFacts:
    """One worker's facts; ``last``/``prev`` are its last two push arrival times."""
    return WorkerFacts(
        worker=w,
        name=f"w{w}",
        clock=clock,
        version=0,
        waiting=waiting,
        joined_at=0.0,
        last_push_at=last,
        prev_push_at=prev,
    )


def view_of(*facts: WorkerFacts, version: int = 0, now: float = 0.0) -> ClusterView:
    return ClusterView(
        now=now, version=version, workers={f.worker: f for f in facts}, global_batch=96
    )


def push(worker: int, now: float = 1.0, base: int = 0) -> Push:
    return Push(
        now=now, worker=worker, base_version=base, kind="grad", samples=32, steps=1, compute_s=0.1
    )


def grants(**by_worker: int) -> DsspState:
    return DsspState({int(k[1:]): v for k, v in by_worker.items()})


# --- closest_stop: DSSP's synchronisation controller -------------------------------------------

# (label, fast_last, fast_interval, slow_last, slow_interval, r_max, r*) — r* by hand from
# F_k = fast_last + k·I_f (k = 0..r_max), S_j = slow_last + j·I_s (j = 1..r_max).
CLOSEST_STOP_TABLE: list[tuple[str, float, float, float, float, int, int]] = [
    ("F_3 = 26 = S_1", 20.0, 2.0, 16.0, 10.0, 6, 3),
    ("the fastest already coincides with S_1: no extra iteration", 26.0, 2.0, 16.0, 10.0, 6, 0),
    ("tie: F_1 = 12, F_2 = 14 both 1 from S_1 = 13", 10.0, 2.0, 8.0, 5.0, 2, 1),
    ("the closest slow push is a later one: F_5 = 15 = S_3", 0.0, 3.0, 0.0, 5.0, 6, 5),
    ("the slowest is far off: capped at r_max", 0.0, 1.0, 0.0, 100.0, 12, 12),
    ("every slow push predicted before the fastest: stop now", 30.0, 1.0, 0.0, 10.0, 2, 0),
    ("F_0 = 10 = S_1 already", 10.0, 5.0, 0.0, 10.0, 4, 0),
    ("zero fast interval (unknown speed)", 20.0, 0.0, 16.0, 10.0, 6, 0),
    ("zero slow interval", 20.0, 2.0, 16.0, 0.0, 6, 0),
    ("negative interval (clock skew)", 20.0, -2.0, 16.0, 10.0, 6, 0),
    ("r_max = 0 gives plain SSP", 20.0, 2.0, 16.0, 10.0, 0, 0),
]


@pytest.mark.parametrize(
    ("fast_last", "fast_i", "slow_last", "slow_i", "r_max", "expected"),
    [row[1:] for row in CLOSEST_STOP_TABLE],
    ids=[row[0] for row in CLOSEST_STOP_TABLE],
)
def test_closest_stop_table(
    fast_last: float, fast_i: float, slow_last: float, slow_i: float, r_max: int, expected: int
) -> None:
    assert closest_stop(fast_last, fast_i, slow_last, slow_i, r_max) == expected


def brute_closest_stop(fl: float, fi: float, sl: float, si: float, r_max: int) -> int:
    best = min(
        range(r_max + 1),
        key=lambda k: (min(abs(fl + k * fi - (sl + j * si)) for j in range(1, r_max + 1)), k),
    )
    return best


@settings(max_examples=300, deadline=None, database=None)
@given(
    st.integers(0, 200),
    st.integers(1, 30),
    st.integers(0, 200),
    st.integers(1, 30),
    st.integers(1, 15),
)
def test_closest_stop_matches_the_brute_force_argmin(
    fl: int, fi: int, sl: int, si: int, r_max: int
) -> None:
    # Integer times keep ties exact, so "ties -> smaller k" is checked too.
    got = closest_stop(float(fl), float(fi), float(sl), float(si), r_max)
    assert got == brute_closest_stop(fl, fi, sl, si, r_max)


# --- dssp as a table -------------------------------------------------------------------------------

# dssp(s_lo=2, r_max=6, weight=1.0). Fast w0 pushes every 2 s, slow w1 every 10 s (last at 16), so
# F_k = 20 + 2k meets S_1 = 26 at k = 3.
FAST = {"last": 20.0, "prev": 18.0}
SLOW = {"last": 16.0, "prev": 6.0}

# (label, state before, facts, event, expected decisions, grants after)
DSSP_TABLE: list[
    tuple[str, DsspState, tuple[WorkerFacts, ...], Event, list[Decision], dict[int, int]]
] = [
    (
        "within s_lo: applied and released",
        grants(),
        (fact(0, 2, T, **FAST), fact(1, 0, F, **SLOW)),
        push(0, now=20.0),
        [Apply(1.0), Release(0)],
        {},
    ),
    (
        "fastest past s_lo without intervals: SSP(s_lo) fallback holds it",
        grants(),
        (fact(0, 3, T, last=20.0), fact(1, 0, F, **SLOW)),
        push(0, now=20.0),
        [Apply(1.0)],
        {},
    ),
    (
        "fastest past s_lo, slowest's interval unknown: held",
        grants(),
        (fact(0, 3, T, **FAST), fact(1, 0, F, last=16.0)),
        push(0, now=20.0),
        [Apply(1.0)],
        {},
    ),
    (
        "fastest past s_lo with intervals: r* = 3 granted, this release uses one",
        grants(),
        (fact(0, 3, T, **FAST), fact(1, 0, F, **SLOW)),
        push(0, now=20.0),
        [Apply(1.0), Release(0)],
        {0: 2},
    ),
    (
        "a grant is consumed one push at a time",
        grants(w0=2),
        (fact(0, 4, T, last=22.0, prev=20.0), fact(1, 0, F, **SLOW)),
        push(0, now=22.0),
        [Apply(1.0), Release(0)],
        {0: 1},
    ),
    (
        "the last granted iteration",
        grants(w0=1),
        (fact(0, 5, T, last=24.0, prev=22.0), fact(1, 0, F, **SLOW)),
        push(0, now=24.0),
        [Apply(1.0), Release(0)],
        {0: 0},
    ),
    (
        "grant used up and the fastest now coincides with S_1: r* = 0, held",
        grants(w0=0),
        (fact(0, 6, T, last=26.0, prev=24.0), fact(1, 0, F, **SLOW)),
        push(0, now=26.0),
        [Apply(1.0)],
        {0: 0},
    ),
    (
        "a non-fastest worker past s_lo is held even with known intervals",
        grants(),
        (fact(0, 5, F, **FAST), fact(1, 4, T, **FAST), fact(2, 0, F, **SLOW)),
        push(1, now=20.0),
        [Apply(1.0)],
        {},
    ),
    (
        "the slowest pushes: workers back within s_lo are released with it",
        grants(),
        (fact(0, 3, T, **FAST), fact(1, 1, T, last=26.0, prev=16.0), fact(2, 4, T, **FAST)),
        push(1, now=26.0),
        [Apply(1.0), Release(0), Release(1)],
        {},
    ),
    (
        "a leave clears the leaver's grant and re-checks the gate",
        grants(w0=3, w1=2),
        (fact(1, 4, F, **FAST), fact(2, 2, T, **SLOW)),
        Leave(now=30.0, worker=0),
        [Release(2)],
        {1: 2},
    ),
    (
        "the slowest leaves: the held fastest is back within s_lo",
        grants(),
        (fact(0, 5, T, **FAST), fact(2, 3, F, **FAST)),
        Leave(now=30.0, worker=1),
        [Release(0)],
        {},
    ),
    (
        "a tick re-checks the gate",
        grants(),
        (fact(0, 2, T), fact(1, 0, F), fact(2, 3, T)),
        Tick(now=5.0),
        [Release(0)],
        {},
    ),
    (
        "a join at the min clock is released",
        grants(),
        (fact(0, 3, F), fact(1, 1, F), fact(2, 1, T)),
        Join(now=5.0, worker=2),
        [Release(2)],
        {},
    ),
    (
        "a pull beyond s_lo waits",
        grants(),
        (fact(0, 4, T), fact(1, 1, F)),
        Pull(now=5.0, worker=0),
        [],
        {},
    ),
    (
        "an eval changes nothing",
        grants(w0=1),
        (fact(0, 4, F), fact(1, 1, F)),
        Eval(now=5.0, loss=0.1, accuracy=0.9),
        [],
        {0: 1},
    ),
]


@pytest.mark.parametrize(
    ("state", "facts", "event", "expected", "after"),
    [row[1:] for row in DSSP_TABLE],
    ids=[row[0] for row in DSSP_TABLE],
)
def test_dssp_table(
    state: DsspState,
    facts: tuple[WorkerFacts, ...],
    event: Event,
    expected: list[Decision],
    after: dict[int, int],
) -> None:
    policy = make_policy("dssp", {"s_lo": 2, "r_max": 6, "weight": 1.0})
    decisions, new_state = policy.update(event, state, view_of(*facts, now=event.now))
    assert list(decisions) == expected
    assert {w: r for w, r in new_state.granted.items()} == after


# BUG (policies/staleness.py, dssp ``update``, the ``elif p.clock - lo > s_lo ...`` branch): once a
# grant is used up, the fastest worker is still the fastest and past s_lo, so the controller runs
# again and grants again — the lead grows without bound (155 in the 400 s run below) and DSSP turns
# into ASP. §5: "SSP with a per-iteration bound chosen in [s_L, s_L + r_max]". These two tests and
# the run below fail until r* is capped at ``s_lo + r_max + 1 - (p.clock - lo)``.
def test_dssp_bug_no_regrant_beyond_s_lo_plus_r_max() -> None:
    # s_lo = 2, r_max = 6: w0 is at lead 9 = s_lo + r_max + 1 with its grant used up; the
    # controller alone would give r* = 1 (F_1 = 26 = S_1), which would release it at lead 9.
    policy = make_policy("dssp", {"s_lo": 2, "r_max": 6, "weight": 1.0})
    view = view_of(fact(0, 9, T, last=24.0, prev=22.0), fact(1, 0, F, **SLOW), now=24.0)
    decisions, state = policy.update(push(0, now=24.0), grants(w0=0), view)
    assert list(decisions) == [Apply(1.0)]
    assert state.granted.get(0, 0) == 0


@settings(max_examples=300, deadline=None, database=None)
@given(
    st.lists(st.integers(0, 30), min_size=2, max_size=4),
    st.lists(st.tuples(st.integers(1, 50), st.integers(1, 20)), min_size=4, max_size=4),
    st.integers(0, 3),
    st.integers(0, 8),
)
def test_dssp_bug_releases_stay_within_s_lo_plus_r_max(
    clocks: list[int], times: list[tuple[int, int]], s_lo: int, r_max: int
) -> None:
    # From a state without grants, a push is released only within s_lo, or — the fastest only —
    # with a grant whose last iteration still keeps it within s_lo + r_max.
    facts = [
        fact(w, c, w == 0, last=float(t + 100), prev=float(t + 100 - i))
        for w, (c, (t, i)) in enumerate(zip(clocks, times, strict=False))
    ]
    view = view_of(*facts, now=facts[0].last_push_at or 0.0)
    policy = dssp(s_lo=s_lo, r_max=r_max, weight=1.0)
    decisions, state = policy.update(push(0, now=view.now), policy.init(view), view)
    lead = clocks[0] - view.min_clock()
    if Release(0) in decisions and lead > s_lo:
        assert clocks[0] == view.max_clock(), "released a non-fastest worker past s_lo"
        assert lead + state.granted.get(0, 0) <= s_lo + r_max


def test_dssp_grant_is_capped_by_r_max() -> None:
    # The slowest pushes every 100 s: the fastest would like to run on, but gets r_max = 4.
    policy = dssp(s_lo=1, r_max=4, weight=1.0)
    view = view_of(fact(0, 2, T, last=20.0, prev=19.0), fact(1, 0, F, last=16.0, prev=-84.0))
    decisions, state = policy.update(push(0, now=20.0), policy.init(view), view)
    assert list(decisions) == [Apply(1.0), Release(0)]
    assert dict(state.granted) == {0: 3}


def test_dssp_default_weight_is_one_over_n() -> None:
    view = view_of(fact(0, 1, T), fact(1, 0, F), fact(2, 0, F), fact(3, 0, F))
    policy = make_policy("dssp")
    decisions, _ = policy.update(push(0), policy.init(view), view)
    assert list(decisions) == [Apply(0.25), Release(0)]


@pytest.mark.parametrize(
    ("params", "word"),
    [
        ({"s_lo": -1}, "s_lo"),
        ({"s_lo": 1.5}, "s_lo"),
        ({"r_max": True}, "r_max"),
        ({"r_max": -3}, "r_max"),
        ({"weight": 0}, "weight"),
        ({"bound": 3}, "bound"),
    ],
)
def test_dssp_bad_params_raise_policy_error(params: dict[str, Any], word: str) -> None:
    with pytest.raises(PolicyError, match=word):
        make_policy("dssp", params)


# --- a scripted run: a fake engine with virtual time ----------------------------------------------


@dataclass
class Run:
    """What a scripted run saw."""

    pushes: dict[int, int] = field(default_factory=dict)
    max_lead_at_release: int = 0  # max (clock_i - min clock) when i was released
    versions: int = 0
    scales: list[float] = field(default_factory=list)  # Scale factors, one per push
    applied_weights: list[float] = field(default_factory=list)  # Apply weight x Scale factors


def drive(policy: Policy, step_time: Mapping[int, float], horizon: float) -> Run:
    """Workers compute for ``step_time[w]`` seconds after each release; pushes arrive in time order
    until ``horizon``. The engine keeps clocks, push times, versions and waiting flags and executes
    Apply (version + 1) and Release (the worker starts from the current version)."""
    facts = {w: fact(w, 0, T) for w in step_time}
    base = dict.fromkeys(step_time, 0)
    run = Run(pushes=dict.fromkeys(step_time, 0))
    queue: list[tuple[float, int, int]] = []  # (arrival, seq, worker)
    seq = 0

    def view(now: float) -> ClusterView:
        return view_of(*facts.values(), version=run.versions, now=now)

    def handle(event: Event, state: Any) -> Any:
        nonlocal seq
        v = view(event.now)
        decisions, state = policy.update(event, state, v)
        factor = 1.0
        for d in decisions:
            if isinstance(d, Scale):
                factor *= d.factor
                run.scales.append(d.factor)
        for d in decisions:
            if isinstance(d, Apply):
                run.applied_weights.append(d.weight * factor)
                run.versions += 1
            elif isinstance(d, Release) and facts[d.worker].waiting:
                lead = facts[d.worker].clock - v.min_clock()
                run.max_lead_at_release = max(run.max_lead_at_release, lead)
                facts[d.worker] = replace(facts[d.worker], waiting=False)
                base[d.worker] = run.versions
                heapq.heappush(queue, (event.now + step_time[d.worker], seq, d.worker))
                seq += 1
        return state

    state = policy.init(view(0.0))
    for w in step_time:
        state = handle(Join(now=0.0, worker=w), state)
    while queue and queue[0][0] <= horizon:
        now, _, w = heapq.heappop(queue)
        f = facts[w]
        facts[w] = replace(
            f, clock=f.clock + 1, waiting=True, prev_push_at=f.last_push_at, last_push_at=now
        )
        run.pushes[w] += 1
        state = handle(push(w, now=now, base=base[w]), state)
    assert queue or all(f.waiting for f in facts.values()), "lost a worker"
    return run


SPEEDS = {0: 10.0, 1: 5.0, 2: 2.0}  # seconds per step: speeds 1, 2, 5


# BUG (see test_dssp_bug_no_regrant_beyond_s_lo_plus_r_max): [3-12] and [1-4] fail on the lead bound.
@pytest.mark.parametrize(("s_lo", "r_max"), [(3, 12), (1, 4), (2, 0)])
def test_dssp_run_bounds_the_lead_and_lets_the_fastest_run_further_than_ssp(
    s_lo: int, r_max: int
) -> None:
    horizon = 400.0
    dyn = drive(dssp(s_lo=s_lo, r_max=r_max, weight=1.0), SPEEDS, horizon)
    ssp = drive(make_policy("ssp", {"staleness": s_lo, "weight": 1.0}), SPEEDS, horizon)
    assert dyn.max_lead_at_release <= s_lo + r_max
    assert ssp.max_lead_at_release == s_lo
    assert dyn.versions == sum(dyn.pushes.values())  # every push applied
    assert dyn.pushes[0] == ssp.pushes[0] == 40  # the slowest is never held
    if r_max:
        assert dyn.max_lead_at_release > s_lo  # extra iterations were granted
        assert dyn.pushes[2] > ssp.pushes[2]
    else:
        assert dyn.pushes == ssp.pushes  # r_max = 0 is SSP(s_lo)


def test_dssp_run_without_push_times_is_ssp() -> None:
    # The slowest pushes once (at 100 s) before the horizon, so its interval stays unknown and
    # DSSP must behave as SSP(s_lo): the fast worker is held at lead s_lo + 1 each time.
    run = drive(dssp(s_lo=2, r_max=12, weight=1.0), {0: 100.0, 1: 1.0}, horizon=150.0)
    assert run.pushes == {0: 1, 1: 4}  # pushes at 1, 2, 3 (held), then 101 (held)
    assert run.max_lead_at_release == 2


# --- staleness weights (DynSGD) --------------------------------------------------------------------

# (label, view version, push base version, expected factor 1/(d+1))
INVERSE_TABLE: list[tuple[str, int, int, float]] = [
    ("fresh push: d = 0", 5, 5, 1.0),
    ("two updates since it began", 5, 3, 1 / 3),
    ("five updates since it began", 5, 0, 1 / 6),
    ("base from the future counts as fresh", 5, 7, 1.0),
]


@pytest.mark.parametrize(
    ("version", "base", "factor"),
    [row[1:] for row in INVERSE_TABLE],
    ids=[row[0] for row in INVERSE_TABLE],
)
def test_staleness_weight_inverse_table(version: int, base: int, factor: float) -> None:
    policy = make_policy("staleness_weight")
    view = view_of(fact(0, 1, T), fact(1, 0, F), version=version)
    decisions, _ = policy.update(push(0, base=base), policy.init(view), view)
    assert list(decisions) == [Scale(factor)]


@pytest.mark.parametrize(
    "event",
    [Tick(now=1.0), Join(now=1.0, worker=0), Leave(now=1.0, worker=3), Pull(now=1.0, worker=0)],
)
@pytest.mark.parametrize("mode", ["inverse", "version_avg"])
def test_staleness_weight_ignores_events_other_than_pushes(event: Event, mode: str) -> None:
    policy = staleness_weight(mode)
    view = view_of(fact(0, 1, T), version=4)
    state = policy.init(view)
    decisions, after = policy.update(event, state, view)
    assert list(decisions) == []
    assert after == state


def test_staleness_weight_version_avg_counts_pushes_per_base_version() -> None:
    # (view version, base) -> 1/(n_v + 1), n_v = pushes already seen from the same base.
    script = [(0, 0, 1.0), (1, 0, 1 / 2), (2, 0, 1 / 3), (3, 1, 1.0), (4, 0, 1 / 4), (4, 1, 1 / 2)]
    policy = make_policy("staleness_weight", {"mode": "version_avg"})
    view = view_of(fact(0, 1, T))
    state = policy.init(view)
    for version, base, factor in script:
        decisions, state = policy.update(
            push(0, base=base), state, view_of(fact(0, 1, T), version=version)
        )
        assert list(decisions) == [Scale(factor)], (version, base)


def test_staleness_weight_version_avg_state_stays_bounded() -> None:
    policy = staleness_weight("version_avg")
    state = policy.init(view_of())
    for version in range(1000):
        _, state = policy.update(
            push(0, base=version), state, view_of(fact(0, 1, T), version=version)
        )
    assert len(state.counts) <= 65


# (label, dynsgd params, facts, version, event, expected decisions)
DYNSGD_TABLE: list[
    tuple[str, dict[str, Any], tuple[WorkerFacts, ...], int, Event, list[Decision]]
] = [
    (
        "asp gate: apply with weight 1, the Scale carries 1/(d+1)",
        {"gate": "asp"},
        (fact(0, 9, T), fact(1, 0, F)),
        4,
        push(0, base=2),
        [Apply(1.0), Release(0), Scale(1 / 3)],
    ),
    (
        "ssp gate: a worker beyond the bound is held, still weighted",
        {"gate": "ssp", "staleness": 1},
        (fact(0, 3, T), fact(1, 0, F)),
        4,
        push(0, base=4),
        [Apply(1.0), Scale(1.0)],
    ),
    (
        "dssp gate with its own parameters",
        {"gate": "dssp", "s_lo": 2, "r_max": 6},
        (fact(0, 3, T, **FAST), fact(1, 0, F, **SLOW)),
        7,
        push(0, now=20.0, base=3),
        [Apply(1.0), Release(0), Scale(1 / 5)],
    ),
    (
        "version_avg mode: the second push from base 4",
        {"gate": "asp", "mode": "version_avg"},
        (fact(0, 2, T), fact(1, 1, F)),
        5,
        push(0, base=4),
        [Apply(1.0), Release(0), Scale(1.0)],
    ),
    (
        "a tick only re-checks the gate",
        {"gate": "ssp", "staleness": 1},
        (fact(0, 1, T), fact(1, 0, F)),
        4,
        Tick(now=1.0),
        [Release(0)],
    ),
]


@pytest.mark.parametrize(
    ("params", "facts", "version", "event", "expected"),
    [row[1:] for row in DYNSGD_TABLE],
    ids=[row[0] for row in DYNSGD_TABLE],
)
def test_dynsgd_table(
    params: dict[str, Any],
    facts: tuple[WorkerFacts, ...],
    version: int,
    event: Event,
    expected: list[Decision],
) -> None:
    policy = make_policy("dynsgd", params)
    view = view_of(*facts, version=version, now=event.now)
    decisions, _ = policy.update(event, policy.init(view), view)
    assert list(decisions) == expected


def test_dynsgd_in_steady_asp_weights_about_one_over_n() -> None:
    # Four equal workers: after the first round each push saw the other three land since it began
    # (d = N - 1 = 3), so DynSGD's weight is 1/N by itself.
    step = {0: 4.0, 1: 4.0, 2: 4.0, 3: 4.0}
    run = drive(make_policy("dynsgd", {"gate": "asp"}), step, horizon=200.0)
    assert run.versions == sum(run.pushes.values()) == 200
    steady = run.applied_weights[4:]
    assert steady and all(w == pytest.approx(1 / 4) for w in steady)
    assert run.scales == run.applied_weights  # the gate's own weight is 1


def test_dynsgd_describe_shows_its_own_params() -> None:
    p = make_policy("dynsgd", {"gate": "ssp", "staleness": 2})
    assert p.describe() == {
        "name": "dynsgd",
        "params": {"gate": "ssp", "mode": "inverse", "staleness": 2},
    }


@pytest.mark.parametrize(
    ("params", "word"),
    [
        ({"gate": "bsp"}, "gate"),
        ({"weight": 0.5}, "weight"),
        ({"mode": "nope"}, "mode"),
        ({"gate": "ssp", "staleness": -1}, "staleness"),
        ({"gate": "asp", "staleness": 2}, "staleness"),
        ({"gate": "dssp", "s_lo": -1}, "s_lo"),
    ],
)
def test_dynsgd_bad_params_raise_policy_error(params: dict[str, Any], word: str) -> None:
    with pytest.raises(PolicyError, match=word):
        make_policy("dynsgd", params)


def test_staleness_weight_bad_mode_raises_policy_error() -> None:
    with pytest.raises(PolicyError, match="mode"):
        make_policy("staleness_weight", {"mode": "linear"})
