"""ASHL (Shen et al., IEEE TC 73(1), 2024; docs/policies.md): profile -> AHL -> SHL, re-planned.

Owns the ``ashl`` policy: the planner (H, p, rho from profiles, :func:`plan_workers`), the stage
switch (:func:`switch_reason`), the per-stage worker learning-rate schedule (:func:`lr_scale`), the
SSP gate over SHL commits, and :func:`describe_state` for status pages.

Stages, announced with ``SetStage``:

* ``profile`` — every worker runs ASP-style pushes (one step, uncompressed) until it has a profile
  (``policies.profiling``); when all active workers have one, the planner runs.
* ``AHL`` — asynchronous: ``Hc_i`` local steps, uncompressed deltas applied with weight ``p_i``,
  data share ``p_i``; never held.
* ``SHL`` — ``Hf_i`` local steps, top-k deltas with keep ratio ``rho_i``, weight ``p_i``; a worker
  may start its next commit only while it is at most ``staleness`` SHL commits ahead of the slowest.

Beyond the paper (which plans once): a join profiles the newcomer alone (ASP-style, never held) and
then re-plans everyone; a leave or a speed drift (``profiling.drift_detected``) re-plans at once.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

from policies import profiling as prof
from policies.compose import release_waiting
from policies.profiling import Profile, ProfilingConfig, WorkerTrack, freeze, is_int
from policies.registry import register
from policies.types import (
    Apply,
    ClusterView,
    Decision,
    Eval,
    Event,
    Policy,
    Push,
    SetPlan,
    SetStage,
)

PROFILE, AHL, SHL = "profile", "AHL", "SHL"
PROFILE_FIELDS: Mapping[str, Any] = freeze(
    {"local_steps": 1, "codec": "none", "topk": 1.0, "lr_scale": 1.0}
)
_KEEP = 16  # re-plan records kept in the state


@dataclass(frozen=True, slots=True)
class AshlConfig:
    """``ashl`` parameters; defaults from §10 (authors' code) unless marked [D]."""

    profile_pushes: int = 5  # pushes per worker in the profile stage [D: the code runs 10 epochs]
    trim: float = 0.2  # fraction of profile samples dropped at each end
    comm_factor: float = 1.0  # multiplies u_i, d_i (the code uses 6, undocumented) [D]
    k_coarse: int = 8  # k_c: the slowest worker's local steps in AHL
    # [D] Local steps pay for communication: k_c shrinks with the profiled communication time per
    # step, k_c * min(1, max_i (u_i + d_i) / c_i / comm_ref), at least 1. With communication as long
    # as a step or longer (the paper's setting) this is the paper's k_c; on a fast link it avoids
    # local SGD's statistical cost for nothing. None: k_c as configured.
    comm_ref: float | None = 1.0
    k_fine: int = 2  # k_f: the slowest worker's local steps in SHL
    topk: float = 0.25  # rho: the slowest worker's SHL keep ratio [D: the code's default is 1.0]
    max_local_steps: int = 10_000  # guard on H [D]
    staleness: int = 3  # SHL gate: commits ahead of the slowest
    switch_loss: float | None = 0.3  # AHL -> SHL when the evaluated loss falls below this
    plateau_evals: int = 3  # ... or when these many evaluations improve by less than
    plateau_tol: float = 0.01  # this (relative) [D]
    profile_weight: float | None = None  # lambda of profiling pushes; None: 1/N (ASP)
    ahl_lr_scale: float = 1.0  # worker lr scale in AHL (code: 0.1)
    shl_lr_scale: float = 3.0  # worker lr scale on entering SHL (code: lr2 = 0.3 = 3 x 0.1)
    warmup: int = (
        1  # AHL linear warm-up, scheduler steps [D: the code warms VGG16 up over 5; 1 = none]
    )
    lr_every: int = 6  # commits per scheduler step
    ahl_cosine: int = 200  # AHL cosine horizon in scheduler steps (code: n_epochs)
    shl_rounds: int = 800  # SHL cosine horizon in commits, and the round limit of the stop test
    lr_floor: float = 0.05  # the schedule never goes below this fraction of its start [D]
    stop_loss: float = 0.01  # stop (reported only) after ``stop_evals`` evaluations below this
    stop_evals: int = 10
    drift: float = 0.3  # re-plan when a worker's speed moves by more than this [D]
    drift_patience: int = 3  # ... for the median of this many pushes as well [D]
    alpha: float = 0.5  # EWMA weight of the speed tracker

    def __post_init__(self) -> None:
        ints = "k_coarse k_fine max_local_steps warmup lr_every ahl_cosine shl_rounds stop_evals"
        for name in ints.split():
            if not is_int(getattr(self, name), 1):
                raise ValueError(f"{name} must be an int >= 1, got {getattr(self, name)!r}")
        if not is_int(self.staleness, 0):
            raise ValueError(f"staleness must be an int >= 0, got {self.staleness!r}")
        if not is_int(self.plateau_evals, 2):
            raise ValueError(f"plateau_evals must be an int >= 2, got {self.plateau_evals!r}")
        if not 0.0 < self.topk <= 1.0:
            raise ValueError(f"topk must be in (0, 1] (the kept fraction), got {self.topk!r}")
        for name in ("plateau_tol", "ahl_lr_scale", "shl_lr_scale", "lr_floor", "stop_loss"):
            v = getattr(self, name)
            if not (isinstance(v, int | float) and math.isfinite(v) and v >= 0):
                raise ValueError(f"{name} must be a finite number >= 0, got {v!r}")
        if self.comm_ref is not None and not (
            isinstance(self.comm_ref, int | float)
            and math.isfinite(self.comm_ref)
            and self.comm_ref > 0
        ):
            raise ValueError(f"comm_ref must be a finite number > 0 or None, got {self.comm_ref!r}")
        if self.switch_loss is not None and not math.isfinite(self.switch_loss):
            raise ValueError(f"switch_loss must be finite or None, got {self.switch_loss!r}")
        if self.profile_weight is not None and not self.profile_weight > 0:
            raise ValueError(
                f"profile_weight must be > 0 or None (1/N), got {self.profile_weight!r}"
            )
        self.profiling()  # validates the rest

    def profiling(self) -> ProfilingConfig:
        """The profiling part of the configuration."""
        return prof.profiling_of(self)


@dataclass(frozen=True, slots=True)
class WorkerPlan:
    """The planner's output for one worker."""

    hc: int  # local steps per commit in AHL
    hf: int  # local steps per commit in SHL
    share: float  # p_i: fraction of the training set, and the aggregation weight
    rho: float  # SHL top-k keep ratio
    offset: float  # where its data range starts in [0, 1) (workers in id order)


def coarse_steps(c: Mapping[int, float], full: Mapping[int, float], cfg: AshlConfig) -> int:
    """AHL's ``k_c`` after the [D] communication scaling (see :class:`AshlConfig`)."""
    if cfg.comm_ref is None:
        return cfg.k_coarse
    ratio = max((full[w] / c[w] if c[w] > 0 else math.inf) for w in c)
    return max(1, min(cfg.k_coarse, round(cfg.k_coarse * ratio / cfg.comm_ref)))


def plan_workers(
    profiles: Mapping[int, Profile], batches: Mapping[int, int], cfg: AshlConfig
) -> Mapping[int, WorkerPlan]:
    """§10 ``get_h``: every worker's (compute + comm) per round equals the slowest's with k steps.

    ``c_i`` is the per-step time (``sample_s * batch``); ``full = u + d``; ``cmp = rho*u + d + z``;
    ``H = round((P - comm_i) / c_i)`` with ``P = max_j (k c_j + comm_j)``; ``p_i = Hf_i / sum Hf``;
    ``rho_i = (T* - c_i Hf_i - d_i - z_i) / u_i`` with ``T* = max_j (c_j Hf_j + cmp_j)``, clipped to
    ``[rho, 1]`` (1 when ``u_i = 0``: sending is free). Guard: ``1 <= H <= max_local_steps``.
    """
    if not profiles:
        return freeze({})
    ws = sorted(profiles)
    c = {w: profiles[w].step_s(batches.get(w, 1)) for w in ws}
    u = {w: profiles[w].push_s for w in ws}
    d = {w: profiles[w].pull_s for w in ws}
    z = {w: profiles[w].compress_s for w in ws}
    full = {w: u[w] + d[w] for w in ws}
    cmp = {w: cfg.topk * u[w] + d[w] + z[w] for w in ws}

    def h(k: int, comm: Mapping[int, float]) -> dict[int, int]:
        p = max(k * c[w] + comm[w] for w in ws)
        return {w: min(cfg.max_local_steps, max(1, round((p - comm[w]) / c[w]))) for w in ws}

    hc, hf = h(coarse_steps(c, full, cfg), full), h(cfg.k_fine, cmp)
    total = sum(hf.values())
    t_star = max(c[w] * hf[w] + cmp[w] for w in ws)
    out: dict[int, WorkerPlan] = {}
    offset = 0.0
    for w in ws:
        rho = 1.0 if u[w] <= 0 else (t_star - c[w] * hf[w] - d[w] - z[w]) / u[w]
        share = hf[w] / total
        out[w] = WorkerPlan(hc[w], hf[w], share, min(1.0, max(cfg.topk, rho)), offset)
        offset += share
    return freeze(out)


def _cosine(progress: float, floor: float) -> float:
    p = min(1.0, max(0.0, progress))
    return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * p))


