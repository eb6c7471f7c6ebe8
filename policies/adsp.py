"""ADSP (Hu, Wang, Wu, AAAI 2020; docs/policies.md): no barriers, equal commit rates, and an online
search for the commit rate.

Owns the ``adsp`` policy: commit quotas ``m_i`` per check period ``Γ`` (:func:`quotas`: every
period, each worker is asked to reach ``max_j c_j + rate`` commits, so laggards commit more often),
the per-cycle search that raises the common ``rate`` while the loss-decrease reward improves
(:func:`search_step`, :func:`reward`), the local-step plans that spend ``Γ / m_i`` per commit
(:func:`local_steps`), and :func:`describe_state`.

Three readings of §9 are ours [D]: the catch-up ``C_target - c_i`` is recomputed every period (held
for a whole cycle, as the reimplementation's quotas are, laggards overshoot for K periods and the
lead flips from cycle to cycle); and a new cycle restarts the search from the current rate, not from
one commit per period (with a loss that flattens over time, a search from 1 would stay near 1).
The first search starts where the slowest worker commits every ``start_steps`` of its rounds
(:func:`start_rate`): a first period of one commit each measures no reward and leaves the model
unchanged for a whole ``Γ``.

Before the first cycle every worker is profiled from its pushes (``policies.profiling``, ASP-style,
one step per push); a newcomer later is profiled alone and then joins at the current rate. Commits
are applied on arrival as ``w + γ·Δ``; every waiting worker is released at once. The
reimplementation's handshakes at cycle starts are not barriers here: new quotas ride on the next
reply [D].
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from policies import profiling as prof
from policies.compose import release_waiting
from policies.profiling import ProfilingConfig, WorkerTrack, freeze, is_int
from policies.registry import register
from policies.types import (
    Apply,
    ClusterView,
    Decision,
    Event,
    Policy,
    Push,
    SetPlan,
    SetStage,
)

PROFILE, TRAIN = "profile", "ADSP"
PROFILE_FIELDS: Mapping[str, Any] = freeze({"local_steps": 1, "lr_scale": 1.0})
MODES = ("steps", "time")
_KEEP = 32  # search records kept in the state


@dataclass(frozen=True, slots=True)
class AdspConfig:
    """``adsp`` parameters; defaults from §9 (the ASHL authors' reimplementation) unless [D]."""

    period_s: float | None = None  # Γ: the check period, s; None: period_steps slowest rounds [D]
    period_steps: int = 20  # Γ = this x the slowest worker's (step + commit overhead) [D]
    # The search starts at the rate at which the slowest worker commits every this many of its
    # rounds (step + commit overhead); None: at one commit per period (the paper's) [D]
    start_steps: int | None = 2
    cycle_periods: int = 20  # K: periods per search cycle
    weight: float | None = None  # γ: the weight of a commit; None: 1/N [D]
    mode: str = "steps"  # "steps": the PS sets local_steps; "time": also local_time_s
    lr_decay: float = 0.9  # worker lr scale x this per cycle
    reward_window: float = 0.1  # the fraction of a period whose losses make L_start, L_end [D]
    overhead_window: int = 10  # commits in T1's mean
    max_local_steps: int = 10_000  # guard [D]
    profile_pushes: int = 5  # pushes per worker in the profile stage [D]
    trim: float = 0.2
    comm_factor: float = 1.0
    drift: float = 0.3  # re-plan when a worker's speed moves by more than this [D]
    drift_patience: int = 3
    alpha: float = 0.5

    def __post_init__(self) -> None:
        if self.period_s is not None and not (
            isinstance(self.period_s, int | float) and 0 < self.period_s < math.inf
        ):
            raise ValueError(
                f"period_s (Γ, seconds) must be > 0, or None for period_steps, got {self.period_s!r}"
            )
        for name in ("cycle_periods", "overhead_window", "max_local_steps", "period_steps"):
            if not is_int(getattr(self, name), 1):
                raise ValueError(f"{name} must be an int >= 1, got {getattr(self, name)!r}")
        if self.start_steps is not None and not is_int(self.start_steps, 1):
            raise ValueError(
                f"start_steps must be an int >= 1, or None for one commit per period, "
                f"got {self.start_steps!r}"
            )
        if self.weight is not None and not self.weight > 0:
            raise ValueError(f"weight (γ) must be > 0, or None for 1/N, got {self.weight!r}")
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        if not 0 < self.lr_decay <= 1:
            raise ValueError(f"lr_decay must be in (0, 1], got {self.lr_decay!r}")
        if not 0 < self.reward_window <= 0.5:
            raise ValueError(f"reward_window must be in (0, 0.5], got {self.reward_window!r}")
        self.profiling()  # validates the rest

    def profiling(self) -> ProfilingConfig:
        """The profiling part of the configuration."""
        return prof.profiling_of(self)


@dataclass(frozen=True, slots=True)
class Search:
    """The commit-rate search of one cycle."""

    rate: int = 1  # commits per period of the leader (C_target - max c)
    r_best: float | None = None  # best reward of this cycle (loss decrease per s)
    searching: bool = True
    cycle: int = 0
    period: int = 0  # index within the cycle


def search_step(s: Search, r: float | None, room: bool) -> tuple[Search, str]:
    """A period ended with reward ``r``: the new search and why.

    While searching: no room for one more commit (``Γ/(m+1) <= T1`` somewhere) stops; a better
    reward (or none at all: too few commits to measure [D]) raises the rate by one; a worse one
    reverts the last raise and stops for the rest of the cycle.
    """
    if not s.searching:
        return s, "hold"
    if not room:
        return replace(s, searching=False), "stop: no room"
    if r is None:
        return replace(s, rate=s.rate + 1), "up: no loss data"
    if s.r_best is None or r > s.r_best:
        return replace(s, rate=s.rate + 1, r_best=r), "up"
    return replace(s, rate=max(1, s.rate - 1), searching=False), "revert"


def quotas(commits: Mapping[int, int], rate: int, caps: Mapping[int, int]) -> dict[int, int]:
    """``C_target = max c + rate``; ``m_i = C_target - c_i`` (laggards must commit more often),
    within ``[1, caps[i]]``."""
    target = max(commits.values(), default=0) + rate
    return {w: max(1, min(caps.get(w, target), target - c)) for w, c in commits.items()}


def reward(
    losses: Mapping[int, Sequence[tuple[float, float]]], start: float, period: float, window: float
) -> float | None:
    """``r = mean_i (L_start - L_end) / Γ`` from each worker's ``(t, loss)`` samples of the period
    ``[start, start + period)``: means over its first and last ``window`` fractions, or its first
    and last samples when a window is empty [D]. None when no worker has two samples."""
    rs = []
    end, w = start + period, window * period
    for samples in losses.values():
        if len(samples) < 2:
            continue
        first = [x for t, x in samples if t < start + w]
        last = [x for t, x in samples if t >= end - w]
        a = sum(first) / len(first) if first else samples[0][1]
        b = sum(last) / len(last) if last else samples[-1][1]
        rs.append((a - b) / period)
    return sum(rs) / len(rs) if rs else None


def gamma(cfg: AdspConfig, period: float | None = None) -> float:
    """Γ: ``period`` (the state's, when derived from the cluster) or the configured ``period_s``."""
    g = period if period is not None else cfg.period_s
    if g is None:
        raise ValueError("adsp: Γ is derived from profiles; pass the state's period")
    return g


def auto_period(step_s: Mapping[int, float], t1: Mapping[int, float], cfg: AdspConfig) -> float:
    """Γ when ``period_s`` is None [D]: ``period_steps`` x the slowest worker's step plus commit
    overhead. The reimplementation's 60 s suits VGG16 steps of about a second; tying Γ to the
    cluster keeps the search meaningful for any model (a few dozen slow steps per period)."""
    if cfg.period_s is not None:
        return cfg.period_s
    slowest = max((step_s[w] + t1.get(w, 0.0) for w in step_s), default=1.0)
    return cfg.period_steps * max(slowest, prof.MIN_SAMPLE_S)


def start_rate(
    step_s: Mapping[int, float], t1: Mapping[int, float], cfg: AdspConfig, period: float
) -> int:
    """The search's first rate [D]: the slowest worker's first commit comes after ``start_steps``
    of its rounds (step + commit overhead), not after a whole period ``Γ``; 1 when ``start_steps``
    is None. A period of one commit per worker measures no reward (a worker needs two losses)
    and leaves the model where it was for a whole ``Γ``."""
    if cfg.start_steps is None:
        return 1
    slowest = max((step_s[w] + t1.get(w, 0.0) for w in step_s), default=period)
    return max(1, math.floor(period / (cfg.start_steps * max(slowest, prof.MIN_SAMPLE_S))))


def local_steps(
    quota: int, t1: float, step_s: float, cfg: AdspConfig, period: float | None = None
) -> int:
    """§9 plan: ``floor((Γ/m_i - T1_i) / step_time_i)``, at least 1."""
    budget = gamma(cfg, period) / max(1, quota) - t1
    n = math.floor(budget / max(step_s, prof.MIN_SAMPLE_S))
    return min(cfg.max_local_steps, max(1, n))


def max_quota(t1: float, step_s: float, cfg: AdspConfig, period: float | None = None) -> int:
    """The most commits per period that still leave one local step each [D]."""
    return max(1, math.floor(gamma(cfg, period) / max(t1 + step_s, prof.MIN_SAMPLE_S)))


def _empty() -> Mapping[Any, Any]:
    return freeze({})


@dataclass(frozen=True, slots=True)
class AdspState:
    """Everything ``adsp`` remembers between events."""

    cfg: AdspConfig
    stage: str  # "profile" | "ADSP"
    tracks: Mapping[int, WorkerTrack]  # per active worker: profile and speed
    transitions: tuple[tuple[str, float], ...]  # (stage, s engine clock when entered)
    search: Search = Search()
    # Per member (a profiled worker in the ADSP stage): c_i since the stage began, m_i (commits per
    # period), commits this period, and this period's (s, loss) samples.
    commits: Mapping[int, int] = field(default_factory=_empty)
    quota: Mapping[int, int] = field(default_factory=_empty)
    period_commits: Mapping[int, int] = field(default_factory=_empty)
    losses: Mapping[int, tuple[tuple[float, float], ...]] = field(default_factory=_empty)
    # Per active worker: the last commit overheads (s beyond compute), its last push's arrival (s).
    overhead: Mapping[int, tuple[float, ...]] = field(default_factory=_empty)
    last_push: Mapping[int, float] = field(default_factory=_empty)
    period_start: float = 0.0  # s
    period: float | None = None  # Γ in use (s); set on entering the ADSP stage
    history: tuple[tuple[float, float | None, str], ...] = ()  # (s, reward, action), last few
    fresh: bool = True  # the engine has not heard this policy's stage and plans yet

    def t1(self, w: int) -> float:
        """T1_i: mean commit overhead (s), else the profile's comm estimate."""
        xs = self.overhead.get(w, ())
        if xs:
            return sum(xs) / len(xs)
        p = self.tracks[w].profile if w in self.tracks else None
        return 0.0 if p is None else p.push_s + p.pull_s

    def describe(self) -> dict[str, Any]:
        """Same as :func:`describe_state`."""
        return describe_state(self)

    def shifted(self, dt: float) -> AdspState:
        """The same state with every engine-clock time moved by ``dt`` s (a checkpoint restored
        under another clock: times stay as long before now as they were before the checkpoint)."""
        return replace(
            self,
            tracks=prof.shift_tracks(self.tracks, dt),
            transitions=tuple((stage, t + dt) for stage, t in self.transitions),
            losses=freeze({w: tuple((t + dt, x) for t, x in xs) for w, xs in self.losses.items()}),
            last_push=freeze({w: t + dt for w, t in self.last_push.items()}),
            period_start=self.period_start + dt,
            history=tuple((t + dt, r, action) for t, r, action in self.history),
        )


def _step_s(st: AdspState, w: int, view: ClusterView) -> float:
    p = st.tracks[w].profile
    batch = view.workers[w].batch_size if w in view.workers else 1
    return prof.MIN_SAMPLE_S if p is None else p.step_s(batch)


def describe_state(state: AdspState) -> dict[str, Any]:
    """Stage, search status and every worker's quota, commits and timings, as plain values."""
    s = state.search
    rows = []
    for w in sorted(state.tracks):
        p = state.tracks[w].profile
        m = state.quota.get(w)
        rows.append(
            {
                "worker": w,
                **prof.profile_row(state.tracks[w]),
                "commits": state.commits.get(w, 0),
                "quota": m,
                "period_commits": state.period_commits.get(w, 0),
                "t1_s": state.t1(w),
                "period_s_per_commit": None
                if m is None or state.period is None
                else state.period / m,
                "local_steps_at_batch_1": None
                if m is None or p is None
                else local_steps(m, state.t1(w), p.sample_s, state.cfg, state.period),
            }
        )
    return {
        "policy": "adsp",
        "stage": state.stage,
        "transitions": [{"stage": st, "at": t} for st, t in state.transitions],
        "cycle": s.cycle,
        "period": s.period,
        "period_start": state.period_start,
        "period_s": state.period,
        "searching": s.searching,
        "rate": s.rate,
        "c_target": max(state.commits.values(), default=0) + s.rate,
        "r_best": s.r_best,
        "lr_scale": state.cfg.lr_decay**s.cycle,
        "history": [{"at": t, "reward": r, "action": a} for t, r, a in state.history],
        "workers": rows,
    }


@register("adsp")
def adsp(
    *,
    period_s: float | None = None,
    period_steps: int = 20,
    start_steps: int | None = 2,
    cycle_periods: int = 20,
    weight: float | None = None,
    mode: str = "steps",
    lr_decay: float = 0.9,
    reward_window: float = 0.1,
    overhead_window: int = 10,
    max_local_steps: int = 10_000,
    profile_pushes: int = 5,
    trim: float = 0.2,
    comm_factor: float = 1.0,
    drift: float = 0.3,
    drift_patience: int = 3,
    alpha: float = 0.5,
) -> Policy:
    """ADSP: no barriers; every worker commits about ``m`` times per period ``Γ`` with as many local
    steps as fit; the common rate is searched online. The parameters (units, defaults' sources)
    are :class:`AdspConfig`'s."""
    cfg = AdspConfig(
        period_s=period_s,
        period_steps=period_steps,
        start_steps=start_steps,
        cycle_periods=cycle_periods,
        weight=weight,
        mode=mode,
        lr_decay=lr_decay,
        reward_window=reward_window,
        overhead_window=overhead_window,
        max_local_steps=max_local_steps,
        profile_pushes=profile_pushes,
        trim=trim,
        comm_factor=comm_factor,
        drift=drift,
        drift_patience=drift_patience,
        alpha=alpha,
    )
    pcfg = cfg.profiling()

    def init(view: ClusterView) -> AdspState:
        return AdspState(cfg, PROFILE, prof.init_tracks(view, pcfg), ((PROFILE, view.now),))

    def new_quotas(st: AdspState, view: ClusterView) -> Mapping[int, int]:
        caps = {w: max_quota(st.t1(w), _step_s(st, w, view), cfg, st.period) for w in st.commits}
        return freeze(quotas(st.commits, st.search.rate, caps))

    def plans(st: AdspState, view: ClusterView) -> list[Decision]:
        out: list[Decision] = []
        for w in sorted(view.workers):
            m = st.quota.get(w)
            if m is None:
                out.append(SetPlan(w, PROFILE_FIELDS))
                continue
            t1, g = st.t1(w), gamma(cfg, st.period)
            fields: dict[str, Any] = {
                "local_steps": local_steps(m, t1, _step_s(st, w, view), cfg, g),
                "lr_scale": cfg.lr_decay**st.search.cycle,
                "commit_quota": m,
                "period_s": g,
                "push_kind": "delta",  # a commit is accumulated local steps, even just one
            }
            if cfg.mode == "time":
                fields["local_time_s"] = max(0.0, g / m - t1)
            out.append(SetPlan(w, fields))
        return out

    def end_period(st: AdspState, view: ClusterView) -> AdspState:
        now, g = view.now, gamma(cfg, st.period)
        start = st.period_start + g * math.floor((now - st.period_start) / g)
        if not st.commits:  # nobody to measure: the search waits
            return replace(st, period_start=start, losses=freeze({}))
        r = reward(st.losses, st.period_start, g, cfg.reward_window)
        room = all(g / (m + 1) > st.t1(w) for w, m in st.quota.items())
        search, action = search_step(st.search, r, room)
        search = replace(search, period=search.period + 1)
        if search.period >= cfg.cycle_periods:  # a new cycle searches again from this rate [D]
            search = Search(search.rate, None, True, search.cycle + 1, 0)
            action += "; new cycle"
            st = replace(st, period=_period(st, view))
        st = replace(st, search=search)
        return replace(
            st,
            quota=new_quotas(st, view),
            period_commits=freeze(dict.fromkeys(st.commits, 0)),
            losses=freeze({}),
            period_start=start,
            history=(*st.history, (now, r, action))[-_KEEP:],
        )

    def update(
        event: Event, state: AdspState, view: ClusterView
    ) -> tuple[Sequence[Decision], AdspState]:
        tracks, ch = prof.track(state.tracks, event, view, pcfg)
        st = replace(state, tracks=tracks)
        if ch.left:
            st = _forget(st, view)
        out: list[Decision] = [] if st.fresh else [SetPlan(w, PROFILE_FIELDS) for w in ch.joined]
        replan = ch.replan
        if st.stage == TRAIN and event.now >= st.period_start + gamma(cfg, st.period):
            st, replan = end_period(st, view), True
        head: list[Decision] = []
        if isinstance(event, Push) and event.worker in view.workers:
            head.append(Apply(cfg.weight or 1.0 / max(1, view.n)))
            st = _record(st, event, cfg)
        if st.stage == PROFILE:
            if view.workers and all(t.profile is not None for t in st.tracks.values()):
                st = replace(
                    st,
                    stage=TRAIN,
                    transitions=(*st.transitions, (TRAIN, event.now)),
                    commits=freeze(dict.fromkeys(view.workers, 0)),
                )
                st = replace(st, period=_period(st, view))
                st = replace(st, search=Search(rate=_start_rate(st, view)))
                st = replace(
                    st,
                    quota=new_quotas(st, view),
                    period_commits=freeze(dict.fromkeys(view.workers, 0)),
                    losses=freeze({}),
                    period_start=event.now,
                    fresh=False,
                )
                out += [SetStage(TRAIN), *plans(st, view)]
        elif ch.profiled:  # newcomers join at the current rate, level with the leader
            lead = max(st.commits.values(), default=0)
            new = [w for w in ch.profiled if w not in st.commits]
            st = replace(st, commits=freeze({**st.commits, **dict.fromkeys(new, lead)}))
            fresh = {w: m for w, m in new_quotas(st, view).items() if w in new}
            st = replace(st, quota=freeze({**st.quota, **fresh}))
        if replan and st.stage == TRAIN:
            out += plans(st, view)
        if st.fresh:
            out = [SetStage(st.stage), *plans(st, view), *out]
            st = replace(st, fresh=False)
        return [*head, *out, *release_waiting(view, lambda f: True)], st

    return Policy("adsp", init, update, asdict(cfg))


def _period(st: AdspState, view: ClusterView) -> float:
    """Γ for the members' current profiles (:func:`auto_period`)."""
    members = [w for w in st.commits if w in st.tracks]
    steps = {w: _step_s(st, w, view) for w in members}
    return auto_period(steps, {w: st.t1(w) for w in members}, st.cfg)


def _start_rate(st: AdspState, view: ClusterView) -> int:
    """:func:`start_rate` for the members' current profiles and the state's Γ."""
    members = [w for w in st.commits if w in st.tracks]
    steps = {w: _step_s(st, w, view) for w in members}
    return start_rate(steps, {w: st.t1(w) for w in members}, st.cfg, gamma(st.cfg, st.period))


def _forget(st: AdspState, view: ClusterView) -> AdspState:
    """Drop the per-worker records of workers that left."""

    def keep(m: Mapping[int, Any]) -> Mapping[int, Any]:
        return freeze({w: v for w, v in m.items() if w in view.workers})

    return replace(
        st,
        commits=keep(st.commits),
        quota=keep(st.quota),
        period_commits=keep(st.period_commits),
        overhead=keep(st.overhead),
        last_push=keep(st.last_push),
        losses=keep(st.losses),
    )


def _record(st: AdspState, p: Push, cfg: AdspConfig) -> AdspState:
    """A push: its commit overhead, and (for members in the ADSP stage) a commit and a loss."""
    w = p.worker
    prev = st.last_push.get(w)
    over = st.overhead
    if prev is not None:
        x = max(0.0, p.now - prev - p.compute_s)
        over = freeze({**over, w: (*over.get(w, ()), x)[-cfg.overhead_window :]})
    st = replace(st, overhead=over, last_push=freeze({**st.last_push, w: p.now}))
    if st.stage != TRAIN or w not in st.quota:
        return st
    losses = st.losses
    if p.loss is not None and math.isfinite(p.loss):
        losses = freeze({**losses, w: (*losses.get(w, ()), (p.now, p.loss))})
    return replace(
        st,
        commits=freeze({**st.commits, w: st.commits.get(w, 0) + 1}),
        period_commits=freeze({**st.period_commits, w: st.period_commits.get(w, 0) + 1}),
        losses=losses,
    )
