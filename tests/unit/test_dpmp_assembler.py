"""The dpmp assembler: only complete, disjoint, covering parts of a live step become an update."""

from __future__ import annotations

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from policies.dpmp.assembler import (
    Assembled,
    AssemblerState,
    Dropped,
    Part,
    Waiting,
    abort,
    offer,
    regroup,
    release,
)

MODEL = frozenset(f"b{j:02d}/w" for j in range(6))
SLICES = {1: [MODEL], 2: [MODEL - {"b04/w", "b05/w"}, frozenset({"b04/w", "b05/w"})]}
SLICES[3] = [
    frozenset({"b00/w"}),
    frozenset({"b01/w", "b02/w", "b03/w"}),
    frozenset({"b04/w", "b05/w"}),
]


def _part(stage: int, paths: frozenset[str], step: int = 1, gen: int = 1, base: int = 7) -> Part:
    return Part(0, gen, step, stage, base, 64, paths, payload={p: stage for p in paths})


def _two_stage(step: int = 1) -> AssemblerState:
    s = regroup(AssemblerState(MODEL), 0, gen=1, stages=2)
    return release(s, 0, step, base_version=7, samples=64, now=10.0)


def test_a_step_assembles_only_when_every_stage_is_in() -> None:
    s = _two_stage()
    out, s = offer(s, _part(1, SLICES[2][1]), now=10.5)
    assert out == Waiting((0,))
    out, s = offer(s, _part(0, SLICES[2][0]), now=11.0)
    assert isinstance(out, Assembled)
    assert [p.stage for p in out.parts] == [0, 1] and out.samples == 64 and out.base_version == 7
    assert out.wall_s == pytest.approx(1.0)
    assert s.pending == {} and s.released == {}
    again, _ = offer(s, _part(0, SLICES[2][0]), now=12.0)  # a late duplicate
    assert isinstance(again, Dropped) and "already" in again.reason


def test_wrong_generation_unreleased_steps_and_duplicates_drop() -> None:
    s = _two_stage()
    for bad, why in [
        (_part(0, SLICES[2][0], gen=0), "stale generation"),
        (_part(0, SLICES[2][0], step=2), "not released"),
        (_part(2, SLICES[2][0]), "out of range"),
        (_part(0, SLICES[2][0], base=6), "release was 7"),
    ]:
        out, s2 = offer(s, bad, now=11.0)
        assert isinstance(out, Dropped) and why in out.reason and s2 == s
    _, s = offer(s, _part(0, SLICES[2][0]), now=11.0)
    out, s3 = offer(s, _part(0, SLICES[2][0]), now=11.0)
    assert isinstance(out, Dropped) and "duplicate" in out.reason and s3 == s


def test_overlapping_or_missing_parts_abort_the_step() -> None:
    s = _two_stage()
    _, s = offer(s, _part(0, SLICES[2][0]), now=11.0)
    out, s = offer(s, _part(1, SLICES[2][1] | {"b00/w"}), now=11.0)
    assert isinstance(out, Dropped) and "overlap" in out.reason
    assert s.pending == {} and s.aborted == 1
    s = release(s, 0, 2, 8, 64, 12.0)
    _, s = offer(s, _part(0, SLICES[2][0], step=2, base=8), now=12.0)
    out, s = offer(s, _part(1, frozenset({"b04/w"}), step=2, base=8), now=12.0)
    assert isinstance(out, Dropped) and "miss" in out.reason and s.aborted == 2


def test_a_dead_stage_or_a_regroup_discards_the_pending_step() -> None:
    s = _two_stage()
    _, s = offer(s, _part(0, SLICES[2][0]), now=11.0)
    dead = abort(s, 0, "stage 1 closed its socket")
    out, _ = offer(dead, _part(1, SLICES[2][1]), now=11.0)
    assert isinstance(out, Dropped) and dead.pending == {}
    moved = regroup(s, 0, gen=2, stages=1)
    out, _ = offer(moved, _part(1, SLICES[2][1]), now=11.0)
    assert isinstance(out, Dropped) and "stale generation" in out.reason
    with pytest.raises(ValueError, match="not newer"):
        regroup(moved, 0, gen=2, stages=2)
    with pytest.raises(ValueError, match="not after"):
        release(s, 0, 1, 7, 64, 12.0)
    with pytest.raises(ValueError, match="no route"):
        release(s, 5, 1, 7, 64, 12.0)


# --- properties --------------------------------------------------------------------------------

