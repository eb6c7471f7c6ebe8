"""The cost profile's two end-to-end terms, fitted from real runs on loopback.

Owns :func:`fit_cluster` and :func:`with_cluster`, which make their real runs with the runner they
are given (:func:`hetd.bench.real.run_real`).
:mod:`hetd.bench.calibrate` times each piece of the real path alone, in one quiet process; what it
cannot time that way is what the pieces cost together: websocket framing and copies on both sides,
the hops between the event loops and their threads, the host's scheduler when several worker
processes and the daemon share its cores. Measured here, those were most of the gap between a real
BSP round and a simulated one (docs/benchmark.md, "The cost profile"). So they are measured as the
difference between a real run and the simulator's run of the very same thing with the pieces
already charged:

Each run's step time is the median of its round periods (:func:`round_periods`): every round is a
repeat, so a load spike on the shared host moves the fit only if it covers half the run.

* ``exchange_s``: one real worker, slow-down 1, under BSP (nothing else runs): the real time per
  step minus the simulated one. Charged once per step on every worker.
* ``release_stagger_s``: all the scenario's workers at slow-down 1 under BSP, so every round
  releases all of them at once: the real round minus the simulated one (with ``exchange_s``
  charged), spread over the ``n - 1`` workers served after the first. Charged to the k-th worker
  of a batch of releases, k times.

Both use the scenario's model, data, batch, codec, optimizers and its first worker's link, so the
scenario's link model is charged in both runs and falls out of the difference. A term that comes out
negative (the simulator already charges more than the real run paid) is recorded as 0. Each run
takes a few seconds of wall time after its workers have compiled.
"""

from __future__ import annotations

import dataclasses
import itertools
import statistics
from collections.abc import Callable
from typing import Any

from hetd.bench.sweep import Runner
from hetd.sim.costs import CostProfile
from hetd.sim.loop import run_sim
from hetd.sim.results import PolicySpec, RunResult
from hetd.sim.scenario import Scenario, Stragglers, WorkerSpec

FIT_S = 4.0  # s of training measured in each real run (after every worker has pushed once)
NEVER = 2.0  # a target accuracy no run reaches: the fit runs measure steps, not accuracy
MIN_PERIODS = 8  # round periods needed for their median; fewer: the budget over the rounds


def fit_scenario(sc: Scenario, n: int, fit_s: float = FIT_S) -> Scenario:
    """``n`` copies of ``sc``'s first worker at slow-down 1 (its link kept), no shifts or
    stragglers, the scenario's per-worker batch, ``fit_s`` of budget."""
    w0 = sc.workers[0]
    worker = WorkerSpec(
        slowdown=1.0,
        bandwidth=w0.bandwidth,
        latency_s=w0.latency_s,
        memory=None,
        stragglers=Stragglers(),
    )
    return dataclasses.replace(
        sc,
        name=f"{sc.name}-fit{n}",
        workers=(worker,) * n,
        shifts=(),
        global_batch=sc.batch_per_worker * n,
        budget_s=fit_s,
        target_accuracy=NEVER,
    )


def _rounds_s(budget_s: float, pushes: int, n: int) -> float:
    """Seconds per step of one worker (BSP: per round): the budget over the rounds made."""
    rounds = pushes / n
    if rounds < 3:
        raise RuntimeError(
            f"the fit run made {pushes} pushes in {budget_s:g} s with {n} worker(s); too few "
            "to time a step (is the machine overloaded?)"
        )
    return budget_s / rounds


def round_periods(run: RunResult) -> list[float]:
    """The run's BSP round periods: the time between consecutive starts of the busy spans of each
    worker on its timeline (real mode records one span per release, the simulator one
    ``compute`` span per step), over all its workers."""
    out: list[float] = []
    for spans in run.trace.timeline.values():
        starts = sorted(t0 for t0, _, kind in spans if kind in ("busy", "compute") and t0 >= 0)
        out += [b - a for a, b in itertools.pairwise(starts) if b > a]
    return out


def _step_s(run: RunResult, n: int, budget_s: float) -> float:
    """Seconds per step of one worker (BSP: per round): the **median** of the run's round periods
    (:func:`round_periods`; each round is one repeat of the measurement), else the budget over
    the rounds made. The budget over the rounds is a mean, and one load spike on the shared host
    (another process compiling for a second) moved it by several ms: fits of ``exchange_s``
    swung from 12 to 55 ms and of ``release_stagger_s`` from 0 to 12.5 ms. The median ignores
    any spike that covers fewer than half the rounds. Not a low quantile: the simulator charges
    the term to runs on the same host under its ordinary load, whose typical round is the median
    one; a quiet-machine quantile would under-charge them."""
    mean = _rounds_s(budget_s, run.pushes, n)
    periods = round_periods(run)
    if len(periods) < MIN_PERIODS:
        return mean
    return float(statistics.median(periods))


def fit_cluster(
    sc: Scenario,
    base: CostProfile,
    run_real: Runner,
    seed: int = 0,
    progress: Callable[[str], None] | None = None,
    fit_s: float = FIT_S,
) -> tuple[float, float, dict[str, Any]]:
    """(``exchange_s``, ``release_stagger_s``, what was measured) for ``sc`` on this machine, with
    ``base`` (the pieces already timed) charged in the simulated runs; each real run, made with
    ``run_real`` (:func:`hetd.bench.real.run_real`), trains for ``fit_s`` s."""
    say = progress or (lambda _: None)
    bsp = PolicySpec("bsp")
    n = sc.n

    one = fit_scenario(sc, 1, fit_s)
    say(f"a real daemon and 1 real worker, {fit_s:g} s of BSP steps")
    real1 = _step_s(run_real(one, bsp, seed, sc.lr, lambda _: None), 1, one.budget_s)
    sim1 = _step_s(run_sim(one, bsp, seed, sc.lr, costs=base).result, 1, one.budget_s)
    exchange = max(0.0, real1 - sim1)
    about: dict[str, Any] = {
        "fit_s": fit_s,
        "step_real_1_s": real1,
        "step_sim_1_s": sim1,
    }
    stagger = 0.0
    if n > 1:
        many = fit_scenario(sc, n, fit_s)
        say(f"a real daemon and {n} real workers, {fit_s:g} s of BSP rounds")
        realn = _step_s(run_real(many, bsp, seed, sc.lr, lambda _: None), n, many.budget_s)
        with_exchange = dataclasses.replace(base, exchange_s=exchange)
        simn = _step_s(
            run_sim(many, bsp, seed, sc.lr, costs=with_exchange).result, n, many.budget_s
        )
        stagger = max(0.0, (realn - simn) / (n - 1))
        about |= {"workers": n, f"round_real_{n}_s": realn, f"round_sim_{n}_s": simn}
    return exchange, stagger, about


def with_cluster(
    profile: CostProfile,
    sc: Scenario,
    run_real: Runner,
    progress: Callable[[str], None] | None = None,
) -> CostProfile:
    """``profile`` with its end-to-end terms fitted from real runs of ``sc``'s setting
    (:func:`fit_cluster`)."""
    exchange, stagger, measured = fit_cluster(sc, profile, run_real, progress=progress)
    about = dict(profile.about) | {"cluster": measured}
    return dataclasses.replace(profile, exchange_s=exchange, release_stagger_s=stagger, about=about)
