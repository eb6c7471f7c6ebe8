"""ASHL as tables: the planner's H, p and rho by hand (§10), the lr schedule, the stage switch on
scripted losses, the SHL gate, re-planning on join/leave/drift, and a scripted three-worker run
through every stage with a tiny engine that applies Release and SetPlan decisions.

The engine's contract these follow: on a Push the pusher's clock already counts it and it is
waiting; on a Leave the leaver is already gone from the view; SetPlan merges fields into the
worker's plan; SetStage changes the stage of every plan.
"""

from __future__ import annotations

import dataclasses
import heapq
import inspect
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from policies import PolicyError, make_policy
from policies.ashl import (
    AHL,
    PROFILE,
    PROFILE_FIELDS,
    SHL,
    AshlConfig,
    AshlState,
    ashl,
    describe_state,
    lr_scale,
    plan_workers,
    switch_reason,
)
from policies.compose import resolve
from policies.profiling import Profile
from policies.types import (
    Apply,
    Buffer,
    ClusterView,
    Decision,
    Drop,
    Eval,
    Event,
    Join,
    Leave,
    Policy,
    Push,
    Release,
    SetPlan,
    SetStage,
    Tick,
    WorkerFacts,
)

# --- the planner -------------------------------------------------------------------------------------


def ashl_fixed(params: dict[str, Any] | None = None) -> Policy:
    """ASHL with the paper's fixed k_c (no communication scaling), so the stage tests below do not
    depend on the [D] rule, which has its own test."""
    return make_policy("ashl", {"comm_ref": None, **(params or {})})


P = Profile  # Profile(sample_s, push_s, pull_s, compress_s)

# (label, profiles, batches, config, Hc, Hf, p, rho) — worked by hand from §10's formulas.
PLANNER = [
    (
        "no comm, speeds 1:2:4: H proportional to speed, rho 1",
        {1: P(4.0), 2: P(2.0), 3: P(1.0)},
        {1: 1, 2: 1, 3: 1},
        {},
        (8, 16, 32),
        (2, 4, 8),
        (2 / 14, 4 / 14, 8 / 14),
        (1.0, 1.0, 1.0),
    ),
    (
        # c=(1,.5) u=(1,.5) d=(.5,.1) z=(.1,0) rho=.25: full=(1.5,.6) cmp=(.85,.225)
        # P_c=max(9.5,4.6)=9.5 -> Hc=(8, round(17.8)=18); P_f=max(2.85,1.225)=2.85 -> Hf=(2,
        # round(5.25)=5); T*=max(2.85,2.725)=2.85 -> rho=((2.85-2-.5-.1)/1, (2.85-2.5-.1)/.5)
        "with comm: the slowest keeps rho, the other sends more",
        {1: P(1.0, 1.0, 0.5, 0.1), 2: P(0.5, 0.5, 0.1, 0.0)},
        {1: 1, 2: 1},
        {"topk": 0.25},
        (8, 18),
        (2, 5),
        (2 / 7, 5 / 7),
        (0.25, 0.5),
    ),
    (
        # same but u_2=.2: rho_2=(2.85-2.5-.1)/.2=1.25 -> clipped to 1
        "slack beyond a full push is clipped to 1",
        {1: P(1.0, 1.0, 0.5, 0.1), 2: P(0.5, 0.2, 0.1, 0.0)},
        {1: 1, 2: 1},
        {"topk": 0.25},
        (8, 18),
        (2, 5),
        (2 / 7, 5 / 7),
        (0.25, 1.0),
    ),
    (
        "per-step time is sample time x batch",
        {1: P(0.01), 2: P(0.02)},
        {1: 100, 2: 25},  # c = (1.0, 0.5)
        {},
        (8, 16),
        (2, 4),
        (1 / 3, 2 / 3),
        (1.0, 1.0),
    ),
    (
        "one worker: k steps, share 1, keeps rho",
        {7: P(0.3, 0.1, 0.1, 0.0)},
        {7: 1},
        {"topk": 0.1, "k_coarse": 5, "k_fine": 3},
        (5,),
        (3,),
        (1.0,),
        (0.1,),
    ),
    (
        "the guard caps H",
        {1: P(1.0), 2: P(0.01)},
        {1: 1, 2: 1},
        {"max_local_steps": 10},
        (8, 10),
        (2, 10),
        (2 / 12, 10 / 12),
        (1.0, 1.0),
    ),
]