def lr_scale(stage: str, commits: int, cfg: AshlConfig) -> float:
    """The worker's lr scale after ``commits`` commits in ``stage`` (stepped every ``lr_every``).

    AHL: linear warm-up over ``warmup`` scheduler steps, then cosine over ``ahl_cosine`` steps.
    SHL: restart at ``shl_lr_scale``, cosine to ``lr_floor`` over ``shl_rounds`` commits.
    """
    s = commits // cfg.lr_every
    if stage == AHL:
        if s < cfg.warmup:
            return cfg.ahl_lr_scale * (s + 1) / cfg.warmup
        span = max(1, cfg.ahl_cosine - cfg.warmup)
        return cfg.ahl_lr_scale * _cosine((s - cfg.warmup) / span, cfg.lr_floor)
    if stage == SHL:
        return cfg.shl_lr_scale * _cosine(s * cfg.lr_every / cfg.shl_rounds, cfg.lr_floor)
    return 1.0


def switch_reason(losses: Sequence[float], cfg: AshlConfig) -> str | None:
    """Why AHL should end after these evaluated losses (oldest first): ``"threshold"`` when the last
    is below ``switch_loss``; ``"plateau"`` when, over the last ``plateau_evals`` evaluations, the
    best later loss improved on the oldest by less than ``plateau_tol`` (relative) [D]."""
    if not losses:
        return None
    if cfg.switch_loss is not None and losses[-1] < cfg.switch_loss:
        return "threshold"
    window = losses[-cfg.plateau_evals :]
    if len(window) == cfg.plateau_evals:
        ref = window[0]
        if (ref - min(window[1:])) / max(abs(ref), 1e-12) < cfg.plateau_tol:
            return "plateau"
    return None


