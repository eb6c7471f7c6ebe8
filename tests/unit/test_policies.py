"""Sync policies as tables of events -> decisions, a scripted SSP run, the registry and compose.

The engine's contract these tables follow: on a Push the pusher's clock in the view already
counts the push and it is marked waiting; ``view.buffered`` counts pushes buffered before it; on a
Leave the leaver is already gone from the view.
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping, Sequence
from importlib.metadata import EntryPoint
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from policies import (
    ClusterView,
    Policy,
    PolicyError,
    WorkerFacts,
    compose,
    make_policy,
    policy_names,
    registry,
)
from policies.registry import register
from policies.types import (
    Apply,
    Buffer,
    Decision,
    Eval,
    Event,
    Flush,
    Join,
    Leave,
    Pull,
    Push,
    Release,
    Tick,
)


def view_of(
    workers: Mapping[int, tuple[int, bool]], buffered: int = 0, version: int = 0, now: float = 0.0
) -> ClusterView:
    """A view from ``worker -> (clock, waiting)``."""
    facts = {
        w: WorkerFacts(worker=w, name=f"w{w}", clock=c, version=0, waiting=waiting, joined_at=0.0)
        for w, (c, waiting) in workers.items()
    }
    return ClusterView(now=now, version=version, workers=facts, global_batch=96, buffered=buffered)


def push(worker: int, samples: int = 32, base: int = 0) -> Push:
    return Push(
        now=1.0,
        worker=worker,
        base_version=base,
        kind="grad",
        samples=samples,
        steps=1,
        compute_s=0.1,
    )


def run_one(policy: Policy, event: Event, view: ClusterView) -> list[Decision]:
    decisions, _ = policy.update(event, policy.init(view), view)
    return list(decisions)


T, F = True, False

# (label, workers: w -> (clock, waiting), buffered before the event, event, expected decisions)
BSP_TABLE: list[tuple[str, dict[int, tuple[int, bool]], int, Event, list[Decision]]] = [
    (
        "first push of a round is buffered by samples, pusher held",
        {0: (1, T), 1: (0, F), 2: (0, F)},
        0,
        push(0, samples=32),
        [Buffer(32.0)],
    ),
    (
        "second push buffered, both pushers held",
        {0: (1, T), 1: (1, T), 2: (0, F)},
        1,
        push(1, samples=16),
        [Buffer(16.0)],
    ),
    (
        "last push completes the round: flush then release everyone",
        {0: (1, T), 1: (1, T), 2: (1, T)},
        2,
        push(2, samples=8),
        [Buffer(8.0), Flush(normalize=True), Release(0), Release(1), Release(2)],
    ),
    (
        "single worker: every push is a round",
        {0: (4, T)},
        0,
        push(0, samples=10),
        [Buffer(10.0), Flush(), Release(0)],
    ),
    (
        "the straggler leaves mid-round: the Leave completes the round",
        {0: (1, T), 1: (1, T)},
        2,
        Leave(now=2.0, worker=2, reason="timeout"),
        [Flush(), Release(0), Release(1)],
    ),
    (
        "a pusher leaves mid-round: the others still owe their push",
        {0: (1, T), 1: (0, F)},
        2,
        Leave(now=2.0, worker=2),
        [],
    ),
    (
        "a leave with nothing buffered flushes nothing",
        {0: (3, F), 1: (3, F)},
        0,
        Leave(now=2.0, worker=2),
        [],
    ),
    (
        "a join at the min clock is released; the worker ahead still waits",
        {0: (2, T), 1: (1, F), 2: (1, T)},
        1,
        Join(now=3.0, worker=2),
        [Release(2)],
    ),
    (
        "a pull at the min clock is released; the worker ahead still waits",
        {0: (1, T), 1: (0, T)},
        1,
        Pull(now=3.0, worker=1),
        [Release(1)],
    ),
    (
        "a tick after a hot swap flushes a complete round",
        {0: (2, T), 1: (2, T)},
        2,
        Tick(now=4.0),
        [Flush(), Release(0), Release(1)],
    ),
    (
        "an eval changes nothing",
        {0: (1, T), 1: (1, T)},
        2,
        Eval(now=4.0, loss=0.3, accuracy=0.9),
        [],
    ),
]


@pytest.mark.parametrize(
    ("workers", "buffered", "event", "expected"),
    [row[1:] for row in BSP_TABLE],
    ids=[row[0] for row in BSP_TABLE],
)
def test_bsp_table(
    workers: dict[int, tuple[int, bool]], buffered: int, event: Event, expected: list[Decision]
) -> None:
    assert run_one(make_policy("bsp"), event, view_of(workers, buffered)) == expected


_event = st.one_of(
    st.builds(lambda w, n: push(w, samples=n), st.integers(0, 4), st.integers(0, 64)),
    st.builds(lambda w: Leave(now=1.0, worker=w), st.integers(5, 9)),
    st.builds(lambda w: Join(now=1.0, worker=w), st.integers(0, 4)),
    st.builds(lambda w: Pull(now=1.0, worker=w), st.integers(0, 4)),
    st.just(Tick(now=1.0)),
)


@settings(max_examples=300, deadline=None, database=None)
@given(
    st.dictionaries(
        st.integers(0, 4), st.tuples(st.integers(0, 6), st.booleans()), min_size=1, max_size=5
    ),
    st.integers(0, 5),
    _event,
)
def test_bsp_never_releases_a_worker_ahead_of_the_min_clock(
    workers: dict[int, tuple[int, bool]], buffered: int, event: Event
) -> None:
    view = view_of(workers, buffered)
    decisions = run_one(make_policy("bsp"), event, view)
    for d in decisions:
        if isinstance(d, Release):
            assert workers[d.worker][1], "released a worker that was not waiting"
            assert workers[d.worker][0] == view.min_clock()
    if any(isinstance(d, Flush) for d in decisions):
        assert view.min_clock() == view.max_clock()


ASP_TABLE: list[tuple[str, dict[str, Any], dict[int, tuple[int, bool]], Event, list[Decision]]] = [
    (
        "push applied with 1/N and released at once",
        {},
        {0: (5, T), 1: (0, F), 2: (1, F), 3: (0, F)},
        push(0),
        [Apply(0.25), Release(0)],
    ),
    (
        "configured weight replaces 1/N",
        {"weight": 1.0},
        {0: (5, T), 1: (0, F)},
        push(0),
        [Apply(1.0), Release(0)],
    ),
    (
        "every waiting worker is released, however far ahead",
        {},
        {0: (50, T), 1: (0, T)},
        push(1),
        [Apply(0.5), Release(0), Release(1)],
    ),
    ("a join is released", {}, {0: (3, F), 1: (0, T)}, Join(now=1.0, worker=1), [Release(1)]),
]


@pytest.mark.parametrize(
    ("params", "workers", "event", "expected"),
    [row[1:] for row in ASP_TABLE],
    ids=[row[0] for row in ASP_TABLE],
)
def test_asp_table(
    params: dict[str, Any],
    workers: dict[int, tuple[int, bool]],
    event: Event,
    expected: list[Decision],
) -> None:
    assert run_one(make_policy("asp", params), event, view_of(workers)) == expected


SSP1_TABLE: list[tuple[str, dict[int, tuple[int, bool]], Event, list[Decision]]] = [
    ("within the bound: released", {0: (1, T), 1: (0, F)}, push(0), [Apply(0.5), Release(0)]),
    ("beyond the bound: held", {0: (2, T), 1: (0, F)}, push(0), [Apply(0.5)]),
    (
        "the slowest pushes: the held worker is released with it",
        {0: (2, T), 1: (1, T)},
        push(1),
        [Apply(0.5), Release(0), Release(1)],
    ),
    (
        "the slowest leaves: the held worker is released",
        {0: (2, T), 1: (2, F)},
        Leave(now=1.0, worker=2),
        [Release(0)],
    ),
    ("a tick re-checks the gate", {0: (3, T), 1: (1, F)}, Tick(now=1.0), []),
]


@pytest.mark.parametrize(
    ("workers", "event", "expected"),
    [row[1:] for row in SSP1_TABLE],
    ids=[row[0] for row in SSP1_TABLE],
)
def test_ssp_staleness_1_table(
    workers: dict[int, tuple[int, bool]], event: Event, expected: list[Decision]
) -> None:
    assert run_one(make_policy("ssp", {"staleness": 1}), event, view_of(workers)) == expected


# --- a scripted run: a tiny fake engine over policy.update ---------------------------------------


class RunLog:
    """What a scripted run saw."""

    def __init__(self) -> None:
        self.pushes: dict[int, int] = {}
        self.max_lead_at_release = 0  # max (clock_i - min clock) when i was released
        self.versions = 0
        self.flush_clocks: list[set[int]] = []  # the set of clocks at each flush


def simulate(policy: Policy, step_time: Mapping[int, int], total_pushes: int = 200) -> RunLog:
    """Workers push after ``step_time[w]`` ticks of compute, in time order; the engine keeps
    clocks and waiting flags, counts buffered pushes, and applies Release decisions."""
    clocks = dict.fromkeys(step_time, 0)
    waiting = dict.fromkeys(step_time, True)
    buffered = 0
    log = RunLog()
    log.pushes = dict.fromkeys(step_time, 0)
    queue: list[tuple[int, int, int]] = []  # (time, seq, worker): next push arrivals
    seq = 0

    def view(now: int) -> ClusterView:
        return view_of({w: (clocks[w], waiting[w]) for w in clocks}, buffered, log.versions, now)

    def handle(event: Event, now: int, state: Any) -> Any:
        nonlocal buffered, seq
        v = view(now)
        decisions, state = policy.update(event, state, v)
        for d in decisions:
            if isinstance(d, Apply):
                log.versions += 1
            elif isinstance(d, Buffer):
                buffered += 1
            elif isinstance(d, Flush):
                log.versions += 1
                buffered = 0
                log.flush_clocks.append(set(clocks.values()))
            elif isinstance(d, Release) and waiting[d.worker]:
                log.max_lead_at_release = max(
                    log.max_lead_at_release, clocks[d.worker] - v.min_clock()
                )
                waiting[d.worker] = False
                heapq.heappush(queue, (now + step_time[d.worker], seq, d.worker))
                seq += 1
        return state

    state = policy.init(view(0))
    for w in step_time:
        state = handle(Join(now=0.0, worker=w), 0, state)
    for _ in range(total_pushes):
        assert queue, "deadlock: every worker is waiting and nothing was released"
        now, _, w = heapq.heappop(queue)
        clocks[w] += 1
        waiting[w] = True
        log.pushes[w] += 1
        state = handle(push(w), now, state)
    return log


SPEEDS = {0: 10, 1: 5, 2: 2}  # ticks per step: speeds 1, 2, 5


@pytest.mark.parametrize("s", [0, 1, 3])
def test_ssp_run_keeps_every_worker_within_s_of_the_slowest(s: int) -> None:
    log = simulate(make_policy("ssp", {"staleness": s}), SPEEDS)
    assert log.max_lead_at_release == s  # the bound holds, and the fast worker does reach it
    assert log.versions == 200  # every push applied
    assert log.pushes[2] - log.pushes[0] <= s + 1


def test_asp_run_lets_the_fast_worker_run_ahead() -> None:
    log = simulate(make_policy("asp"), SPEEDS)
    assert log.pushes[2] >= 2 * log.pushes[0]
    assert log.max_lead_at_release > 3  # what SSP(3) forbids


def test_bsp_run_flushes_once_per_round_at_equal_clocks() -> None:
    log = simulate(make_policy("bsp"), SPEEDS, total_pushes=60)
    assert log.versions == 20
    assert all(len(clocks) == 1 for clocks in log.flush_clocks)
    assert log.pushes == {0: 20, 1: 20, 2: 20}
    assert log.max_lead_at_release == 0


# --- registry and compose ------------------------------------------------------------------------


def test_make_policy_unknown_name_lists_known_names() -> None:
    with pytest.raises(PolicyError, match="nope") as info:
        make_policy("nope")
    for name in ("asp", "bsp", "ssp"):
        assert name in str(info.value)


@pytest.mark.parametrize(
    ("name", "params", "word"),
    [
        ("ssp", {"staleness": -1}, "staleness"),
        ("ssp", {"staleness": 1.5}, "staleness"),
        ("ssp", {"staleness": True}, "staleness"),
        ("ssp", {"bogus": 1}, "bogus"),
        ("bsp", {"staleness": 1}, "staleness"),
        ("asp", {"weight": 0}, "weight"),
        ("asp", {"weight": float("nan")}, "weight"),
        ("ssp", {"weight": -0.5}, "weight"),
    ],
)
def test_make_policy_bad_params_raise_policy_error(
    name: str, params: dict[str, Any], word: str
) -> None:
    with pytest.raises(PolicyError, match=word):
        make_policy(name, params)


def test_make_policy_records_params() -> None:
    p = make_policy("ssp", {"staleness": 2})
    assert p.describe() == {
        "name": "ssp",
        "params": {"staleness": 2, "weight": None, "patience": 10.0},
    }


def test_register_duplicate_name_raises() -> None:
    with pytest.raises(PolicyError, match="bsp") as info:
        register("bsp")(toy_policy)
    assert "policies.sync.bsp" in str(info.value)  # who holds the name
    assert "toy_policy" in str(info.value)  # and who wanted it
    assert make_policy("bsp").name == "bsp"  # the original is still there


def toy_policy() -> Policy:
    """A policy for the entry-point tests: releases everyone."""
    return Policy("toy", lambda view: None, lambda e, s, v: ([], s), {})


def _entry_point(name: str, value: str = "tests.unit.test_policies:toy_policy") -> EntryPoint:
    return EntryPoint(name=name, value=value, group=registry.GROUP)


@pytest.fixture
def fresh_registry(monkeypatch: pytest.MonkeyPatch) -> list[EntryPoint]:
    """A copy of the registry with entry points not yet loaded; the list is what they are."""
    eps: list[EntryPoint] = []
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))
    monkeypatch.setattr(registry, "_ENTRY_POINTS_LOADED", False)
    monkeypatch.setattr(registry, "entry_points", lambda group: list(eps))
    return eps


def test_entry_points_add_policies(fresh_registry: list[EntryPoint]) -> None:
    fresh_registry.append(_entry_point("toy"))
    fresh_registry.append(_entry_point("toy"))  # the same one twice (two installs): no clash
    assert "toy" in policy_names()
    assert make_policy("toy").name == "toy"


@pytest.mark.parametrize(
    ("names_values", "words"),
    [
        ([("bsp", None)], ["'bsp'", "policies.sync.bsp", "toy_policy"]),
        ([("toy", None), ("toy", "tests.unit.test_policies:counter")], ["'toy'", "counter"]),
        ([("ssp", None), ("asp", None)], ["'ssp'", "'asp'"]),  # every clash is listed
    ],
)
def test_an_entry_point_clash_raises_and_lists_it(
    fresh_registry: list[EntryPoint], names_values: list[tuple[str, str | None]], words: list[str]
) -> None:
    for name, value in names_values:
        fresh_registry.append(_entry_point(name, value or "tests.unit.test_policies:toy_policy"))
    with pytest.raises(PolicyError, match="clash") as info:
        policy_names()
    for word in words:
        assert word in str(info.value)
    assert registry._REGISTRY["bsp"].__module__ == "policies.sync"  # nothing was replaced
    assert "toy" not in registry._REGISTRY


def test_unknown_parameters_list_the_valid_ones() -> None:
    with pytest.raises(PolicyError, match="bogus") as info:
        make_policy("ssp", {"bogus": 1, "staleness": 2})
    assert "staleness, weight" in str(info.value)
    with pytest.raises(PolicyError, match="bsp takes no parameters"):
        make_policy("bsp", {"staleness": 1})


def counter(name: str, step: int) -> Policy:
    """A stateful toy member: counts events in its state, emits a Release for worker ``step``."""

    def init(view: ClusterView) -> int:
        return 0

    def update(event: Event, state: int, view: ClusterView) -> tuple[Sequence[Decision], int]:
        return [Release(step)], state + step

    return Policy(name, init, update, {"step": step})


def test_compose_concatenates_decisions_and_keeps_member_state() -> None:
    policy = compose(make_policy("asp", {"weight": 1.0}), counter("c1", 1), counter("c10", 10))
    assert policy.name == "asp+c1+c10"
    assert policy.params == {"asp": {"weight": 1.0}, "c1": {"step": 1}, "c10": {"step": 10}}
    view = view_of({0: (1, T), 1: (0, F)})
    state = policy.init(view)
    assert state == (None, 0, 0)
    decisions, state = policy.update(push(0), state, view)
    assert list(decisions) == [Apply(1.0), Release(0), Release(1), Release(10)]
    _, state = policy.update(Tick(now=2.0), state, view)
    assert state == (None, 2, 20)


def test_compose_needs_a_policy() -> None:
    with pytest.raises(ValueError):
        compose()
