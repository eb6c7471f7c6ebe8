"""``auto`` (policies/auto.py): it decides as its inner policy until a forecast makes it switch;
a switch needs the margin and the dwell, flushes what is buffered, puts every plan back to its
default and starts the new policy with levelled clocks; a policy that fails to start leaves the
old one; predictions of a policy the model got wrong lately count for less; the state survives a
checkpoint and describes itself."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from typing import Any

import pytest

import policies  # noqa: F401  (registers the built-in policies)
from hetd.server.policy_state import policy_state_tree, revive_policy_state
from policies import registry
from policies.auto import AutoState, switch_cost_s
from policies.auto_choice import ErrorLog
from policies.compose import describe_state, resolve
from policies.registry import PolicyError, make_policy
from policies.types import (
    Apply,
    Buffer,
    ClusterView,
    Decision,
    Event,
    Flush,
    Forecast,
    Join,
    Leave,
    Plan,
    Policy,
    Prediction,
    Push,
    Release,
    SetPlan,
    SetStage,
    Tick,
    WorkerFacts,
)

STEP_S, BATCH = 0.01, 32  # s per step of 32 samples at slow-down 1


class Cluster:
    """Worker facts moved by events and decisions as the engine moves them (clocks, waiting,
    timings, batches, the buffer and the version), enough to drive policies side by side."""

    def __init__(self, slowdowns: Sequence[float], codec: str = "none") -> None:
        self.now = 0.0
        self.version = 0
        self.groups: list[int] = []  # the buffered pushes' groups
        self.stage = "main"
        self.workers = {
            w: WorkerFacts(w, f"w{w}", 0, 0, True, 0.0, codec=codec, batch_size=BATCH)
            for w in range(len(slowdowns))
        }
        self.slow = dict(enumerate(slowdowns))
        self.optimizer: str | None = None  # the workers' optimizer, as the view names it

    def view(self) -> ClusterView:
        return ClusterView(
            self.now,
            self.version,
            dict(self.workers),
            128,
            len(self.groups),
            self.stage,
            optimizer=self.optimizer,
        )

    def push(self, w: int) -> Push:
        """Worker ``w`` pushes one step at ``now``: its clock and timings count it."""
        f = self.workers[w]
        compute = STEP_S * self.slow[w] * f.batch_size / BATCH
        self.workers[w] = dataclasses.replace(
            f,
            clock=f.clock + 1,
            waiting=True,
            prev_push_at=f.last_push_at,
            last_push_at=self.now,
            compute_s=compute,
            sample_s=compute / f.batch_size,
            push_bytes=4000.0,
            link_bps=1e9,
            samples=f.samples + f.batch_size,
        )
        return Push(self.now, w, f.version, "grad", f.batch_size, 1, compute, loss=1.0)

    def join(self, w: int, slowdown: float) -> Join:
        clock = min(f.clock for f in self.workers.values())
        self.workers[w] = WorkerFacts(w, f"w{w}", clock, -1, True, self.now, batch_size=BATCH)
        self.slow[w] = slowdown
        return Join(self.now, w)

    def leave(self, w: int) -> Leave:
        del self.workers[w]
        return Leave(self.now, w, "gone")

    def carry_out(self, decisions: Sequence[Decision], push: bool) -> None:
        r = resolve(decisions)
        for d in r.plans:
            if isinstance(d, SetStage):
                self.stage = d.stage
            elif isinstance(d, SetPlan) and d.worker in self.workers:
                plan = Plan(batch_size=self.workers[d.worker].batch_size).merge(d.fields)
                self.workers[d.worker] = dataclasses.replace(
                    self.workers[d.worker], batch_size=plan.batch_size
                )
        if push and (r.push is None or isinstance(r.push, Apply)):
            self.version += 1
        elif push and isinstance(r.push, Buffer):
            self.groups.append(r.push.group)
        for a in r.actions:
            if isinstance(a, Flush):
                done = {g for g in self.groups if a.upto is None or g <= a.upto}
                self.version += len(done)
                self.groups = [g for g in self.groups if g not in done]
            elif isinstance(a, Release) and a.worker in self.workers:
                self.workers[a.worker] = dataclasses.replace(
                    self.workers[a.worker], waiting=False, version=self.version
                )


def drive(
    c: Cluster, policy: Policy, state: Any, until: float, events: dict[float, str] | None = None
) -> tuple[list[list[Decision]], Any]:
    """Run ``policy`` on the cluster to ``until`` s: each worker not waiting pushes when its step
    ends (checked every 5 ms), a tick every 50 ms, and ``events`` (time -> "join:w:slow" or
    "leave:w") at their times. Returns every event's decisions and the final state."""
    pending = dict(events or {})
    started = {w: c.now for w in c.workers}
    out: list[list[Decision]] = []

    def step(ev: Event, push: bool) -> None:
        nonlocal state
        decisions, state = policy.update(ev, state, c.view())
        out.append(list(decisions))
        c.carry_out(decisions, push)

    while c.now < until - 1e-9:
        c.now = round(c.now + 0.005, 6)
        for t in sorted(k for k in pending if k <= c.now):
            kind, *rest = pending.pop(t).split(":")
            if kind == "join":
                step(c.join(int(rest[0]), float(rest[1])), False)
                started[int(rest[0])] = c.now
            else:
                step(c.leave(int(rest[0])), False)
        for w in sorted(c.workers):
            f = c.workers[w]
            if f.waiting:
                started[w] = c.now
                continue
            if c.now - started[w] >= STEP_S * c.slow[w] * f.batch_size / BATCH - 1e-9:
                started[w] = c.now
                step(c.push(w), True)
        if round(c.now / 0.05, 6).is_integer():
            step(Tick(c.now), False)
    return out, state


