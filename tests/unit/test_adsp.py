"""ADSP as tables: the commit-rate search on a scripted reward series, the reward, local steps from
quotas, quota changes through the policy on scripted losses, join/leave/drift, and a scripted
three-worker run in which every worker commits at about the same rate.

The engine's contract these follow is the one in ``test_ashl``; its ``Cluster`` and ``Run`` are the
tiny engine used here too.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
from typing import Any

import pytest

from hetd.protocol.plan import local_steps_for
from policies import PolicyError, make_policy
from policies.adsp import (
    PROFILE,
    PROFILE_FIELDS,
    TRAIN,
    AdspConfig,
    Search,
    adsp,
    auto_period,
    describe_state,
    local_steps,
    max_quota,
    quotas,
    reward,
    search_step,
    start_rate,
)
from policies.types import Apply, Join, Leave, Plan, Push, Release, SetPlan, SetStage, Tick
from tests.unit.test_ashl import SPEEDS, Cluster, Run, fuzz, replanned, sets

# --- the search ----------------------------------------------------------------------------------------

# (label, rewards, room per period, actions, the rate after each)
SEARCH = [
    (
        "raise while the reward improves, revert once it does not, then hold",
        [1.0, 2.0, 3.0, 2.5, 9.0],
        [True] * 5,
        ["up", "up", "up", "revert", "hold"],
        [2, 3, 4, 3, 3],
    ),
    (
        "an equal reward is no improvement",
        [1.0, 1.0, 5.0],
        [True] * 3,
        ["up", "revert", "hold"],
        [2, 1, 1],
    ),
    (
        "no room for one more commit stops the search",
        [1.0, 2.0, 3.0],
        [True, False, True],
        ["up", "stop: no room", "hold"],
        [2, 2, 2],
    ),
    (
        "no loss data: too few commits to measure, so raise",
        [None, None, 1.0, 0.5],
        [True] * 4,
        ["up: no loss data", "up: no loss data", "up", "revert"],
        [2, 3, 4, 3],
    ),
]


@pytest.mark.parametrize(
    ("rewards", "room", "actions", "rates"),
    [r[1:] for r in SEARCH],
    ids=[r[0] for r in SEARCH],
)
def test_search_on_a_scripted_reward_series(
    rewards: list[float | None], room: list[bool], actions: list[str], rates: list[int]
) -> None:
    s = Search()
    got = []
    for r, ok in zip(rewards, room, strict=True):
        s, action = search_step(s, r, ok)
        got.append((action, s.rate))
    assert got == list(zip(actions, rates, strict=True))


QUOTAS = [
    ("level: everyone commits at the rate", {1: 5, 2: 5}, 3, {}, {1: 3, 2: 3}),
    ("laggards must commit more often", {1: 10, 2: 7, 3: 10}, 1, {}, {1: 1, 2: 4, 3: 1}),
    ("the catch-up is capped", {1: 10, 2: 0}, 2, {2: 5}, {1: 2, 2: 5}),
    ("at least one", {1: 3}, 1, {1: 0}, {1: 1}),
]


@pytest.mark.parametrize(
    ("commits", "rate", "caps", "want"), [r[1:] for r in QUOTAS], ids=[r[0] for r in QUOTAS]
)
def test_quotas(
    commits: dict[int, int], rate: int, caps: dict[int, int], want: dict[int, int]
) -> None:
    assert quotas(commits, rate, caps) == want


REWARD = [
    (
        "windows: (mean first 10 % - mean last 10 %) / period",
        {1: [(0.5, 2.0), (0.9, 1.8), (5.0, 1.0), (9.5, 1.2)]},
        0.07,
    ),
    ("mean over workers", {1: [(0.1, 2.0), (9.9, 1.0)], 2: [(0.1, 3.0), (9.9, 3.0)]}, 0.05),
    ("empty window: first and last samples", {1: [(3.0, 2.0), (4.0, 1.5), (6.0, 1.0)]}, 0.1),
    ("one sample is not enough", {1: [(3.0, 2.0)], 2: []}, None),
]


@pytest.mark.parametrize(("losses", "want"), [r[1:] for r in REWARD], ids=[r[0] for r in REWARD])
def test_reward(losses: dict[int, list[tuple[float, float]]], want: float | None) -> None:
    got = reward(losses, start=0.0, period=10.0, window=0.1)
    assert got == (None if want is None else pytest.approx(want))


STEPS = [
    ("Γ/m - T1 over the step time", 2, 1.0, 0.5, {}, 58),
    ("a faster worker does more steps per commit", 2, 1.0, 0.25, {}, 116),
    ("one commit per period", 1, 1.0, 0.5, {}, 118),
    ("at least one step", 100, 1.0, 0.5, {}, 1),
    ("the guard", 1, 0.0, 1e-6, {"max_local_steps": 500}, 500),
]


@pytest.mark.parametrize(
    ("m", "t1", "step", "params", "want"), [r[1:] for r in STEPS], ids=[r[0] for r in STEPS]
)
def test_local_steps(m: int, t1: float, step: float, params: dict[str, Any], want: int) -> None:
    assert local_steps(m, t1, step, AdspConfig(**{"period_s": 60.0, **params})) == want
    # the same with Γ handed in, as the state does when Γ is derived from the profiles
    assert local_steps(m, t1, step, AdspConfig(**params), 60.0) == want


def test_auto_period_is_period_steps_slowest_rounds() -> None:
    cfg = AdspConfig(period_steps=10)
    # slowest: 0.04 s step + 0.01 s commit overhead
    assert auto_period({1: 0.01, 2: 0.04}, {1: 0.002, 2: 0.01}, cfg) == pytest.approx(0.5)
    assert auto_period({1: 0.01}, {}, AdspConfig(period_s=7.0)) == 7.0
    with pytest.raises(ValueError, match="period"):
        local_steps(1, 0.0, 0.1, cfg)  # no Γ yet


def test_start_rate_is_a_commit_every_start_steps_slowest_rounds() -> None:
    steps, t1 = {1: 0.01, 2: 0.04}, {1: 0.002, 2: 0.01}  # slowest round 50 ms
    assert start_rate(steps, t1, AdspConfig(), 1.0) == 10  # Γ = 20 rounds, one commit every 2
    assert start_rate(steps, t1, AdspConfig(start_steps=5), 1.0) == 4
    assert start_rate(steps, t1, AdspConfig(start_steps=None), 1.0) == 1  # the paper's start
    assert start_rate(steps, t1, AdspConfig(start_steps=50), 1.0) == 1  # never below one


def test_max_quota_leaves_a_step_per_commit() -> None:
    assert max_quota(1.0, 0.5, AdspConfig(period_s=60)) == 40
    assert max_quota(100.0, 0.5, AdspConfig(period_s=60)) == 1


# --- through the policy ----------------------------------------------------------------------------------

GAMMA = 10.0
SAMPLE_S = 0.001  # s per sample; 32-sample steps of 32 ms


def profiled_adsp(**params: Any) -> Cluster:
    """Two profiled workers; the search starts at one commit per period, as the scripts below
    assume (``start_steps=None``)."""
    c = Cluster(make_policy("adsp", {"period_s": GAMMA, "start_steps": None, **params}))
    for w in (1, 2):
        c.step(Join(c.now, w))
    for _ in range(5):
        for w in (1, 2):
            c.push(w, SAMPLE_S)
    return c


def commit(c: Cluster, w: int, at: float, loss: float) -> list[Any]:
    """A commit at ``at`` whose compute filled the time since ``w``'s last push (never held)."""
    n = max(32, round((at - c.state.last_push[w]) / SAMPLE_S))
    return c.step(Push(at, w, 0, "delta", n, n // 32, n * SAMPLE_S, loss))


def test_quota_follows_a_scripted_reward_series() -> None:
    c = profiled_adsp(cycle_periods=4)
    assert c.state.stage == TRAIN and dict(c.state.quota) == {1: 1, 2: 1}
    t0 = c.state.period_start
    seen = []
    for p, r in enumerate([1e-3, 2e-3, 1.5e-3, 5e-3]):  # loss decrease per s in each period
        ps = t0 + p * GAMMA
        for w in (1, 2):
            commit(c, w, ps + 0.5, 2.0)
            commit(c, w, ps + 9.5, 2.0 - r * GAMMA)
        out = c.step(Tick(ps + GAMMA + 0.01))
        seen.append(dict(c.state.quota))
        assert {f["commit_quota"] for f in sets(out).values()} == set(seen[-1].values())
    # up, up, revert; then a new cycle starts searching again from the same rate
    assert seen == [{1: 2, 2: 2}, {1: 3, 2: 3}, {1: 2, 2: 2}, {1: 2, 2: 2}]
    actions = [a for _, _, a in c.state.history]
    assert actions == ["up", "up", "revert", "hold; new cycle"]
    assert [r for _, r, _ in c.state.history] == pytest.approx([1e-3, 2e-3, 1.5e-3, 5e-3])
    d = describe_state(c.state)
    assert d["cycle"] == 1 and d["searching"] and d["lr_scale"] == pytest.approx(0.9)


def test_profile_stage_then_the_first_cycle() -> None:
    c = Cluster(make_policy("adsp", {"period_s": GAMMA, "weight": 0.1, "start_steps": None}))
    assert c.step(Join(0.0, 1)) == [SetStage(PROFILE), SetPlan(1, PROFILE_FIELDS), Release(1)]
    for _ in range(4):
        assert c.push(1, SAMPLE_S) == [Apply(0.1), Release(1)]
    out = c.push(1, SAMPLE_S)
    assert out[:2] == [Apply(0.1), SetStage(TRAIN)]
    f = sets(out)[1]
    # m = 1, T1 = 0.1 s between pushes (0.068 s beyond compute), step 32 ms
    assert f["commit_quota"] == 1 and f["local_steps"] == math.floor((GAMMA - 0.068) / 0.032)


def test_join_is_profiled_then_commits_at_the_current_rate() -> None:
    c = profiled_adsp()
    c.state = dataclasses.replace(c.state, search=Search(rate=2), quota={1: 3, 2: 2})
    out = c.step(Join(c.now, 3))
    assert sets(out) == {3: PROFILE_FIELDS} and Release(3) in out
    for _ in range(5):
        out = c.push(3, SAMPLE_S)
    assert c.state.quota[3] == 2  # the current rate
    assert c.state.commits[3] == max(c.state.commits[1], c.state.commits[2])
    assert set(replanned(out)) == {1, 2, 3}


def test_leave_forgets_the_worker() -> None:
    c = profiled_adsp()
    c.step(Leave(c.now + 0.1, 2))
    assert set(c.state.quota) == {1} and set(c.state.commits) == {1}
    assert [r["worker"] for r in describe_state(c.state)["workers"]] == [1]


def test_drift_replans_local_steps_and_noise_does_not() -> None:
    c = profiled_adsp()
    for i in range(30):
        assert not replanned(c.push(1, SAMPLE_S * (1.1 if i % 2 else 0.9)))
    before = c.state.tracks[2].profile
    outs = [c.push(2, SAMPLE_S * 1.4) for _ in range(3)]
    assert not replanned(outs[0]) and not replanned(outs[1]) and replanned(outs[2])
    assert before is not None and c.state.tracks[2].profile.sample_s == pytest.approx(
        1.4 * SAMPLE_S
    )


def test_an_empty_cluster_does_not_move_the_search() -> None:
    c = profiled_adsp()
    c.step(Leave(c.now + 0.1, 1))
    c.step(Leave(c.now + 0.1, 2))
    for k in range(1, 4):
        assert c.step(Tick(c.state.period_start + k * GAMMA + 0.01)) == []
    assert c.state.search == Search() and c.state.history == ()


@pytest.mark.parametrize(
    ("params", "word"),
    [
        ({"period_s": 0}, "period_s"),
        ({"cycle_periods": 0}, "cycle_periods"),
        ({"weight": -1.0}, "weight"),
        ({"mode": "fast"}, "mode"),
        ({"start_steps": 0}, "start_steps"),
        ({"lr_decay": 1.5}, "lr_decay"),
        ({"reward_window": 0.9}, "reward_window"),
        ({"trim": 0.6}, "trim"),
        ({"bogus": 1}, "bogus"),
    ],
)
def test_bad_params_raise(params: dict[str, Any], word: str) -> None:
    with pytest.raises(PolicyError, match=word):
        make_policy("adsp", params)


def test_time_mode_sends_the_time_budget() -> None:
    c = profiled_adsp(mode="time")
    out = c.step(Tick(c.state.period_start + GAMMA + 0.01))
    f = sets(out)[1]
    assert f["local_time_s"] == pytest.approx(GAMMA / f["commit_quota"] - c.state.t1(1))


@pytest.mark.parametrize(
    ("plan", "step_s", "steps"),
    [
        ({"local_steps": 4}, 0.01, 4),  # steps mode: the daemon's count
        ({"local_steps": 4, "local_time_s": 0.5}, None, 4),  # no measurement yet
        ({"local_steps": 4, "local_time_s": 0.5}, 0.01, 50),  # a fast worker fills its time
        ({"local_steps": 4, "local_time_s": 0.5}, 0.2, 2),  # a slow one does fewer
        ({"local_steps": 4, "local_time_s": 0.5}, 2.0, 1),  # never fewer than one
        ({"local_steps": 4, "local_time_s": 0.0}, 0.01, 4),
        ({"local_steps": 0}, 0.01, 1),  # never fewer than one
    ],
)
def test_workers_turn_a_time_budget_into_local_steps(
    plan: dict[str, Any], step_s: float | None, steps: int
) -> None:
    assert local_steps_for(Plan.from_wire(plan), step_s) == steps


def test_a_time_budget_that_is_not_seconds_is_refused() -> None:
    with pytest.raises(ValueError, match="local_time_s"):
        Plan.from_wire({"local_steps": 4, "local_time_s": True})


def test_factory_signature_matches_the_config() -> None:
    """``adsp``'s keyword parameters are AdspConfig's fields, with the same defaults."""
    sig = inspect.signature(adsp)
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in sig.parameters.values())
    defaults = {n: p.default for n, p in sig.parameters.items()}
    assert defaults == {f.name: f.default for f in dataclasses.fields(AdspConfig)}
    assert make_policy("adsp").params == dataclasses.asdict(AdspConfig())


def test_unknown_parameter_lists_the_valid_ones() -> None:
    with pytest.raises(PolicyError, match="bogus") as info:
        make_policy("adsp", {"bogus": 1})
    assert "period_steps" in str(info.value) and "lr_decay" in str(info.value)


# --- a scripted run -----------------------------------------------------------------------------------


def test_scripted_run_commits_at_equal_rates() -> None:
    speeds = {1: 0.004, 2: 0.002, 3: 0.001}
    params = {"period_s": 2.0, "cycle_periods": 4}
    run = Run(make_policy("adsp", params), speeds, loss=lambda n: 2.0 * 0.995**n, comm_s=0.005)
    run.go(400)
    st = run.c.state
    assert [s for s, _ in st.transitions] == [PROFILE, TRAIN]
    assert st.search.cycle >= 2
    commits = dict(st.commits)
    assert min(commits.values()) >= 20
    assert max(commits.values()) - min(commits.values()) <= 0.15 * max(commits.values())
    assert "up" in {a.split(";")[0] for _, _, a in st.history}
    assert run.max_interval < 2.5  # a commit takes about Γ / m: nobody is left waiting
    steps = {w: run.plans[w]["local_steps"] for w in speeds}
    assert steps[1] < steps[2] < steps[3]  # faster workers do more local steps per commit


class TimedRun(Run):
    """:class:`Run` that keeps every push's (time, worker, local steps)."""

    def handle(self, event: Any) -> list[Any]:
        if isinstance(event, Push):
            self.log.append((event.now, event.worker, event.steps))
        return super().handle(event)

    log: list[tuple[float, int, int]]


@pytest.mark.parametrize(("start_steps", "rounds"), [(2, 3.0), (4, 5.0)])
def test_first_commits_come_within_a_few_slowest_rounds(start_steps: int, rounds: float) -> None:
    """With Γ derived from the profiles (20 slowest rounds), every worker's first commit after the
    profile stage arrives within ``start_steps`` + 1 of the slowest worker's rounds (step + commit
    overhead), not after a whole Γ; the fastest still takes several local steps per commit."""
    run = TimedRun(make_policy("adsp", {"start_steps": start_steps}), SPEEDS, lambda n: 2.0)
    run.log = []
    run.go(60)
    st = run.c.state
    t0 = dict(st.transitions)[TRAIN]
    slowest_round = 32 * SPEEDS[1] + st.t1(1)
    assert st.period == pytest.approx(20 * slowest_round, rel=0.2)
    first = {w: min(t for t, v, k in run.log if v == w and t > t0 and k > 1) for w in (2, 3)}
    first[1] = min(t for t, v, _ in run.log if v == 1 and t > t0 + 32 * SPEEDS[1])
    assert all(t - t0 <= rounds * slowest_round for t in first.values()), (first, t0)
    fast = [k for t, v, k in run.log if v == 3 and t > t0]
    assert fast and max(fast) >= 2 * start_steps  # 4x the slowest's speed: local steps


def test_adsp_fuzz() -> None:
    ops: list[tuple[Any, ...]] = []
    for i in range(200):  # deterministic churn: joins, pushes, leaves, ticks past periods
        w = 1 + i % 4
        ops += [("join", w), ("push", w, 1e-3 * (1 + i % 3)), ("tick", 0)]
        if i % 7 == 0:
            ops.append(("leave", 1 + (i // 7) % 4))
        if i % 11 == 0:
            ops.append(("eval", 1.0))
    fuzz(make_policy("adsp", {"period_s": 1.0, "cycle_periods": 2, "profile_pushes": 2}), ops)