@dataclass(frozen=True, slots=True)
class AshlState:
    """Everything ``ashl`` remembers between events."""

    cfg: AshlConfig  # the parameters (for describe_state)
    stage: str  # "profile" | "AHL" | "SHL"
    tracks: Mapping[int, WorkerTrack]  # per active worker: profile and speed
    plans: Mapping[int, WorkerPlan]  # planned workers (profiled, after the profile stage)
    commits: Mapping[int, int]  # commits in the current stage per planned worker (SHL: the clock)
    transitions: tuple[tuple[str, float], ...]  # (stage, s engine clock when entered)
    replans: tuple[tuple[float, str], ...] = ()  # (s, reason), the last few
    losses: tuple[float, ...] = ()  # AHL evaluations, the last ``plateau_evals``
    switch: str | None = None  # why AHL ended
    low_evals: int = 0  # consecutive SHL evaluations below ``stop_loss``
    stop: str | None = None  # "loss" | "rounds": the paper's stop test fired (reported only)
    fresh: bool = True  # the engine has not heard this policy's stage and plans yet

    def describe(self) -> dict[str, Any]:
        """Same as :func:`describe_state`."""
        return describe_state(self)

    def shifted(self, dt: float) -> AshlState:
        """The same state with every engine-clock time moved by ``dt`` s (a checkpoint restored
        under another clock: times stay as long before now as they were before the checkpoint)."""
        return replace(
            self,
            tracks=prof.shift_tracks(self.tracks, dt),
            transitions=tuple((stage, t + dt) for stage, t in self.transitions),
            replans=tuple((t + dt, why) for t, why in self.replans),
        )