def start(policy: Policy, c: Cluster) -> Any:
    """The policy started as the engine starts one: init, then a Tick's decisions carried out."""
    state = policy.init(c.view())
    decisions, state = policy.update(Tick(c.now), state, c.view())
    c.carry_out(decisions, False)
    return state


CHURN = {0.2: "join:3:1.5", 0.5: "leave:1"}


@pytest.mark.parametrize("inner", ["lbbsp", "ssp", "bsp", "asp", "adsp", "hps"])
def test_without_forecasts_auto_decides_as_its_inner_policy(inner: str) -> None:
    a, b = Cluster([1.0, 2.0, 4.0]), Cluster([1.0, 2.0, 4.0])
    wrapped, plain = make_policy("auto", {"warmup": "", "start": inner}), make_policy(inner)
    got, _ = drive(a, wrapped, start(wrapped, a), 1.0, CHURN)
    want, _ = drive(b, plain, start(plain, b), 1.0, CHURN)
    assert got == want
    assert a.version > 20 and a.version == b.version


# --- forecasts ----------------------------------------------------------------------------------


def pred(name: str, samples_per_s: float, efficiency: float = 1.0, **params: Any) -> Prediction:
    return Prediction(name, tuple(sorted(params.items())), samples_per_s, efficiency)


def forecast(now: float, *predictions: Prediction) -> Forecast:
    return Forecast(now, 10.0, predictions)


def running(state: AutoState) -> str:
    return state.name + "".join(f":{k}={v}" for k, v in state.params)


def warm(
    c: Cluster, policy: Policy, until: float, first: Forecast | None = None
) -> tuple[AutoState, list[list[Decision]]]:
    """Auto started at 0, an optional forecast at 0, then run to ``until``."""
    state = start(policy, c)
    if first is not None:
        decisions, state = policy.update(first, state, c.view())
        c.carry_out(decisions, False)
    out, state = drive(c, policy, state, until)
    assert isinstance(state, AutoState)
    return state, out


def test_a_forecast_that_clears_the_margin_after_the_dwell_switches() -> None:
    c = Cluster([1.0, 2.0, 4.0])
    p = make_policy("auto", {"warmup": "", "dwell_s": 5.0})
    state, _ = warm(c, p, 0.6, forecast(0.0, pred("lbbsp", 5000), pred("asp", 5000)))
    decisions, state = p.update(
        forecast(c.now, pred("lbbsp", 5000), pred("asp", 6000)), state, c.view()
    )
    assert running(state) == "asp" and state.since == c.now and state.checks == 0
    assert state.last is not None and state.last.chosen == "asp"
    assert "beats lbbsp" in state.last.why
    assert [s.label for s in state.last.scored] == ["asp", "lbbsp"]
    assert len(state.switches) == 1 and state.switches[0][1:3] == ("lbbsp", "asp")
    # asp's first decisions release everyone waiting
    assert {d.worker for d in decisions if isinstance(d, Release)} == {
        w for w, f in c.view().workers.items() if f.waiting
    }