@pytest.mark.parametrize(
    ("profiles", "batches", "params", "hc", "hf", "share", "rho"),
    [r[1:] for r in PLANNER],
    ids=[r[0] for r in PLANNER],
)
def test_planner(
    profiles: dict[int, Profile],
    batches: dict[int, int],
    params: dict[str, Any],
    hc: tuple[int, ...],
    hf: tuple[int, ...],
    share: tuple[float, ...],
    rho: tuple[float, ...],
) -> None:
    plans = plan_workers(profiles, batches, AshlConfig(**{"comm_ref": None, **params}))
    ws = sorted(profiles)
    assert tuple(plans[w].hc for w in ws) == hc
    assert tuple(plans[w].hf for w in ws) == hf
    assert tuple(plans[w].share for w in ws) == pytest.approx(share)
    assert tuple(plans[w].rho for w in ws) == pytest.approx(rho)
    offsets = [sum(share[:i]) for i in range(len(ws))]
    assert [plans[w].offset for w in ws] == pytest.approx(offsets)


@pytest.mark.parametrize(
    ("comm_s", "k_c"),
    [(0.0, 1), (0.002, 2), (0.005, 4), (0.01, 8), (0.05, 8)],  # per step of 0.01 s
)
def test_coarse_steps_shrink_with_cheap_communication(comm_s: float, k_c: int) -> None:
    """k_c = 8 where a push + pull takes a step or more (the paper's setting); fewer local steps
    where communication is cheap, down to 1 (plain asynchronous SGD) when it is free."""
    profiles = {1: P(0.01, comm_s / 2, comm_s / 2), 2: P(0.04, comm_s / 2, comm_s / 2)}
    plans = plan_workers(profiles, {1: 1, 2: 1}, AshlConfig())
    assert plans[2].hc == k_c  # the slowest worker does k_c steps
    assert plans[1].hc == pytest.approx(4 * k_c, abs=1)  # 4x faster: about 4x the steps
    assert plan_workers(profiles, {1: 1, 2: 1}, AshlConfig(comm_ref=None))[2].hc == 8


# --- lr schedule and the switch ----------------------------------------------------------------------

LR = [
    ("AHL warm-up starts at 1/5", AHL, 0, {"warmup": 5}, 0.2),
    ("steps every 6 commits", AHL, 5, {"warmup": 5}, 0.2),
    ("second step", AHL, 6, {"warmup": 5}, 0.4),
    ("warm-up done", AHL, 24, {"warmup": 5}, 1.0),
    ("no warm-up by default", AHL, 0, {}, 1.0),
    ("cosine starts at the top", AHL, 30, {"warmup": 5}, 1.0),
    (
        "cosine midway",
        AHL,
        105,
        {"lr_every": 1, "ahl_cosine": 205, "lr_floor": 0.0, "warmup": 5},
        0.5,
    ),
    ("cosine end is the floor", AHL, 10**6, {"lr_floor": 0.05}, 0.05),
    ("SHL restarts at lr2", SHL, 0, {}, 3.0),
    ("SHL cosine midway", SHL, 50, {"lr_every": 1, "shl_rounds": 100, "lr_floor": 0.0}, 1.5),
    ("SHL end is the floor", SHL, 100, {"lr_every": 1, "shl_rounds": 100}, 0.15),
    ("profile stage: 1", PROFILE, 3, {}, 1.0),
]


@pytest.mark.parametrize(
    ("stage", "commits", "params", "want"), [r[1:] for r in LR], ids=[r[0] for r in LR]
)
def test_lr_scale(stage: str, commits: int, params: dict[str, Any], want: float) -> None:
    assert lr_scale(stage, commits, AshlConfig(**params)) == pytest.approx(want)


