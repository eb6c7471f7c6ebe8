"""SSP and a silent worker: the gate stops waiting for a worker that has been computing for far
longer than its own pace (stopped, cut off, hung), and takes it back at the slowest responsive
clock when it pushes again. ``patience=None`` is the classic gate that waits for everyone."""

from __future__ import annotations

from typing import Any

from policies import ClusterView, WorkerFacts, make_policy
from policies.sync import SspState, silent_workers
from policies.types import Apply, Join, Push, Release, Tick


def facts(w: int, clock: int, waiting: bool, last: float | None, prev: float | None) -> WorkerFacts:
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


def view(now: float, *workers: WorkerFacts) -> ClusterView:
    return ClusterView(now=now, version=0, workers={f.worker: f for f in workers}, global_batch=64)


def push(w: int, now: float) -> Push:
    return Push(now, w, 0, "grad", 32, 1, 0.05)


# w0 pushes every 0.1 s and waits at the bound (clock 14); w1 last pushed at t = 10.0 (clock 10) and
# has been computing since: silent once 10 x 0.1 s and the 1 s floor have passed, i.e. after t = 11.
FAST = facts(0, 14, True, 10.0, 9.9)


def slow(now_clock: int = 10, waiting: bool = False, last: float = 10.0) -> WorkerFacts:
    return facts(1, now_clock, waiting, last, last - 0.1)


def test_a_worker_is_silent_only_past_patience_times_its_pace_and_the_floor() -> None:
    assert silent_workers(view(10.9, FAST, slow()), 10.0) == frozenset()
    assert silent_workers(view(11.1, FAST, slow()), 10.0) == frozenset({1})
    assert silent_workers(view(11.1, FAST, slow()), 20.0) == frozenset()  # 20 x 0.1 s = 2 s
    assert silent_workers(view(11.1, FAST, slow()), None) == frozenset()
    # waiting is not silent: it is the gate's to release
    assert silent_workers(view(99.0, FAST, slow(waiting=True)), 10.0) == frozenset()


def test_a_joiner_compiling_its_first_step_is_measured_against_the_others_pace() -> None:
    # Joined at t = 0 and no push yet: the others' median pace is 0.1 s, so silent after 1 s.
    joiner = facts(1, 10, False, None, None)
    assert silent_workers(view(0.9, FAST, joiner), 10.0) == frozenset()
    assert silent_workers(view(1.1, FAST, joiner), 10.0) == frozenset({1})
    # Before anyone has a pace (every worker compiling at the start) nobody is silent.
    first = facts(0, 0, False, None, None)
    assert silent_workers(view(99.0, first, joiner), 10.0) == frozenset()


def test_the_others_wait_for_a_slow_worker_but_not_for_a_silent_one() -> None:
    p = make_policy("ssp", {"staleness": 3})
    state = p.init(view(10.5, FAST, slow()))
    decisions, state = p.update(Tick(10.5), state, view(10.5, FAST, slow()))
    assert list(decisions) == []  # 4 ahead of a worker that is only slow: held
    decisions, state = p.update(Tick(11.2), state, view(11.2, FAST, slow()))
    assert list(decisions) == [Release(0)]
    assert state == SspState({}, (1,))
    classic = make_policy("ssp", {"staleness": 3, "patience": None})
    decisions, _ = classic.update(Tick(60.0), classic.init(view(0, FAST)), view(60.0, FAST, slow()))
    assert list(decisions) == []  # waits for it until the daemon drops it


def test_a_worker_back_from_a_silence_re_enters_at_the_slowest_responsive_clock() -> None:
    p = make_policy("ssp", {"staleness": 3})
    state: Any = SspState({}, (1,))
    # Back after 12 s: the others went on to clock 250; it pushes its clock 11.
    others = facts(0, 250, True, 22.0, 21.9)
    back = slow(11, waiting=True, last=22.05)
    decisions, state = p.update(push(1, 22.05), state, view(22.05, others, back))
    assert list(decisions) == [Apply(0.5), Release(0), Release(1)]
    assert state == SspState({1: 239}, ())
    # From there the bound holds on the gate clocks: 4 ahead of it is held, 3 is released.
    ahead = facts(0, 254, True, 22.4, 22.3)
    decisions, state = p.update(push(0, 22.4), state, view(22.4, ahead, slow(11, last=22.05)))
    assert list(decisions) == [Apply(0.5)]
    decisions, state = p.update(
        push(1, 22.45), state, view(22.45, ahead, slow(12, waiting=True, last=22.45))
    )
    assert list(decisions) == [Apply(0.5), Release(0), Release(1)]
    assert state == SspState({1: 239}, ())


def test_a_worker_joining_behind_starts_at_the_slowest_and_the_offset_goes_with_a_leave() -> None:
    p = make_policy("ssp", {"staleness": 3})
    others = facts(0, 250, True, 22.0, 21.9)
    joiner = facts(2, 11, True, None, None)
    decisions, state = p.update(Join(22.0, 2), p.init(view(22.0)), view(22.0, others, joiner))
    assert list(decisions) == [Release(0), Release(2)]
    assert state == SspState({2: 239}, ())
    _, state = p.update(Tick(22.1), state, view(22.1, others))
    assert state == SspState({}, ())