def test_the_start_policy_may_be_left_at_the_first_forecast() -> None:
    """The start policy is a default, not a choice: no dwell holds it (a forecast that comes as
    soon as the workers are timed can move auto off it at once)."""
    c = Cluster([1.0, 2.0, 4.0])
    p = make_policy("auto", {"warmup": "", "dwell_s": 30.0})
    state, _ = warm(c, p, 0.1)
    decisions, state = p.update(
        forecast(c.now, pred("lbbsp", 5000), pred("asp", 9000)), state, c.view()
    )
    assert running(state) == "asp" and state.checks == 0 and len(state.switches) == 1
    assert {d.worker for d in decisions if isinstance(d, SetPlan)} == set(c.workers)


@pytest.mark.parametrize(
    ("asp", "hps", "then"),
    [(5400.0, 5000.0, "lbbsp"), (6000.0, 5000.0, "asp"), (5000.0, 6000.0, "hps")],
)
def test_until_its_first_forecast_auto_warms_up_on_asp_then_weighs_against_the_start(
    asp: float, hps: float, then: str
) -> None:
    """Before the first forecast auto runs asp (no worker waits on one not timed yet), deciding
    as asp alone does; the first forecast then weighs the best candidate against the start
    policy, not against the warm-up: inside the margin auto goes to lbbsp, beyond it to the
    best, which may be asp itself."""
    a, b = Cluster([1.0, 2.0, 4.0]), Cluster([1.0, 2.0, 4.0])
    p, plain = make_policy("auto", {"dwell_s": 30.0, "warmup": "asp"}), make_policy("asp")
    got, state = drive(a, p, start(p, a), 0.3)
    want, _ = drive(b, plain, start(plain, b), 0.3)
    assert got == want and running(state) == "asp" and state.warming
    decisions, state = p.update(
        forecast(a.now, pred("lbbsp", 5000), pred("asp", asp), pred("hps", hps)), state, a.view()
    )
    assert running(state) == then and not state.warming
    assert state.last is not None and "lbbsp (5000" in state.last.why
    assert len(state.switches) == (then != "asp") and (then == "asp") == (list(decisions) == [])
    # a policy kept or gone back to is no switch the dwell holds; one switched to (hps) is
    _, state = p.update(forecast(a.now, pred(then, 5000), pred("ssp", 9000)), state, a.view())
    assert running(state) == ("hps" if then == "hps" else "ssp")


@pytest.mark.parametrize(
    ("optimizer", "first", "restarts"),
    [("sgd:lr=0.2", "ashl", False), ("adam:lr=0.001", "ashl", True), ("adamw", "ashl", True)],
)
@pytest.mark.parametrize("then", ["lbbsp", "hps"])
def test_the_warm_up_is_ashl_and_under_adam_its_end_restarts_the_optimizer(
    optimizer: str, first: str, restarts: bool, then: str
) -> None:
    """auto warms up on ashl (its profiling stage trains without a barrier, and where the first
    forecast keeps ashl nothing switches). Leaving an adaptive optimizer's warm-up restarts the
    daemon's optimizer, after the flush of what is buffered: its moments hold the warm-up's
    small, stale steps. Not under SGD."""
    c = Cluster([1.0, 2.0, 4.0])
    c.optimizer = optimizer
    p = make_policy("auto", {"dwell_s": 1.0})
    state = start(p, c)
    assert running(state) == first and state.warming
    _, state = drive(c, p, state, 0.3)
    best = 9000 if then == "hps" else 5000  # lbbsp, the start, goes on at par
    decisions, state = p.update(
        forecast(c.now, pred("lbbsp", 5000), pred(first, 5000), pred("hps", best)),
        state,
        c.view(),
    )
    assert running(state) == then and not state.warming
    kinds = [type(d).__name__ for d in decisions]
    assert ("RestartOptimizer" in kinds) == restarts
    if restarts and "Flush" in kinds:
        assert kinds.index("Flush") < kinds.index("RestartOptimizer")
    # a later switch, a forecast's own choice, keeps the optimizer's state
    _, state = drive(c, p, state, c.now + 1.1)
    decisions, state = p.update(
        forecast(c.now, pred(then, 5000), pred("ssp", 9000)), state, c.view()
    )
    assert running(state) == "ssp"
    assert not any(type(d).__name__ == "RestartOptimizer" for d in decisions)