SWITCH = [
    ("below the threshold", [0.5, 0.29], {}, "threshold"),
    ("plateau: 0.7 % over 3 evaluations", [1.0, 0.995, 0.993], {}, "plateau"),
    ("plateau: no progress at all", [1.0, 1.1, 1.05], {}, "plateau"),
    ("still improving 3 %", [1.0, 0.98, 0.97], {}, None),
    ("noisy but 1.5 % better", [1.0, 1.02, 0.985], {}, None),
    ("too few evaluations", [1.0, 1.0], {}, None),
    ("threshold off", [0.2, 0.1, 0.05], {"switch_loss": None}, None),
    ("only the last 3 count", [5.0, 1.0, 0.999, 0.998], {}, "plateau"),
]


@pytest.mark.parametrize(
    ("losses", "params", "want"), [r[1:] for r in SWITCH], ids=[r[0] for r in SWITCH]
)
def test_switch_reason(losses: list[float], params: dict[str, Any], want: str | None) -> None:
    assert switch_reason(losses, AshlConfig(**params)) == want


# --- a cluster by hand ---------------------------------------------------------------------------------


class Cluster:
    """Facts and a policy state, changed the way the engine changes them."""

    def __init__(self, policy: Policy, link: tuple[float, float] | None = None) -> None:
        self.policy = policy
        self.facts: dict[int, WorkerFacts] = {}
        self.link = link  # (push_bytes, link_bps)
        self.now = 0.0
        self.state: Any = policy.init(self.view())

    def view(self) -> ClusterView:
        return ClusterView(now=self.now, version=0, workers=dict(self.facts), global_batch=96)

    def step(self, event: Event) -> list[Decision]:
        self.now = event.now
        if isinstance(event, Join):
            lo = min((f.clock for f in self.facts.values()), default=0)
            pb, bps = self.link or (None, None)
            self.facts[event.worker] = WorkerFacts(
                event.worker, f"w{event.worker}", lo, 0, True, event.now,
                push_bytes=pb, link_bps=bps,
            )  # fmt: skip
        elif isinstance(event, Leave):
            self.facts.pop(event.worker)
        elif isinstance(event, Push):
            f = self.facts[event.worker]
            self.facts[event.worker] = dataclasses.replace(f, clock=f.clock + 1, waiting=True)
        decisions, self.state = self.policy.update(event, self.state, self.view())
        resolve(decisions)  # the engine's rules: raises on a plan field a Plan does not have
        for d in decisions:
            if isinstance(d, Release):
                assert self.facts[d.worker].waiting, "released a worker that was not waiting"
                self.facts[d.worker] = dataclasses.replace(self.facts[d.worker], waiting=False)
        return list(decisions)

    def push(
        self, w: int, per_sample: float = 0.001, loss: float = 1.0, samples: int = 32
    ) -> list[Decision]:
        return self.step(
            Push(self.now + 0.1, w, 0, "delta", samples, 1, per_sample * samples, loss)
        )


def profiled(policy: Policy, speeds: Mapping[int, float], **kw: Any) -> Cluster:
    """A cluster whose workers joined and pushed through the profile stage (5 pushes each)."""
    c = Cluster(policy, **kw)
    for w in speeds:
        c.step(Join(c.now, w))
    for _ in range(5):
        for w, s in speeds.items():
            c.push(w, s)
    return c


def sets(decisions: Sequence[Decision]) -> dict[int, Mapping[str, Any]]:
    """The SetPlan fields per worker."""
    return {d.worker: d.fields for d in decisions if isinstance(d, SetPlan)}


def weight(decisions: Sequence[Decision]) -> float:
    """The weight of the push's Apply, which comes first."""
    assert isinstance(decisions[0], Apply), decisions
    return decisions[0].weight


def replanned(decisions: Sequence[Decision]) -> dict[int, Mapping[str, Any]]:
    """The SetPlans that change local steps (not the lr schedule's steps)."""
    return {w: f for w, f in sets(decisions).items() if "local_steps" in f}


def test_first_join_announces_the_profile_stage() -> None:
    c = Cluster(ashl_fixed())
    assert c.step(Join(0.0, 1)) == [SetStage(PROFILE), SetPlan(1, PROFILE_FIELDS), Release(1)]
    assert c.step(Join(0.1, 2)) == [SetPlan(2, PROFILE_FIELDS), Release(2)]
    assert c.push(1) == [Apply(0.5), Release(1)]  # ASP weight 1/N, never held


