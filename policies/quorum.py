"""A quorum gate around a synchronous policy (docs/policies.md §13.3): rounds that do not wait for
stragglers, and late work merged, never dropped.

``quorum(policy=...)`` wraps a policy that buffers its pushes by round (``diloco``, ``bsp``,
``lbbsp``, ``hps``). It keeps the inner policy's plans, stage and push weights, but owns the rounds:

* every push is buffered under the *open* round ``R``, whatever round the inner policy named;
* ``R`` closes when at least ``q`` of the workers released into it (default ``⌈N/2⌉``) have pushed
  and a grace window has passed since the ``q``-th arrival: ``median + k·MAD`` of recent offsets of
  later arrivals behind the ``q``-th one (from the last ``rounds`` rounds; before any round
  has closed, the gate waits for everyone, which measures the first offsets); it closes at once
  when everyone released into it has pushed;
* the close flushes the round (the sample-weighted mean, as the inner policy weighted each push)
  and releases every waiting worker into ``R + 1``;
* a worker still computing on an older round pushes *late*: its update joins the open round's
  buffer with its own weight (samples), its lag is recorded, and it is released at once into the
  open round, so it never waits for a round it was not part of.

The inner policy's ``Flush`` and ``Release`` decisions are dropped: the gate decides both. Pure: no
I/O, no clock (times come from events).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from policies.profiling import freeze, is_int
from policies.registry import make_policy, register
from policies.types import (
    Apply,
    Buffer,
    ClusterView,
    Decision,
    Drop,
    Event,
    Flush,
    Policy,
    Push,
    Release,
    SetPlan,
    SetStage,
)

_KEEP = 16  # lags of late pushes kept for status pages


@dataclass(frozen=True, slots=True)
class QuorumState:
    """The inner policy's state and the gate's rounds."""

    inner: Any
    round: int = 0  # the open round R
    base: Mapping[int, int] = field(
        default_factory=lambda: freeze({})
    )  # worker -> the round it was released into
    arrived: tuple[int, ...] = ()  # on-time pushes to R, in arrival order
    t_quorum: float | None = None  # s, when R's q-th on-time push arrived
    quorum_at: Mapping[int, float] = field(
        default_factory=lambda: freeze({})
    )  # recent rounds -> their q-th arrival time
    offsets: tuple[tuple[int, float], ...] = ()  # (round, s behind its q-th arrival)
    closed: int = 0  # rounds closed
    early: int = 0  # of which before everyone released into them had pushed
    late: int = 0  # pushes merged into a later round than their own
    lags: tuple[int, ...] = ()  # rounds behind, of the last late pushes

    def shifted(self, dt: float) -> QuorumState:
        """The same state with its engine-clock times (and the inner state's, when it has a
        ``shifted``) moved by ``dt`` s (a checkpoint restored under another clock)."""
        inner_shift = getattr(self.inner, "shifted", None)
        return replace(
            self,
            inner=inner_shift(dt) if callable(inner_shift) else self.inner,
            t_quorum=None if self.t_quorum is None else self.t_quorum + dt,
            quorum_at=freeze({r: t + dt for r, t in self.quorum_at.items()}),
        )

    def describe(self) -> dict[str, Any]:
        """Plain values for status pages."""
        return {
            "round": self.round,
            "arrived": list(self.arrived),
            "closed": self.closed,
            "closed_early": self.early,
            "late_merged": self.late,
            "late_lags": list(self.lags),
            "offsets_s": [o for _, o in self.offsets],
        }


def grace_window(offsets: Sequence[float], k: float) -> float:
    """``median + k·MAD`` of the offsets (s); infinite with none (wait for everyone)."""
    if not offsets:
        return math.inf
    med = statistics.median(offsets)
    mad = statistics.median(abs(o - med) for o in offsets)
    return med + k * mad


@register("quorum")
def quorum(
    policy: str = "diloco",
    q: int | None = None,
    k: float = 3.0,
    rounds: int = 8,
    **params: Any,
) -> Policy:
    """The quorum gate around ``policy`` (built with ``params``): a round closes when ``q`` (None:
    ``⌈N/2⌉``) of the workers released into it have pushed and ``median + k·MAD`` of the recent
    arrival offsets behind the ``q``-th (over ``rounds`` rounds) has passed; late pushes join the
    open round with their samples' weight, never dropped."""
    if policy == "quorum":
        raise ValueError(
            "policy must be a synchronous policy (diloco, bsp, lbbsp, hps), not quorum"
        )
    if q is not None and not is_int(q, 1):
        raise ValueError(f"q must be an int >= 1 or None (half the workers), got {q!r}")
    if not (isinstance(k, int | float) and not isinstance(k, bool) and math.isfinite(k) and k >= 0):
        raise ValueError(f"k must be a finite number >= 0, got {k!r}")
    if not is_int(rounds, 1):
        raise ValueError(f"rounds must be an int >= 1, got {rounds!r}")
    inner = make_policy(policy, params)

    def init(view: ClusterView) -> QuorumState:
        return QuorumState(inner.init(view), base=freeze(dict.fromkeys(view.workers, 0)))

    def update(
        event: Event, state: QuorumState, view: ClusterView
    ) -> tuple[Sequence[Decision], QuorumState]:
        decisions, inner_state = inner.update(event, state.inner, view)
        st = replace(state, inner=inner_state)
        base = {w: st.base.get(w, st.round) for w in view.workers}
        head: list[Decision] = []
        plans: list[Decision] = [d for d in decisions if isinstance(d, SetPlan | SetStage)]
        out: list[Decision] = []
        if isinstance(event, Push) and event.worker in view.workers:
            w = event.worker
            weight = next((d.weight for d in decisions if isinstance(d, Buffer)), None)
            other = next((d for d in decisions if isinstance(d, Apply | Drop)), None)
            if weight is not None:
                head.append(Buffer(weight, group=st.round))
            elif other is not None:  # an inner policy that applies or drops: its choice
                head.append(other)
            else:
                head.append(Buffer(float(event.samples), group=st.round))
            if base[w] == st.round:
                arrived = (*st.arrived, w)
                st = replace(st, arrived=arrived)
                if st.t_quorum is not None:
                    st = _offset(st, st.round, event.now - st.t_quorum, rounds)
                elif len(arrived) >= _need(q, view, base, st.round):
                    st = replace(st, t_quorum=event.now)
            else:  # late: merged into the open round, released into it at once
                t_q = st.quorum_at.get(base[w])
                if t_q is not None:
                    st = _offset(st, base[w], event.now - t_q, rounds)
                lag = st.round - base[w]
                st = replace(st, late=st.late + 1, lags=(*st.lags, lag)[-_KEEP:])
                base[w] = st.round
                out.append(Release(w))
        cohort = [w for w in view.workers if base[w] == st.round]
        present = [w for w in st.arrived if w in view.workers]
        everyone = bool(cohort) and all(w in present for w in cohort)
        pending = view.buffered + (1 if isinstance(event, Push) else 0)
        grace = grace_window([o for r, o in st.offsets if r < st.round], k)  # closed rounds
        timed_out = st.t_quorum is not None and event.now >= st.t_quorum + grace
        if (everyone or timed_out or not cohort) and (pending or present):
            out.append(Flush(normalize=True, upto=st.round))
            released = [f.worker for f in view.workers.values() if f.waiting]
            out.extend(Release(w) for w in released)
            for w in released:
                base[w] = st.round + 1
            at = dict(st.quorum_at)
            if st.t_quorum is not None:
                at[st.round] = st.t_quorum
            st = replace(
                st,
                round=st.round + 1,
                arrived=(),
                t_quorum=None,
                quorum_at=freeze({r: t for r, t in at.items() if r > st.round - rounds}),
                closed=st.closed + 1,
                early=st.early + (0 if everyone else 1),
            )
        else:  # a newcomer, a resume, a swap: whoever waits without a push in R starts in R
            for w, f in view.workers.items():
                if f.waiting and w not in st.arrived:
                    out.append(Release(w))
                    base[w] = st.round
        return [*head, *plans, *out], replace(st, base=freeze(base))

    return Policy(
        "quorum",
        init,
        update,
        {"policy": policy, "q": q, "k": k, "rounds": rounds, **params},
        reads_evals=inner.reads_evals,
    )


def _need(q: int | None, view: ClusterView, base: Mapping[int, int], r: int) -> int:
    """On-time pushes that make the quorum of round ``r``: ``q`` (or ``⌈N/2⌉``), at most the
    workers released into it."""
    cohort = sum(1 for w in view.workers if base.get(w) == r)
    want = q if q is not None else math.ceil(view.n / 2)
    return max(1, min(want, cohort))


def _offset(st: QuorumState, r: int, offset: float, rounds: int) -> QuorumState:
    kept = tuple((rr, o) for rr, o in (*st.offsets, (r, offset)) if rr > st.round - rounds)
    return replace(st, offsets=kept)


__all__ = ["QuorumState", "grace_window", "quorum"]