@pytest.mark.parametrize(("optimizer", "first"), [("sgd", "asp"), ("adam", "lbbsp")])
def test_without_ashl_among_the_candidates_the_warm_up_is_asp_and_under_adam_none(
    optimizer: str, first: str
) -> None:
    c = Cluster([1.0, 2.0, 4.0])
    c.optimizer = optimizer
    p = make_policy("auto", {"candidates": "asp,lbbsp,adsp"})
    state = start(p, c)
    assert running(state) == first and state.warming == (first == "asp")


def test_a_warm_up_the_first_forecast_keeps_runs_on_untouched() -> None:
    """Under Adam, where the first forecast finds ashl (the warm-up) the best, auto stays on it:
    no switch, no restart, the same decisions as ashl alone."""
    a, b = Cluster([1.0, 2.0, 4.0]), Cluster([1.0, 2.0, 4.0])
    a.optimizer = b.optimizer = "adam:lr=0.001"
    p, plain = make_policy("auto", {"dwell_s": 30.0}), make_policy("ashl")
    got, state = drive(a, p, start(p, a), 0.3)
    want, _ = drive(b, plain, start(plain, b), 0.3)
    assert got == want
    decisions, state = p.update(
        forecast(a.now, pred("lbbsp", 5000), pred("ashl", 7000)), state, a.view()
    )
    assert list(decisions) == [] and running(state) == "ashl" and not state.switches


def test_without_a_forecast_the_warm_up_ends_on_the_start_policy() -> None:
    c = Cluster([1.0, 2.0, 4.0])
    p = make_policy("auto", {"warmup_s": 0.4, "dwell_s": 30.0})
    state, out = warm(c, p, 0.6)
    assert running(state) == "lbbsp" and not state.warming
    assert [s[1:3] for s in state.switches] == [("ashl", "lbbsp")]
    assert "no forecast in 0.4 s" in state.switches[0][3] and state.switches[0][0] == 0.4
    assert any(isinstance(d, SetPlan) for d in out[-1] + [d for ds in out for d in ds])
    _, state = p.update(forecast(c.now, pred("lbbsp", 5000), pred("ssp", 9000)), state, c.view())
    assert running(state) == "ssp"  # no dwell holds a default


def test_a_switch_must_pay_for_its_rounds_within_the_dwell() -> None:
    """The same forecast, 20 % better, moves auto off its start policy when the dwell is long
    enough to pay back two rounds of the slowest worker, and not when it is not."""
    decided = {}
    for dwell in (0.4, 5.0):
        c = Cluster([1.0, 2.0, 4.0])
        p = make_policy("auto", {"warmup": "", "dwell_s": dwell})
        state, _ = warm(c, p, 0.6)
        cost = switch_cost_s(c.view())
        rounds = [(f.last_push_at or 0.0) - (f.prev_push_at or 0.0) for f in c.workers.values()]
        assert cost == pytest.approx(2 * max(rounds), rel=0.01) and cost > 0
        # one cycle that something stalled (a compile, a pause) is not what a round costs
        v = c.view()
        slow = max(v.workers.values(), key=lambda f: f.compute_s or 0.0)
        stalled = dataclasses.replace(slow, prev_push_at=(slow.last_push_at or 0.0) - 1.0)
        after = switch_cost_s(dataclasses.replace(v, workers={**v.workers, slow.worker: stalled}))
        assert after < 1.2 * cost  # not 2 s
        _, state = p.update(
            forecast(c.now, pred("lbbsp", 5000), pred("asp", 6000)), state, c.view()
        )
        decided[dwell] = running(state)
        assert (
            state.last is not None
            and f"after {min(1.0, cost / dwell):.0%} for the switch" in state.last.why
        )
    assert decided == {0.4: "lbbsp", 5.0: "asp"}