def test_profile_stage_ends_when_every_worker_has_a_profile() -> None:
    c = Cluster(ashl_fixed())
    for w in (1, 2):
        c.step(Join(0.0, w))
    for _ in range(4):
        c.push(1, 0.004)
        c.push(2, 0.002)
    c.push(1, 0.004)
    assert c.state.stage == PROFILE  # worker 2 has 4 pushes
    out = c.push(2, 0.002)
    assert out[0] == Apply(0.5) and out[1] == SetStage(AHL)
    assert sets(out)[1]["local_steps"] == 8 and sets(out)[2]["local_steps"] == 16
    assert sets(out)[2]["codec"] == "none" and sets(out)[2]["data_share"] == pytest.approx(2 / 3)
    assert out[-1] == Release(2)
    assert [s for s, _ in c.state.transitions] == [PROFILE, AHL]


def test_ahl_applies_with_p_and_never_holds() -> None:
    c = profiled(ashl_fixed(), {1: 0.004, 2: 0.002})
    c.push(2, 0.002)
    c.push(2, 0.002)
    out = c.push(1, 0.004)
    assert weight(out) == pytest.approx(1 / 3)
    assert Release(1) in out


def loss_run(series: Sequence[float], **params: Any) -> tuple[Cluster, list[int]]:
    """Evaluations of ``series`` in AHL; the indices at which SetStage(SHL) came."""
    c = profiled(ashl_fixed(params), {1: 0.004, 2: 0.002})
    switched = []
    for i, loss in enumerate(series):
        if SetStage(SHL) in c.step(Eval(c.now + 1.0, loss, 0.5)):
            switched.append(i)
    return c, switched


SERIES = [
    ("threshold", [2.0, 1.5, 1.0, 0.6, 0.29, 0.2], {}, [4], "threshold"),
    ("plateau", [2.0, 1.5, 1.2, 1.195, 1.19, 1.0], {}, [4], "plateau"),
    (
        "never: 5 % better each time",
        [2.0 * 0.95**i for i in range(30)],
        {"switch_loss": 0.1},
        [],
        None,
    ),
    ("NaN evaluations are ignored", [2.0, math.nan, 1.5, math.nan, 1.0], {}, [], None),
]


@pytest.mark.parametrize(
    ("series", "params", "at", "why"), [r[1:] for r in SERIES], ids=[r[0] for r in SERIES]
)
def test_stage_switch_on_scripted_losses(
    series: list[float], params: dict[str, Any], at: list[int], why: str | None
) -> None:
    c, switched = loss_run(series, **params)
    assert switched == at
    assert c.state.switch == why
    assert c.state.stage == (SHL if at else AHL)


def test_shl_plans_topk_rho_and_resets_lr() -> None:
    c = profiled(ashl_fixed(), {1: 0.004, 2: 0.002}, link=(1e4, 1e6))  # u = d = 0.01 s
    out = c.step(Eval(c.now + 1, 0.1, 0.9))
    assert SetStage(SHL) in out
    plans = sets(out)
    assert plans[1]["codec"] == "topk" and plans[1]["topk"] == pytest.approx(0.25)
    assert 0.25 <= plans[2]["topk"] <= 1.0
    assert plans[1]["local_steps"] == 2 and plans[1]["lr_scale"] == 3.0
    assert plans[1]["staleness_bound"] == 3
    free = profiled(ashl_fixed(), {1: 0.004, 2: 0.002})  # no link facts: comm is free
    plans = sets(free.step(Eval(free.now + 1, 0.1, 0.9)))
    assert plans[2]["topk"] == 1.0 and plans[2]["codec"] == "none"  # a dense push, sent plainly


def in_shl(commits: Mapping[int, int]) -> Cluster:
    c = profiled(ashl_fixed({"staleness": 1}), dict.fromkeys(commits, 0.001))
    c.step(Eval(c.now + 1, 0.1, 0.9))
    c.state = dataclasses.replace(c.state, commits=dict(commits))
    return c


