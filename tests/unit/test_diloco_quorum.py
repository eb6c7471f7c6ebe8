"""The quorum gate (docs/policies.md §13.3) around ``diloco``, as a table of events -> decisions:
the first round waits for everyone and measures offsets; later rounds close after the quorum and
``median + k·MAD`` of those offsets; a late push joins the open round and is never dropped."""

from __future__ import annotations

import math
from typing import Any

import pytest

from policies import ClusterView, PolicyError, WorkerFacts, make_policy
from policies.quorum import grace_window
from policies.types import Buffer, Decision, Flush, Push, Release, Tick


def view(now: float, waiting: set[int], clocks: dict[int, int], buffered: int = 0) -> ClusterView:
    facts = {
        w: WorkerFacts(w, f"w{w}", c, 0, w in waiting, 0.0, batch_size=32)
        for w, c in clocks.items()
    }
    return ClusterView(now, 0, facts, 128, buffered)


def push(now: float, w: int) -> Push:
    return Push(now, w, 0, "delta", 5 * 32, 5, 0.5)


def releases(d: Any) -> set[int]:
    return {x.worker for x in d if isinstance(x, Release)}


def flushes(d: Any) -> list[Flush]:
    return [x for x in d if isinstance(x, Flush)]


def test_grace_window_is_median_plus_k_mad() -> None:
    assert grace_window([], 3.0) == math.inf
    assert grace_window([0.5, 1.0], 3.0) == pytest.approx(0.75 + 3 * 0.25)
    assert grace_window([1.0, 1.0, 1.0], 3.0) == 1.0


def test_rounds_close_on_quorum_and_grace_and_late_pushes_are_merged() -> None:
    p = make_policy("quorum", {"policy": "diloco", "H": 5})
    all4 = {0, 1, 2, 3}
    v = view(0.0, all4, dict.fromkeys(all4, 0))
    d, s = p.update(Tick(0.0), p.init(v), v)
    assert releases(d) == all4  # everyone starts in round 0
    # Round 0: no history yet, so it waits for everyone; offsets behind the 2nd arrival are kept.
    c = dict.fromkeys(all4, 0)
    waiting: set[int] = set()
    d_all: list[Decision] = []
    for n, (t, w) in enumerate([(1.0, 0), (1.0, 1), (1.5, 2), (2.0, 3)]):
        c[w] = 1
        waiting.add(w)
        d, s = p.update(push(t, w), s, view(t, set(waiting), dict(c), buffered=n))
        assert d[0] == Buffer(160.0, group=0)
        d_all = list(d)
        if w != 3:
            assert not flushes(d) and not releases(d)
    assert flushes(d_all) == [Flush(normalize=True, upto=0)] and releases(d_all) == all4
    assert [o for _, o in s.offsets] == [0.5, 1.0] and s.round == 1 and s.early == 0
    # Round 1: workers 0 and 1 arrive at 3.0; the grace is 0.75 + 3 * 0.25 = 1.5 s.
    waiting = set()
    for n, w in enumerate((0, 1)):
        c[w] = 2
        waiting.add(w)
        d, s = p.update(push(3.0, w), s, view(3.0, set(waiting), dict(c), buffered=n))
        assert d[0] == Buffer(160.0, group=1)
    d, s = p.update(Tick(4.0), s, view(4.0, waiting, dict(c), buffered=2))
    assert not flushes(d)
    d, s = p.update(Tick(4.6), s, view(4.6, waiting, dict(c), buffered=2))
    assert flushes(d) == [Flush(normalize=True, upto=1)] and releases(d) == {0, 1}
    assert s.round == 2 and s.early == 1
    # Worker 3 pushes its round-1 work during round 2: buffered into round 2, released at once.
    c[3] = 2
    d, s = p.update(push(5.0, 3), s, view(5.0, {3}, dict(c)))
    assert d[0] == Buffer(160.0, group=2)
    assert releases(d) == {3} and not flushes(d)
    assert s.late == 1 and s.lags == (1,)
    assert s.offsets[-1] == (1, 2.0)  # 2 s behind round 1's quorum: the window learns it


def test_bad_quorum_parameters() -> None:
    for params, message in (
        ({"q": 0}, "q must be an int >= 1"),
        ({"k": -1}, "k must be"),
        ({"policy": "quorum"}, "synchronous policy"),
        ({"policy": "diloco", "H": 0}, "H must be"),
    ):
        with pytest.raises(PolicyError, match=message):
            make_policy("quorum", params)


def test_a_restored_state_keeps_its_times_relative_to_now() -> None:
    p = make_policy("quorum", {"policy": "diloco_async"})
    v = view(0.0, set(), {0: 0, 1: 0})
    s = p.init(v)
    s = s.__class__(s.inner, round=3, t_quorum=10.0, quorum_at={2: 8.0})
    moved = s.shifted(100.0)
    assert moved.t_quorum == 110.0 and dict(moved.quorum_at) == {2: 108.0}