@pytest.mark.parametrize(
    ("warm_up", "start_with", "best", "then"),
    [(5600.0, 5000.0, 0.0, "asp"), (4000.0, 5000.0, 6000.0, "hps")],
)
def test_the_warm_up_ends_where_the_switch_it_takes_pays_and_the_start_pays_one_too(
    warm_up: float, start_with: float, best: float, then: str
) -> None:
    """During the warm-up the start policy is a switch away as much as any other candidate: at a
    switch cost of half the dwell, the warm-up's own policy (no switch) is kept over a start
    policy it beats by 12 %, and a candidate 20 % above the start is switched to, where charging
    the switch to it alone sent both runs to the start."""
    c = Cluster([1.0, 2.0, 4.0])
    state, _ = warm(c, make_policy("auto", {"dwell_s": 30.0, "warmup": "asp"}), 0.6)
    cost = switch_cost_s(c.view())
    # the same run, a switch costs half the dwell
    p = make_policy("auto", {"dwell_s": 2 * cost, "warmup": "asp"})
    state, _ = warm(Cluster([1.0, 2.0, 4.0]), p, 0.6)
    assert running(state) == "asp" and state.warming
    preds = [pred("lbbsp", start_with), pred("asp", warm_up)] + ([pred("hps", best)] * (best > 0))
    _, state = p.update(forecast(c.now, *preds), state, c.view())
    assert running(state) == then and not state.warming
    assert state.last is not None and "after 50% for the switch" in state.last.why


def switched(c: Cluster, p: Policy, at: float) -> AutoState:
    """Auto switched from lbbsp to asp at 0, then run to ``at``."""
    state, _ = warm(c, p, 0.0, forecast(0.0, pred("lbbsp", 5000), pred("asp", 9000)))
    assert running(state) == "asp"
    _, state = drive(c, p, state, at)
    assert isinstance(state, AutoState)
    return state


@pytest.mark.parametrize(
    ("why", "at", "needs", "second", "reason"),
    [
        ("inside the margin", 0.6, 1, 5200.0, "is not 10% better"),
        (
            "before the dwell's seconds",
            0.3,
            1,
            9000.0,
            "dwell: ran 0.3 s, its prediction checked 1 time(s)",
        ),
        (
            "before enough checks of the chosen policy",
            0.6,
            2,
            9000.0,
            "dwell: ran 0.6 s, its prediction checked 1 time(s); a switch needs 0.5 s and 2",
        ),
    ],
)
def test_after_a_switch_a_forecast_short_of_the_margin_or_the_dwell_does_not_switch(
    why: str, at: float, needs: int, second: float, reason: str
) -> None:
    c = Cluster([1.0, 2.0, 4.0])
    p = make_policy("auto", {"warmup": "", "dwell_s": 0.5, "dwell_checks": needs})
    state = switched(c, p, at)  # the window from the switch is checked at this forecast
    before = state
    decisions, state = p.update(
        forecast(c.now, pred("asp", 5000), pred("bsp", second)), state, c.view()
    )
    assert list(decisions) == [], why
    assert running(state) == "asp" and state.inner == before.inner and len(state.switches) == 1
    assert state.last is not None and state.last.chosen is None and reason in state.last.why


def test_the_goodput_counts_efficiency_and_unknown_or_excluded_predictions_are_ignored() -> None:
    c = Cluster([1.0, 2.0, 4.0])
    p = make_policy("auto", {"dwell_s": 0.0, "candidates": "lbbsp,asp,ssp:staleness=2"})
    state, _ = warm(c, p, 0.1, forecast(0.0, pred("lbbsp", 5000)))
    fc = forecast(
        c.now,
        pred("lbbsp", 5000),
        pred("asp", 9000, efficiency=0.5),  # worth 4500
        pred("ssp", 9000),  # ssp with its default staleness is not a candidate here
        pred("diloco", 9000),
        pred("nonesuch", 9000),
        pred("ssp", 5500, staleness=2),  # only 10 % better
    )
    decisions, state = p.update(fc, state, c.view())
    assert list(decisions) == [] and running(state) == "lbbsp"
    assert state.last is not None
    assert [(s.label, s.goodput) for s in state.last.scored] == [
        ("ssp:staleness=2", 5500.0),
        ("lbbsp", 5000.0),
        ("asp", 4500.0),
    ]