def test_shl_gate_table() -> None:
    c = in_shl({1: 1, 2: 0})
    assert Release(1) not in c.push(1)  # 2 ahead of the slowest with s = 1: held
    assert c.state.commits == {1: 2, 2: 0}
    out = c.push(2)  # the slowest commits: 1 is within 1 again
    assert Release(1) in out and Release(2) in out
    c.push(2)
    c.push(1)
    assert not c.facts[1].waiting  # 3 vs 2
    c.push(1)
    assert c.facts[1].waiting  # 4 vs 2
    assert c.step(Leave(c.now + 1, 2))[-1] == Release(1)  # the slowest left


def test_join_profiles_the_newcomer_then_replans_everyone() -> None:
    c = profiled(ashl_fixed(), {1: 0.004, 2: 0.002})
    out = c.step(Join(c.now, 3))
    assert sets(out) == {3: PROFILE_FIELDS} and Release(3) in out
    for _ in range(4):
        out = c.push(3, 0.001)
        assert weight(out) == pytest.approx(1 / 3) and out[1:] == [Release(3)]
    out = c.push(3, 0.001)
    assert {w: f["local_steps"] for w, f in sets(out).items()} == {1: 8, 2: 16, 3: 32}
    assert c.state.replans[-1][1] == "profiled 3"
    assert weight(c.push(3)) == pytest.approx(4 / 7)


def test_leave_replans_the_rest() -> None:
    c = profiled(ashl_fixed(), {1: 0.004, 2: 0.002, 3: 0.001})
    out = c.step(Leave(c.now, 1))  # the slowest leaves: the others need fewer steps
    assert {w: f["local_steps"] for w, f in sets(out).items()} == {2: 8, 3: 16}
    assert c.state.replans[-1][1] == "left 1"


def test_drift_replans_and_noise_does_not() -> None:
    c = profiled(ashl_fixed(), {1: 0.004, 2: 0.002})
    for i in range(40):
        assert not replanned(c.push(1, 0.004 * (1.1 if i % 2 else 0.9)))  # 10 % noise
    assert len(c.state.replans) == 1  # only "profile done"
    outs = [c.push(2, 0.0028) for _ in range(3)]  # 40 % slower
    assert not replanned(outs[0]) and not replanned(outs[1])
    assert replanned(outs[2])[2]["local_steps"] == round(8 * 0.004 / 0.0028)
    assert c.state.replans[-1][1] == "drift 2"


def test_describe_state() -> None:
    c = profiled(ashl_fixed(), {1: 0.004, 2: 0.002})
    d = describe_state(c.state)
    assert d["stage"] == AHL and [t["stage"] for t in d["transitions"]] == [PROFILE, AHL]
    rows = {r["worker"]: r for r in d["workers"]}
    assert rows[2]["H"] == 16 and rows[2]["share"] == pytest.approx(2 / 3) and rows[2]["rho"] == 1.0
    assert rows[1]["sample_s"] == pytest.approx(0.004)
    assert c.state.describe() == d


def test_hot_swap_uses_the_engine_ewma_and_announces_plans() -> None:
    policy = ashl_fixed()
    facts = {
        w: WorkerFacts(w, "x", 9, 0, w == 1, 0.0, sample_s=s) for w, s in ((1, 0.004), (2, 0.002))
    }
    view = ClusterView(now=5.0, version=3, workers=facts, global_batch=64)
    out, state = policy.update(Tick(5.0), policy.init(view), view)
    assert out[0] == SetStage(AHL) and set(sets(out)) == {1, 2}
    assert out[-1] == Release(1) and isinstance(state, AshlState)


@pytest.mark.parametrize(
    ("params", "word"),
    [
        ({"topk": 0.0}, "topk"),
        ({"k_coarse": 0}, "k_coarse"),
        ({"staleness": -1}, "staleness"),
        ({"plateau_evals": 1}, "plateau_evals"),
        ({"profile_pushes": 0}, "profile_pushes"),
        ({"shl_lr_scale": math.inf}, "shl_lr_scale"),
        ({"bogus": 1}, "bogus"),
        ({"comm_ref": 0}, "comm_ref"),
    ],
)
def test_bad_params_raise(params: dict[str, Any], word: str) -> None:
    with pytest.raises(PolicyError, match=word):
        ashl_fixed(params)


