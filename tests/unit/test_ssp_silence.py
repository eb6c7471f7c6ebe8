"""SSP and a silent worker: the gate stops waiting for a worker that has been computing for far
longer than its own cadence (stopped, cut off, hung), and takes it back at the slowest responsive
clock when it pushes again. ``patience=None`` is the classic gate that waits for everyone.

The policy is pure: these tests drive it with a scripted clock (:class:`Script` keeps the facts the
engine would: clocks, push times, who waits)."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from policies import ClusterView, Policy, WorkerFacts, make_policy
from policies.sync import SspState, silent_workers
from policies.types import Apply, Decision, Event, Join, Push, Release, Tick


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
# has been computing since: silent once 10 x 0.1 s have passed (above the floor), i.e. after t = 11.
FAST = facts(0, 14, True, 10.0, 9.9)


def slow(now_clock: int = 10, waiting: bool = False, last: float = 10.0) -> WorkerFacts:
    return facts(1, now_clock, waiting, last, last - 0.1)


def test_a_worker_is_silent_only_past_patience_times_its_pace_and_the_floor() -> None:
    assert silent_workers(view(10.9, FAST, slow()), 10.0) == frozenset()
    assert silent_workers(view(11.1, FAST, slow()), 10.0) == frozenset({1})
    assert silent_workers(view(11.1, FAST, slow()), 20.0) == frozenset()  # 20 x 0.1 s = 2 s
    assert silent_workers(view(11.1, FAST, slow()), None) == frozenset()
    # the floor: patience 1 of a 0.1 s cadence would be 0.1 s; a loaded host's stall is longer
    assert silent_workers(view(10.2, FAST, slow()), 1.0) == frozenset()
    assert silent_workers(view(10.3, FAST, slow()), 1.0) == frozenset({1})
    # its cadence is the median of its recent intervals when the gate has them, not its last one
    assert silent_workers(view(11.1, FAST, slow()), 10.0, {1: (0.2, 0.2, 0.1)}) == frozenset()
    assert silent_workers(view(12.1, FAST, slow()), 10.0, {1: (0.2, 0.2, 0.1)}) == frozenset({1})
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
    assert (state.offset, state.silent) == ({1: 239}, ())
    assert state.intervals[1] == pytest.approx((0.1,))  # its first interval since it came back


def test_a_worker_joining_behind_starts_at_the_slowest_and_the_offset_goes_with_a_leave() -> None:
    p = make_policy("ssp", {"staleness": 3})
    others = facts(0, 250, True, 22.0, 21.9)
    joiner = facts(2, 11, True, None, None)
    decisions, state = p.update(Join(22.0, 2), p.init(view(22.0)), view(22.0, others, joiner))
    assert list(decisions) == [Release(0), Release(2)]
    assert state == SspState({2: 239}, ())
    _, state = p.update(Tick(22.1), state, view(22.1, others))
    assert state == SspState({}, ())


class Script:
    """A policy driven by a scripted clock, with the facts the engine keeps: a push counts on the
    pusher's clock, times it and makes it wait; a release lets it compute."""

    def __init__(self, policy: Policy, workers: int) -> None:
        self.policy = policy
        self.facts = {w: WorkerFacts(w, f"w{w}", 0, 0, False, 0.0) for w in range(workers)}
        self.state = policy.init(self.view(0.0))

    def view(self, now: float) -> ClusterView:
        return ClusterView(now=now, version=0, workers=dict(self.facts), global_batch=64)

    def push(self, w: int, now: float) -> list[Decision]:
        f = self.facts[w]
        self.facts[w] = dataclasses.replace(
            f, clock=f.clock + 1, waiting=True, prev_push_at=f.last_push_at, last_push_at=now
        )
        return self._run(push(w, now), now)

    def tick(self, now: float) -> list[Decision]:
        return self._run(Tick(now), now)

    def _run(self, event: Event, now: float) -> list[Decision]:
        decisions, self.state = self.policy.update(event, self.state, self.view(now))
        for d in decisions:
            if isinstance(d, Release):
                self.facts[d.worker] = dataclasses.replace(self.facts[d.worker], waiting=False)
        return list(decisions)


def lockstep(s: Script, every: float, until: float) -> None:
    """Every worker pushes every ``every`` s up to ``until``."""
    for k in range(1, round(until / every) + 1):
        for w in s.facts:
            s.push(w, k * every)


def test_a_worker_pushing_every_50_ms_is_silent_after_half_a_second() -> None:
    s = Script(make_policy("ssp", {"staleness": 3}), 2)
    lockstep(s, 0.05, 1.0)  # clocks 20 and 20; then w1 stops while it computes
    for t in (1.05, 1.10, 1.15):
        assert Release(0) in s.push(0, t)  # 1, 2, 3 ahead: within the bound
    assert Release(0) not in s.push(0, 1.20)  # 4 ahead: held
    assert Release(0) not in s.tick(1.45)  # 0.45 s: 9 of its own pushes, not yet silent
    assert Release(0) in s.tick(1.55)  # past 10 x 50 ms (the 1 s floor held it to t = 2.0)
    assert s.state.silent == (1,)


def test_the_floor_holds_a_fast_worker_for_a_quarter_second() -> None:
    s = Script(make_policy("ssp", {"staleness": 0, "patience": 1.0}), 2)
    lockstep(s, 0.05, 1.0)
    assert Release(0) not in s.push(0, 1.05)
    assert Release(0) not in s.tick(1.2)  # 1 x 50 ms passed long ago, the 0.25 s floor not
    assert Release(0) in s.tick(1.3)


def test_a_slow_worker_is_not_silent_early_after_one_quick_push() -> None:
    s = Script(make_policy("ssp", {"staleness": 3}), 2)
    lockstep(s, 2.0, 10.0)  # a push every 2 s
    s.push(0, 10.1)
    s.push(1, 10.1)  # one quick push: its last interval is 0.1 s, its cadence still 2 s
    s.tick(15.0)
    assert s.state.silent == ()  # the last interval alone (0.1 s) said silent after 1 s
    s.tick(30.0)
    assert s.state.silent == ()
    s.tick(30.2)  # 10 x 2 s after its last push
    assert s.state.silent == (0, 1)


def test_a_silence_is_not_taken_for_the_workers_cadence() -> None:
    s = Script(make_policy("ssp", {"staleness": 3}), 2)
    lockstep(s, 0.05, 1.0)
    for t in (1.05, 1.10, 1.15, 1.20):
        s.push(0, t)
    s.tick(1.55)
    assert s.state.silent == (1,)
    for k in range(45):  # w1 stalls for 12 s; w0 goes on, now every 0.25 s
        s.push(0, 1.55 + 0.25 * k)
    assert Release(1) in s.push(1, 13.0)  # back after 12 s: re-enters at the slowest clock
    assert s.state.silent == ()
    assert max(s.state.intervals[1]) < 0.1  # the 12 s were a silence, not its cadence
    s.push(0, 13.05)
    assert 1 not in s.state.silent
    s.tick(13.45)
    assert s.state.silent == ()
    s.tick(13.55)  # stopped again: silent after 10 x 50 ms, not 10 x 12 s
    assert s.state.silent == (1,)