def test_a_switch_flushes_what_is_buffered_and_puts_every_plan_back_to_its_default() -> None:
    c = Cluster([1.0, 2.0, 4.0], codec="int8")
    p = make_policy("auto", {"dwell_s": 0.0, "start": "hps"})
    state, _ = warm(c, p, 0.5, forecast(0.0, pred("hps", 5000)))
    assert {f.batch_size for f in c.workers.values()} != {BATCH}  # hps moved the batches
    # the fastest worker pushes into a round the others have not finished
    ev = c.push(0)
    decisions, state = p.update(ev, state, c.view())
    c.carry_out(decisions, True)
    assert c.groups
    decisions, state = p.update(
        forecast(c.now, pred("hps", 5000), pred("ssp", 9000)), state, c.view()
    )
    assert running(state) == "ssp"
    decisions = list(decisions)
    assert decisions[0] == Flush(normalize=True)
    assert SetStage("main") in decisions
    plans = {d.worker: d.fields for d in decisions if isinstance(d, SetPlan)}
    assert sorted(plans) == sorted(c.workers)
    for fields in plans.values():
        assert Plan().merge(fields) == Plan(batch_size=BATCH, codec="int8")
    c.carry_out(decisions, False)
    assert not c.groups and {f.batch_size for f in c.workers.values()} == {BATCH}


def test_after_asp_ran_ahead_a_switch_to_bsp_starts_every_worker_together() -> None:
    c = Cluster([1.0, 1.0, 4.0])
    p = make_policy("auto", {"dwell_s": 0.0, "start": "asp", "warmup": ""})
    state, _ = warm(c, p, 0.5, forecast(0.0, pred("asp", 5000)))
    clocks = {w: f.clock for w, f in c.workers.items()}
    assert clocks[0] >= clocks[2] + 10  # asp let the fast ones run ahead
    for w in c.workers:  # a moment where everyone waits
        c.workers[w] = dataclasses.replace(c.workers[w], waiting=True)
    plain, _ = make_policy("bsp").update(Tick(c.now), None, c.view())
    assert {d.worker for d in plain if isinstance(d, Release)} == {2}  # bsp alone holds 0, 1
    decisions, state = p.update(
        forecast(c.now, pred("asp", 5000), pred("bsp", 9000)), state, c.view()
    )
    c.carry_out(decisions, False)
    assert running(state) == "bsp"
    assert {d.worker for d in decisions if isinstance(d, Release)} == {0, 1, 2}
    assert {w: f.clock + state.offsets.get(w, 0) for w, f in c.workers.items()} == {
        w: clocks[0] for w in c.workers
    }
    # a later joiner starts at the slowest levelled clock, and rounds go on: each flush is one
    # round of everyone's pushes
    out, state = drive(c, p, state, 1.0, {0.7: "join:3:1.0"})
    assert isinstance(state, AutoState)
    assert c.workers[3].clock + state.offsets.get(3, 0) >= clocks[0]
    flushes = sum(1 for ds in out for d in ds if isinstance(d, Flush))
    assert flushes >= 5
    inner = {w: f.clock + state.offsets.get(w, 0) for w, f in c.workers.items()}
    assert max(inner.values()) - min(inner.values()) <= 1