def test_factory_signature_matches_the_config() -> None:
    """``ashl``'s keyword parameters are AshlConfig's fields, with the same defaults."""
    sig = inspect.signature(ashl)
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in sig.parameters.values())
    defaults = {n: p.default for n, p in sig.parameters.items()}
    assert defaults == {f.name: f.default for f in dataclasses.fields(AshlConfig)}
    assert make_policy("ashl").params == dataclasses.asdict(AshlConfig())


def test_unknown_parameter_lists_the_valid_ones() -> None:
    with pytest.raises(PolicyError, match="bogus") as info:
        make_policy("ashl", {"bogus": 1})
    assert "k_coarse" in str(info.value) and "shl_lr_scale" in str(info.value)


# --- a scripted run through every stage ----------------------------------------------------------------


class Run:
    """A tiny engine: workers compute ``local_steps * batch * sample_s`` (+ link time), push, and
    wait for a Release; plans and the stage follow SetPlan/SetStage; evaluations come every
    ``eval_s`` with the loss ``loss(applied updates)``."""

    def __init__(
        self,
        policy: Policy,
        sample_s: Mapping[int, float],
        loss: Callable[[int], float],
        eval_s: float = 1.0,
        batch: int = 32,
        comm_s: float = 0.0,
    ) -> None:
        self.policy, self.sample_s, self.loss, self.batch, self.comm_s = (
            policy, dict(sample_s), loss, batch, comm_s
        )  # fmt: skip
        self.c = Cluster(policy, link=(1e4, 1e4 / comm_s) if comm_s else None)
        self.plans: dict[int, dict[str, Any]] = {w: {"local_steps": 1} for w in sample_s}
        self.stage = "main"
        self.queue: list[tuple[float, int, int, int]] = []  # (time, seq, worker | -1, steps)
        self.seq = 0
        self.applied = 0
        self.pushes: dict[tuple[str, int], int] = {}  # (stage, worker) -> pushes
        self.stage_commits: dict[int, int] = {}  # pushes since the last SetStage
        self.max_shl_gap = 0
        self.last_at: dict[int, float] = {}  # s, each worker's last push
        self.max_interval = 0.0  # s, the longest time between two pushes of one worker
        self.schedule(eval_s, -1)
        self.eval_s = eval_s

    def schedule(self, t: float, who: int, steps: int = 0) -> None:
        heapq.heappush(self.queue, (t, self.seq, who, steps))
        self.seq += 1

    def handle(self, event: Event) -> list[Decision]:
        out = self.c.step(event)
        decided = [d for d in out if isinstance(d, Apply | Buffer | Drop)]
        assert len(decided) == (1 if isinstance(event, Push) else 0), out
        self.applied += len(decided)
        for d in out:
            if isinstance(d, SetStage):
                self.stage = d.stage
                self.stage_commits = dict.fromkeys(self.c.facts, 0)
            elif isinstance(d, SetPlan):
                self.plans[d.worker] = {**self.plans.get(d.worker, {}), **d.fields}
        for d in out:
            if isinstance(d, Release):
                if self.stage == SHL:
                    lo = min(self.stage_commits.get(w, 0) for w in self.c.facts)
                    gap = self.stage_commits.get(d.worker, 0) - lo
                    self.max_shl_gap = max(self.max_shl_gap, gap)
                plan = self.plans[d.worker]
                k = int(plan["local_steps"])
                comm = self.comm_s * (float(plan.get("topk", 1.0)) + 1.0)
                t = event.now + k * self.batch * self.sample_s[d.worker] + comm
                self.schedule(t, d.worker, k)  # the plan at release is the one it runs
        return out

    def go(self, pushes: int) -> None:
        for w in self.sample_s:
            self.handle(Join(0.0, w))
        done = 0
        while done < pushes:
            assert self.queue, "deadlock: everyone waits and nothing was released"
            t, _, w, k = heapq.heappop(self.queue)
            if w < 0:
                self.handle(Eval(t, self.loss(self.applied), 0.5))
                self.handle(Tick(t))
                self.schedule(t + self.eval_s, -1)
                continue
            self.stage_commits[w] = self.stage_commits.get(w, 0) + 1
            self.max_interval = max(self.max_interval, t - self.last_at.get(w, t))
            self.last_at[w] = t
            self.pushes[self.stage, w] = self.pushes.get((self.stage, w), 0) + 1
            n = k * self.batch
            self.handle(Push(t, w, 0, "delta", n, k, n * self.sample_s[w], self.loss(self.applied)))
            done += 1