def describe_state(state: AshlState) -> dict[str, Any]:
    """Stage, transition times, re-plans and every worker's H, rho and share, as plain values."""
    rows = []
    for w in sorted(state.tracks):
        wp = state.plans.get(w)
        n = state.commits.get(w, 0)
        rows.append(
            {
                "worker": w,
                **prof.profile_row(state.tracks[w]),
                "H": None if wp is None else (wp.hf if state.stage == SHL else wp.hc),
                "Hc": None if wp is None else wp.hc,
                "Hf": None if wp is None else wp.hf,
                "rho": None if wp is None else wp.rho,
                "share": None if wp is None else wp.share,
                "commits": n,
                "lr_scale": None if wp is None else lr_scale(state.stage, n, state.cfg),
            }
        )
    return {
        "policy": "ashl",
        "stage": state.stage,
        "transitions": [{"stage": s, "at": t} for s, t in state.transitions],
        "switch_reason": state.switch,
        "replans": [{"at": t, "reason": r} for t, r in state.replans],
        "recent_losses": list(state.losses),
        "stop": state.stop,
        "workers": rows,
    }


def _fields(stage: str, wp: WorkerPlan, commits: int, cfg: AshlConfig) -> dict[str, Any]:
    """The plan fields (:class:`~policies.types.Plan`'s) of a planned worker in ``stage``."""
    shl = stage == SHL
    return {
        "local_steps": wp.hf if shl else wp.hc,
        # A keep ratio of 1 is a dense push: send it plainly (top-k would add the indices) [D].
        "codec": "topk" if shl and wp.rho < 1.0 else "none",
        "topk": wp.rho if shl else 1.0,
        "lr_scale": lr_scale(stage, commits, cfg),
        "data_share": wp.share,
        "data_offset": wp.offset,
        "staleness_bound": cfg.staleness if shl else None,
        "push_kind": "delta",  # local SGD even when H = 1: the PS applies w + p_i * delta
    }