ops = st.lists(
    st.one_of(
        st.tuples(st.just("release"), st.integers(0, 1)),
        st.tuples(st.just("abort"), st.integers(0, 1)),
        st.tuples(  # every part of the current step, one of them perhaps wrong
            st.just("all"),
            st.integers(0, 1),
            st.integers(0, 2),
            st.sampled_from(["right", "right", "overlap", "short"]),
        ),
        st.tuples(st.just("regroup"), st.integers(0, 1), st.integers(1, 3)),
        st.tuples(
            st.just("part"),
            st.integers(0, 1),  # replica
            st.integers(0, 3),  # stage
            st.sampled_from([0, 0, 0, -1]),  # generation offset
            st.sampled_from([0, 0, 0, -1, 1]),  # step offset
            st.sampled_from(["right", "right", "right", "overlap", "short"]),
        ),
    ),
    max_size=60,
)


@settings(max_examples=300, deadline=None)
@given(ops)
def test_nothing_partial_or_foreign_is_ever_assembled(script: list[tuple]) -> None:
    s = AssemblerState(MODEL)
    gen = {0: 1, 1: 1}
    size = {0: 2, 1: 3}
    step = {0: 0, 1: 0}
    live: set[tuple[int, int, int]] = set()  # released, not yet assembled, aborted or replaced
    done: set[tuple[int, int, int]] = set()
    for r in (0, 1):
        s = regroup(s, r, gen[r], size[r])
    for op in script:
        if op[0] == "release":
            r = op[1]
            step[r] += 1
            live = {k for k in live if k[0] != r} | {(r, gen[r], step[r])}
            s = release(s, r, step[r], 100 + step[r], 32, 0.0)
        elif op[0] == "abort":
            live = {k for k in live if k[0] != op[1]}
            s = abort(s, op[1])
        elif op[0] == "regroup":
            r = op[1]
            gen[r] += 1
            size[r] = op[2]
            live = {k for k in live if k[0] != r}
            s = regroup(s, r, gen[r], size[r])
        else:
            if op[0] == "all":
                _, r, bad, kind = op
                parts = [
                    Part(r, gen[r], step[r], k, 100 + step[r], 32, _paths(size[r], k, kind, bad))
                    for k in range(size[r])
                ]
            else:
                _, r, stage, dg, dt, kind = op
                paths = _paths(size[r], stage, kind, stage)
                parts = [Part(r, gen[r] + dg, step[r] + dt, stage, 100 + step[r] + dt, 32, paths)]
            for part in parts:
                s = _check(s, part, live, done, gen, size)
        assert len(s.released) <= 2 and len(s.pending) <= 2  # bounded: one step per replica


def _paths(n: int, stage: int, kind: str, bad: int) -> frozenset[str]:
    """Stage ``stage``'s slice of an ``n``-stage replica, overlapping or short if it is ``bad``."""
    paths = SLICES[n][stage] if stage < n else frozenset({"b00/w"})
    if stage != bad or kind == "right":
        return paths
    if kind == "overlap":
        return paths | {"b00/w", "b05/w"}
    return frozenset(sorted(paths)[1:])


def _check(
    s: AssemblerState,
    part: Part,
    live: set[tuple[int, int, int]],
    done: set[tuple[int, int, int]],
    gen: dict[int, int],
    size: dict[int, int],
) -> AssemblerState:
    """Offer ``part``; an assembled step must be live, whole, disjoint and covering."""
    r = part.replica
    out, s = offer(s, part, 0.0)
    if not isinstance(out, Assembled):
        return s
    key = (out.replica, out.gen, out.step)
    assert key in live and key not in done
    assert out.gen == gen[r] and len(out.parts) == size[r]
    assert [p.stage for p in out.parts] == list(range(size[r]))
    union: set[str] = set()
    for p in out.parts:
        assert not (union & p.paths)
        union |= p.paths
        assert (p.replica, p.gen, p.step) == key
    assert union == MODEL
    event("assembled")
    event(f"assembled {size[r]} stages")
    live.discard(key)
    done.add(key)
    return s


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 3), st.permutations(range(3)))
def test_every_right_part_of_a_live_step_in_any_order_assembles(n: int, order: list[int]) -> None:
    s = regroup(AssemblerState(MODEL), 0, 1, n)
    s = release(s, 0, 1, 7, 64, 0.0)
    outs = []
    for stage in [k for k in order if k < n]:
        out, s = offer(s, _part(stage, SLICES[n][stage]), 1.0)
        outs.append(out)
    assert all(isinstance(o, Waiting) for o in outs[:-1]) and isinstance(outs[-1], Assembled)