SPEEDS = {1: 0.004, 2: 0.002, 3: 0.001}  # speeds 1, 2, 4


def test_scripted_run_through_every_stage() -> None:
    run = Run(ashl_fixed(), SPEEDS, loss=lambda n: 2.0 * 0.99**n, eval_s=1.0, comm_s=0.01)
    run.go(600)
    st = run.c.state
    assert [s for s, _ in st.transitions] == [PROFILE, AHL, SHL]
    assert st.switch == "threshold"
    for stage in (PROFILE, AHL, SHL):
        for w in SPEEDS:
            assert run.pushes.get((stage, w), 0) >= 5, (stage, w, run.pushes)
    assert run.max_shl_gap <= 3
    assert run.max_interval < 1.5  # nobody waits long: the slowest AHL round is 8 x 128 ms
    assert {w: run.plans[w]["local_steps"] for w in SPEEDS} == {1: 2, 2: 4, 3: 8}
    assert sum(run.plans[w]["data_share"] for w in SPEEDS) == pytest.approx(1.0)
    # equal round times leave no slack: everyone keeps rho (here u = d = 10 ms, c = 32-128 ms)
    assert all(run.plans[w]["codec"] == "topk" for w in SPEEDS)
    assert all(run.plans[w]["topk"] == pytest.approx(0.25) for w in SPEEDS)


def test_scripted_run_with_a_plateau_and_a_drift() -> None:
    speeds = dict(SPEEDS)
    run = Run(ashl_fixed(), speeds, loss=lambda n: max(0.8, 2.0 * 0.99**n), eval_s=0.5)
    run.go(150)
    speeds[3] = 0.002  # the fast worker halves its speed
    run.sample_s = speeds
    run.go(300)
    st = run.c.state
    assert st.switch == "plateau"
    assert any(r == "drift 3" for _, r in st.replans)
    assert run.max_shl_gap <= 3
    assert run.max_interval < 1.5
    assert run.plans[3]["local_steps"] == run.plans[2]["local_steps"]


# --- property: one decision per push, releases only for waiting workers ------------------------------

_op = st.one_of(
    st.tuples(st.just("join"), st.integers(1, 4)),
    st.tuples(st.just("leave"), st.integers(1, 4)),
    st.tuples(st.just("push"), st.integers(1, 4), st.floats(1e-4, 1e-2)),
    st.tuples(st.just("eval"), st.floats(0.0, 3.0)),
    st.tuples(st.just("tick"), st.just(0)),
)


def fuzz(policy: Policy, ops: list[tuple[Any, ...]]) -> None:
    c = Cluster(policy)
    for op in ops:
        now = c.now + 0.3
        if op[0] == "join" and op[1] not in c.facts:
            c.step(Join(now, op[1]))
        elif op[0] == "leave" and op[1] in c.facts:
            c.step(Leave(now, op[1]))
        elif op[0] == "push" and op[1] in c.facts and not c.facts[op[1]].waiting:
            out = c.step(Push(now, op[1], 0, "delta", 32, 1, 32 * op[2], 1.0))
            assert len([d for d in out if isinstance(d, Apply | Buffer | Drop)]) == 1
        elif op[0] == "eval":
            out = c.step(Eval(now, op[1], 0.5))
            assert not [d for d in out if isinstance(d, Apply | Buffer | Drop)]
        elif op[0] == "tick":
            c.step(Tick(now))
        for d in c.state.describe()["workers"]:
            assert d["worker"] in c.facts


@settings(max_examples=150, deadline=None, database=None)
@given(st.lists(_op, max_size=60))
def test_ashl_fuzz(ops: list[tuple[Any, ...]]) -> None:
    fuzz(ashl_fixed({"profile_pushes": 2, "plateau_evals": 2}), ops)