@register("ashl")
def ashl(
    *,
    profile_pushes: int = 5,
    trim: float = 0.2,
    comm_factor: float = 1.0,
    k_coarse: int = 8,
    comm_ref: float | None = 1.0,
    k_fine: int = 2,
    topk: float = 0.25,
    max_local_steps: int = 10_000,
    staleness: int = 3,
    switch_loss: float | None = 0.3,
    plateau_evals: int = 3,
    plateau_tol: float = 0.01,
    profile_weight: float | None = None,
    ahl_lr_scale: float = 1.0,
    shl_lr_scale: float = 3.0,
    warmup: int = 1,
    lr_every: int = 6,
    ahl_cosine: int = 200,
    shl_rounds: int = 800,
    lr_floor: float = 0.05,
    stop_loss: float = 0.01,
    stop_evals: int = 10,
    drift: float = 0.3,
    drift_patience: int = 3,
    alpha: float = 0.5,
) -> Policy:
    """ASHL: profile, then asynchronous coarse local SGD (AHL), then bounded-staleness fine local
    SGD with per-worker top-k (SHL). The parameters (units, defaults' sources) are
    :class:`AshlConfig`'s."""
    cfg = AshlConfig(
        profile_pushes=profile_pushes,
        trim=trim,
        comm_factor=comm_factor,
        k_coarse=k_coarse,
        comm_ref=comm_ref,
        k_fine=k_fine,
        topk=topk,
        max_local_steps=max_local_steps,
        staleness=staleness,
        switch_loss=switch_loss,
        plateau_evals=plateau_evals,
        plateau_tol=plateau_tol,
        profile_weight=profile_weight,
        ahl_lr_scale=ahl_lr_scale,
        shl_lr_scale=shl_lr_scale,
        warmup=warmup,
        lr_every=lr_every,
        ahl_cosine=ahl_cosine,
        shl_rounds=shl_rounds,
        lr_floor=lr_floor,
        stop_loss=stop_loss,
        stop_evals=stop_evals,
        drift=drift,
        drift_patience=drift_patience,
        alpha=alpha,
    )
    pcfg = cfg.profiling()

    def init(view: ClusterView) -> AshlState:
        tracks = prof.init_tracks(view, pcfg)
        return AshlState(cfg, PROFILE, tracks, freeze({}), freeze({}), ((PROFILE, view.now),))

    def plan_all(st: AshlState, view: ClusterView) -> list[Decision]:
        out: list[Decision] = []
        for w in sorted(view.workers):
            wp = st.plans.get(w)
            fields = PROFILE_FIELDS if wp is None else _fields(st.stage, wp, st.commits[w], cfg)
            out.append(SetPlan(w, fields))
        return out

    def replan(st: AshlState, view: ClusterView, reason: str) -> AshlState:
        profiles = {w: t.profile for w, t in st.tracks.items() if t.profile is not None}
        batches = {w: view.workers[w].batch_size for w in profiles}
        plans = plan_workers(profiles, batches, cfg)
        old = {w: n for w, n in st.commits.items() if w in plans}
        start = min(old.values(), default=0)  # a newcomer starts level with the slowest
        commits = {w: old.get(w, start) for w in plans}
        replans = (*st.replans, (view.now, reason))[-_KEEP:]
        return replace(st, plans=plans, commits=freeze(commits), replans=replans)

    def enter(st: AshlState, stage: str, now: float) -> AshlState:
        transitions = (*st.transitions, (stage, now))
        commits = freeze(dict.fromkeys(st.plans, 0))
        return replace(st, stage=stage, transitions=transitions, commits=commits)

    def update(
        event: Event, state: AshlState, view: ClusterView
    ) -> tuple[Sequence[Decision], AshlState]:
        tracks, ch = prof.track(state.tracks, event, view, pcfg)
        st = replace(state, tracks=tracks)
        head: list[Decision] = []
        # A fresh state announces every plan below; otherwise newcomers get a profiling plan.
        out: list[Decision] = [] if st.fresh else [SetPlan(w, PROFILE_FIELDS) for w in ch.joined]
        if isinstance(event, Push) and event.worker in view.workers:
            wp = st.plans.get(event.worker)
            if st.stage == PROFILE or wp is None:
                head.append(Apply(cfg.profile_weight or 1.0 / max(1, view.n)))
            else:
                head.append(Apply(wp.share))
                n = st.commits.get(event.worker, 0)
                st = replace(st, commits=freeze({**st.commits, event.worker: n + 1}))
                lr = lr_scale(st.stage, n + 1, cfg)
                if lr != lr_scale(st.stage, n, cfg):
                    out.append(SetPlan(event.worker, {"lr_scale": lr}))
        if st.stage == PROFILE:
            if view.workers and all(t.profile is not None for t in st.tracks.values()):
                st = enter(replan(st, view, "profile done"), AHL, event.now)
                out += [SetStage(AHL), *plan_all(st, view)]
                st = replace(st, fresh=False)
        elif ch.replan:
            st = replan(st, view, ch.reason())
            out += plan_all(st, view)
        if isinstance(event, Eval) and math.isfinite(event.loss):
            if st.stage == AHL:
                st = replace(st, losses=(*st.losses, event.loss)[-cfg.plateau_evals :])
                why = switch_reason(st.losses, cfg)
                if why is not None:
                    st = replace(enter(st, SHL, event.now), switch=why)
                    out += [SetStage(SHL), *plan_all(st, view)]
            elif st.stage == SHL and st.stop is None:
                low = st.low_evals + 1 if event.loss < cfg.stop_loss else 0
                rounds = min(st.commits.values(), default=0)
                stop = "loss" if low >= cfg.stop_evals else None
                stop = stop or ("rounds" if rounds >= cfg.shl_rounds else None)
                st = replace(st, low_evals=low, stop=stop)
        if st.fresh:  # the first event after init: tell the engine the stage and every plan
            out = [SetStage(st.stage), *plan_all(st, view), *out]
            st = replace(st, fresh=False)
        return [*head, *out, *_gate(st, view, cfg)], st

    return Policy("ashl", init, update, asdict(cfg), reads_evals=True)


def _gate(st: AshlState, view: ClusterView, cfg: AshlConfig) -> list[Decision]:
    """Release rule: always, except SHL's bound on planned workers' SHL commits (the SSP rule of
    ``sync.ssp_gate`` with the stage's commits as clocks). Workers being profiled never wait."""
    if st.stage != SHL:
        return list(release_waiting(view, lambda f: True))
    clocks = {w: n for w, n in st.commits.items() if w in view.workers}
    lo = min(clocks.values(), default=0)
    return list(release_waiting(view, lambda f: clocks.get(f.worker, lo) - lo <= cfg.staleness))