def test_a_policy_that_fails_to_start_leaves_the_old_one(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken() -> Policy:
        def init(view: ClusterView) -> None:
            raise RuntimeError("cannot start on this cluster")

        return Policy("broken", init, lambda e, s, v: ((), s), {})

    monkeypatch.setitem(registry._REGISTRY, "broken", broken)
    c = Cluster([1.0, 2.0, 4.0])
    p = make_policy("auto", {"dwell_s": 0.0, "candidates": "lbbsp,broken,asp"})
    state, _ = warm(c, p, 0.3, forecast(0.0, pred("lbbsp", 5000)))
    before = state
    fc = forecast(c.now, pred("lbbsp", 5000), pred("broken", 9000), pred("asp", 5100))
    decisions, state = p.update(fc, state, c.view())
    assert list(decisions) == []
    assert running(state) == "lbbsp" and state.inner == before.inner
    assert state.last is not None and "broken failed to start" in state.last.why
    assert "cannot start on this cluster" in state.last.why
    # it keeps deciding as lbbsp, and the broken candidate is not tried again within the dwell
    out, state = drive(c, p, state, 0.6)
    assert any(isinstance(d, Flush) for ds in out for d in ds)
    decisions, state = p.update(fc, state, c.view())
    assert list(decisions) == [] and state.last is not None
    assert [s.label for s in state.last.scored] == ["asp", "lbbsp"]


def test_a_candidate_that_delivered_less_than_predicted_is_discounted() -> None:
    """lbbsp is predicted right; hps, once chosen, delivers far less than its prediction. At the
    next forecast hps still looks 10 % better than lbbsp by the raw predictions, but counts for
    what it delivered of its prediction (its ratio), and auto goes back to lbbsp."""
    p = make_policy("auto", {"dwell_s": 0.0, "candidates": "lbbsp,hps"})
    dry = Cluster([1.0, 2.0, 4.0])  # the same run once, to predict lbbsp's throughput right
    st = drive(dry, p, start(p, dry), 1.0)[1]
    rate = st.window_samples / 1.0
    c = Cluster([1.0, 2.0, 4.0])
    state = start(p, c)
    decisions, state = p.update(forecast(0.0, pred("lbbsp", rate)), state, c.view())
    state = drive(c, p, state, 1.0)[1]
    decisions, state = p.update(
        forecast(c.now, pred("lbbsp", rate), pred("hps", 3 * rate)), state, c.view()
    )
    c.carry_out(decisions, False)
    assert running(state) == "hps"
    assert state.errors.error_for("lbbsp") == pytest.approx(0.0, abs=1e-9)
    state = drive(c, p, state, 2.0)[1]
    ratio = state.window_samples / 1.0 / (3 * rate)
    assert ratio < 0.5  # hps delivered about lbbsp's rate, not three times it
    decisions, state = p.update(
        forecast(c.now, pred("lbbsp", rate), pred("hps", 1.1 * rate)), state, c.view()
    )
    assert state.last is not None
    scored = {s.label: s for s in state.last.scored}
    assert scored["hps"].error == pytest.approx(1 - ratio)
    assert scored["hps"].discounted == pytest.approx(1.1 * rate * ratio)
    assert scored["lbbsp"].error == pytest.approx(0.0, abs=1e-9)
    assert scored["lbbsp"].discounted == pytest.approx(rate)
    assert running(state) == "lbbsp" and state.last.chosen == "lbbsp"
    assert any(isinstance(d, SetPlan) for d in decisions)
    # a candidate never run takes the model's median shortfall (lbbsp's 0 and hps's)
    assert state.errors.error_for("asp") == pytest.approx((1 - ratio) / 2)


def test_the_error_log_discounts_shortfalls_by_their_median_and_never_credits() -> None:
    log = ErrorLog()
    assert log.error_for("asp") == 0.0  # nothing checked: the prediction as it is
    log = log.add("asp", 1500.0, 1000.0)  # beat its prediction: not discounted, not credited
    assert log.error_for("asp") == 0.0
    log = log.add("asp", 300.0, 1000.0)  # one bad window (a switch's transient) ...
    log = log.add("asp", 900.0, 1000.0)
    assert log.error_for("asp") == pytest.approx(0.1)  # ... does not rule alone: the median
    assert log.error_for("bsp") == pytest.approx(0.1)  # never run: the model's
    log = log.add("bsp", 0.0, 1000.0)
    assert log.error_for("bsp") == 1.0 and log.error_for("asp") == pytest.approx(0.1)


def test_a_policy_that_delivers_what_was_predicted_is_not_left_for_the_one_before() -> None:
    """lbbsp -> asp on a forecast; asp then delivers what was predicted of it. The same forecast
    again is no new evidence: auto stays on asp (the old rule charged asp for its own check
    and could send it back)."""
    c = Cluster([1.0, 2.0, 4.0])
    p = make_policy("auto", {"warmup": "", "dwell_s": 0.0})
    state = start(p, c)
    state = drive(c, p, state, 0.2)[1]
    decisions, state = p.update(
        forecast(c.now, pred("lbbsp", 1000.0), pred("asp", 2000.0)), state, c.view()
    )
    c.carry_out(decisions, False)
    assert running(state) == "asp"
    t0 = c.now
    state = drive(c, p, state, 1.2)[1]
    delivered = state.window_samples / (c.now - t0)
    for _ in range(3):
        decisions, state = p.update(
            forecast(c.now, pred("lbbsp", 1000.0), pred("asp", delivered)), state, c.view()
        )
        assert list(decisions) == [] and running(state) == "asp"
        state = drive(c, p, state, c.now + 0.5)[1]
    assert len(state.switches) == 1


def test_the_state_round_trips_through_a_checkpoint_and_describes_itself() -> None:
    c = Cluster([1.0, 1.0, 4.0])
    p = make_policy("auto", {"dwell_s": 0.0, "start": "asp", "warmup": ""})
    state, _ = warm(c, p, 0.5, forecast(0.0, pred("asp", 5000)))
    decisions, state = p.update(
        forecast(c.now, pred("asp", 5000), pred("ssp", 9000)), state, c.view()
    )
    c.carry_out(decisions, False)
    state = drive(c, p, state, 0.8, {0.6: "join:3:2.0"})[1]
    assert isinstance(state, AutoState) and state.offsets and state.switches
    tree = policy_state_tree("auto", state)
    assert tree is not None
    back = revive_policy_state("auto", 0.0, p.init(c.view()), tree)
    assert back == state
    moved = revive_policy_state("auto", 100.0, p.init(c.view()), tree)
    assert moved.since == state.since + 100.0 and moved.switches[0][0] == state.switches[0][0] + 100
    # the restored state decides as the original
    twin = Cluster([1.0])
    twin.__dict__.update(
        {k: (dict(v) if isinstance(v, dict) else v) for k, v in c.__dict__.items()}
    )
    got, _ = drive(c, p, state, 1.0)
    want, _ = drive(twin, p, back, 1.0)
    assert got == want
    described = describe_state(state)
    json.dumps(described)
    assert described["policy"] == "ssp" and described["switches"][0]["to"] == "ssp"
    assert described["last_choice"]["chosen"] == "ssp"
    assert [r["policy"] for r in described["last_choice"]["candidates"]] == ["ssp", "asp"]
    assert "offset" in described["inner"]  # ssp's own state, described


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"candidates": "bsp,diloco"}, "outer optimizer"),
        ({"candidates": "bsp,auto"}, "cannot run inside itself"),
        ({"candidates": "bsp,nonesuch"}, "unknown candidate 'nonesuch'"),
        ({"candidates": "bsp,ssp:staleness=-1"}, "staleness"),
        ({"start": "asp", "candidates": "bsp,ssp"}, "must be one of the candidates"),
        ({"margin": -0.1}, "margin must be >= 0"),
        ({"dwell_checks": -1}, "dwell_checks must be an int >= 0"),
        ({"warmup": "bsp", "candidates": "lbbsp,asp"}, "warmup 'bsp' must be one of"),
        ({"warmup_s": -1}, "warmup_s must be >= 0"),
    ],
)
def test_bad_parameters_are_refused_with_what_is_valid(
    params: dict[str, Any], message: str
) -> None:
    with pytest.raises(PolicyError, match=message):
        make_policy("auto", params)


def test_auto_reads_forecasts_and_the_evaluations_its_candidates_read() -> None:
    assert make_policy("auto").reads_forecasts
    assert make_policy("auto").reads_evals  # ashl is a default candidate
    assert not make_policy("auto", {"candidates": "lbbsp,asp"}).reads_evals
    assert make_policy("auto").describe()["params"]["candidates"].split(",") == [
        "bsp",
        "ssp",
        "asp",
        "lbbsp",
        "hps",
        "adsp",
        "ashl",
        "dssp",
    ]
