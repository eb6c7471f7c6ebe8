"""The DiLoCo family (docs/policies.md §13): ``diloco`` and ``diloco_async`` as tables of events ->
decisions, DyLU's local steps, and the delayed Nesterov outer optimizer against optax's Nesterov.

The engine's contract these tables follow (as in ``test_shares.py``): on a Push the pusher's clock
in the view already counts it and it is waiting; ``view.buffered`` counts the pushes buffered before
it; SetPlan is executed before releases.
"""

from __future__ import annotations

import math
from typing import Any

import jax.numpy as jnp
import numpy as np
import optax
import pytest

from hetd.zoo.outer import delayed_nesterov
from policies import ClusterView, PolicyError, WorkerFacts, make_policy
from policies.diloco import (
    finish_together_steps,
    local_steps_for,
    round_trip_s,
    staleness_factor,
)
from policies.types import Buffer, Decision, Flush, Join, Push, Release, SetPlan, Tick


def fact(w: int, clock: int = 0, waiting: bool = False, batch: int = 32, **kw: Any) -> WorkerFacts:
    return WorkerFacts(
        worker=w,
        name=f"w{w}",
        clock=clock,
        version=0,
        waiting=waiting,
        joined_at=0.0,
        batch_size=batch,
        **kw,
    )


def view_of(
    *facts: WorkerFacts, batch: int = 128, buffered: int = 0, version: int = 0
) -> ClusterView:
    return ClusterView(1.0, version, {f.worker: f for f in facts}, batch, buffered)


def push(w: int, samples: int, steps: int, compute_s: float, base: int = 0) -> Push:
    return Push(1.0, w, base, "delta", samples, steps, compute_s)


def plans(decisions: list[Decision] | Any) -> dict[int, dict[str, Any]]:
    out: dict[int, dict[str, Any]] = {}
    for d in decisions:
        if isinstance(d, SetPlan):
            out.setdefault(d.worker, {}).update(d.fields)
    return out


PROFILE = {"sample_s": 0.001, "push_s": 0.01, "pull_s": 0.01, "compress_s": 0.0}


def releases(decisions: list[Decision] | Any) -> set[int]:
    return {d.worker for d in decisions if isinstance(d, Release)}


# --- diloco ------------------------------------------------------------------------------------------


def test_diloco_announces_h_and_delta_pushes_then_waits_for_the_round() -> None:
    p = make_policy("diloco", {"H": 20})
    v = view_of(fact(0, profile=PROFILE), fact(1, profile=PROFILE))  # speeds known: H at once
    d, s = p.update(Tick(1.0), p.init(v), v)
    assert {w: (f["local_steps"], f["push_kind"]) for w, f in plans(d).items()} == {
        0: (20, "delta"),
        1: (20, "delta"),
    }
    # Worker 0 pushes round 1: buffered by its samples under group 1; worker 1 is still computing,
    # so nothing is flushed past round 0 and worker 0 waits.
    v = view_of(fact(0, 1, True), fact(1, 0))
    d, s = p.update(push(0, 20 * 64, 20, 0.2), s, v)
    assert d[0] == Buffer(float(20 * 64), group=1)
    assert [x for x in d if isinstance(x, Flush)] == [Flush(normalize=True, upto=0)]
    assert releases(d) == set()
    # Worker 1 completes round 1: flushed as the sample-weighted mean, both released.
    v = view_of(fact(0, 1, True), fact(1, 1, True), buffered=1)
    d, s = p.update(push(1, 20 * 64, 20, 0.2), s, v)
    assert Flush(normalize=True, upto=1) in d
    assert releases(d) == {0, 1}
    assert s.rounds == 1


def test_diloco_balanced_by_batch_sizes_batches_so_workers_finish_together() -> None:
    """Worker 1 takes twice as long per sample: after one round it gets a third of the batch."""
    p = make_policy("diloco", {"H": 10, "quantum": 1, "calibrate": False, "balance": "batch"})
    v = view_of(fact(0, batch=64), fact(1, batch=64))
    d, s = p.update(Tick(1.0), p.init(v), v)
    v = view_of(fact(0, 1, True, 64), fact(1, 0, False, 64))
    d, s = p.update(push(0, 640, 10, 0.64), s, v)  # 1 ms per sample
    v = view_of(fact(0, 1, True, 64), fact(1, 1, True, 64), buffered=1)
    d, s = p.update(push(1, 640, 10, 1.28), s, v)  # 2 ms per sample
    assert plans(d) == {0: {"batch_size": 85}, 1: {"batch_size": 43}}
    assert releases(d) == {0, 1}


def test_diloco_calibrates_with_one_step_rounds_until_speeds_are_known() -> None:
    """No profile: round 1 is one inner step each; its pushes size the batches, and the first
    H-step round is already balanced (not H steps of the slowest at B/N)."""
    p = make_policy("diloco", {"H": 10, "quantum": 1, "balance": "batch"})
    v = view_of(fact(0, batch=64), fact(1, batch=64))
    d, s = p.update(Tick(1.0), p.init(v), v)
    assert {w: f["local_steps"] for w, f in plans(d).items()} == {0: 1, 1: 1}
    v = view_of(fact(0, 1, True, 64), fact(1, 0, False, 64))
    d, s = p.update(push(0, 64, 1, 0.064), s, v)  # 1 ms per sample
    assert plans(d) == {0: {"local_steps": 10, "push_kind": "delta"}}  # known now
    v = view_of(fact(0, 1, True, 64), fact(1, 1, True, 64), buffered=1)
    d, s = p.update(push(1, 64, 1, 0.128), s, v)  # 2 ms per sample
    assert plans(d) == {
        0: {"batch_size": 85},
        1: {"batch_size": 43, "local_steps": 10, "push_kind": "delta"},
    }
    assert releases(d) == {0, 1}
    # a profile from the engine's exchange counts as known: a joiner with one runs H at once
    v = view_of(fact(0, 1), fact(1, 1), fact(2, profile=PROFILE))
    d, _ = p.update(Join(2.0, 2), s, v)
    assert plans(d)[2]["local_steps"] == 10


def test_diloco_without_shares_keeps_b_over_n() -> None:
    p = make_policy("diloco", {"H": 10, "shares": False})
    v = view_of(fact(0, batch=64), fact(1, batch=64))
    d, s = p.update(Tick(1.0), p.init(v), v)
    v = view_of(fact(0, 1, True, 64), fact(1, 0, False, 64))
    d, s = p.update(push(0, 640, 10, 0.64), s, v)
    v = view_of(fact(0, 1, True, 64), fact(1, 1, True, 64), buffered=1)
    d, s = p.update(push(1, 640, 10, 1.28), s, v)
    assert "batch_size" not in plans(d).get(0, {}) and "batch_size" not in plans(d).get(1, {})


def test_diloco_balanced_by_steps_keeps_b_over_n_and_gives_slow_workers_fewer_steps() -> None:
    """balance="steps": the batches stay B/N and each worker's inner steps follow its step time
    (DyLU), the fastest H; a timing within eps of the announced count changes nothing."""
    p = make_policy("diloco", {"H": 20, "calibrate": False})  # balance="steps", the default
    v = view_of(fact(0, batch=64), fact(1, batch=64), fact(2, batch=64), batch=192)
    d, s = p.update(Tick(1.0), p.init(v), v)
    assert {w: f["local_steps"] for w, f in plans(d).items()} == {0: 20, 1: 20, 2: 20}
    assert all("batch_size" not in f for f in plans(d).values())
    v = view_of(fact(0, 1, True, 64), fact(1, 0, False, 64), fact(2, 0, False, 64), batch=192)
    d, s = p.update(push(0, 20 * 64, 20, 1.28), s, v)  # 1 ms per sample
    v = view_of(
        fact(0, 1, True, 64), fact(1, 1, True, 64), fact(2, 0, False, 64), buffered=1, batch=192
    )
    d, s = p.update(push(1, 20 * 64, 20, 2.56), s, v)  # 2 ms: half as many steps, at once
    assert {w: f.get("local_steps") for w, f in plans(d).items()} == {1: 10}
    v = view_of(
        fact(0, 1, True, 64), fact(1, 1, True, 64), fact(2, 1, True, 64), buffered=2, batch=192
    )
    d, s = p.update(push(2, 20 * 64, 20, 5.12), s, v)  # 4 ms
    assert {w: f.get("local_steps") for w, f in plans(d).items()} == {2: 5}
    assert all("batch_size" not in f for f in plans(d).values())
    assert releases(d) == {0, 1, 2}
    v = view_of(fact(0, 2, True, 64), fact(1, 1, False, 64), fact(2, 1, False, 64), batch=192)
    d, s = p.update(push(0, 20 * 64, 20, 1.30), s, v)  # 1.5 % slower: no re-plan
    assert plans(d) == {}


def test_steps_that_finish_together_count_each_workers_transfers() -> None:
    """S7's shape: step times 0.1, 0.1, 0.2, 0.4 s; a round's push and pull take 0.15, 0.31,
    0.76 and 1.52 s. The fastest runs H = 50 (5.15 s with its transfers); the slow-link worker
    ends with it after 9 steps, not DyLU's 12."""
    step = {0: 0.1, 1: 0.1, 2: 0.2, 3: 0.4}
    comm = {0: 0.15, 1: 0.31, 2: 0.76, 3: 1.52}
    assert finish_together_steps(step, comm, 50) == {0: 50, 1: 48, 2: 22, 3: 9}
    assert finish_together_steps(step, {}, 50) == local_steps_for(step, 50, 1, 50)
    assert finish_together_steps({0: 0.1, 1: 0.0}, {}, 50) == {0: 50, 1: 50}  # 1: not timed
    assert finish_together_steps({0: 0.1, 1: 0.1}, {1: 9.0}, 50) == {0: 50, 1: 1}
    assert round_trip_s(2e6, 1e7) == 0.4 and round_trip_s(None, 1e7) == 0.0
    assert round_trip_s(2e6, math.inf) == 0.0


def test_a_joining_worker_gets_the_local_step_plan() -> None:
    p = make_policy("diloco", {"H": 7})
    v = view_of(fact(0, profile=PROFILE))
    _, s = p.update(Tick(1.0), p.init(v), v)
    v = view_of(fact(0, profile=PROFILE), fact(1, profile=PROFILE))
    d, _ = p.update(Join(1.0, 1), s, v)
    assert plans(d)[1]["local_steps"] == 7 and plans(d)[1]["push_kind"] == "delta"


@pytest.mark.parametrize(
    ("name", "params", "message"),
    [
        ("diloco", {"H": 0}, "H must be an int >= 1"),
        ("diloco", {"shares": "yes"}, "shares must be true or false"),
        ("diloco", {"balance": "time"}, "balance must be 'batch' or 'steps'"),
        ("diloco_async", {"h_min": 0}, "h_min must be an int >= 1"),
        ("diloco_async", {"H": 20, "max_local_steps": 10}, "max_local_steps"),
        ("diloco_async", {"outer": "nesterov"}, "valid parameters"),
    ],
)
def test_bad_parameters_say_what_is_valid(name: str, params: dict[str, Any], message: str) -> None:
    with pytest.raises(PolicyError, match=message):
        make_policy(name, params)


# --- diloco_async ------------------------------------------------------------------------------------


def test_dylu_local_steps_follow_measured_speed() -> None:
    # c = 1, 1, 2, 4 (s per step): H_i = round(H · c_min / c_i), at least h_min
    got = local_steps_for({0: 0.01, 1: 0.01, 2: 0.02, 3: 0.04}, 50, 1, 10_000)
    assert got == {0: 50, 1: 50, 2: 25, 3: 12}  # 12.5 rounds half to even
    assert local_steps_for({0: 0.01, 1: 1.0}, 50, 2, 10_000) == {0: 50, 1: 2}
    assert local_steps_for({0: 0.0, 1: 0.0}, 30, 1, 100) == {0: 30, 1: 30}  # unknown: H
    assert local_steps_for({0: 0.01, 1: 0.0}, 30, 1, 100, unknown=1) == {0: 30, 1: 1}


def test_diloco_async_runs_h_min_steps_until_a_worker_is_profiled() -> None:
    """Without a profile a worker's first delta is h_min steps, not H of an unknown (maybe very
    slow) speed; the profile re-plans it to DyLU's H_i."""
    p = make_policy("diloco_async", {"H": 40})
    slow = {"sample_s": 0.004, "push_s": 0.0, "pull_s": 0.0, "compress_s": 0.0}
    v = view_of(fact(0, profile=PROFILE), fact(1))
    d, s = p.update(Tick(1.0), p.init(v), v)
    assert {w: f["local_steps"] for w, f in plans(d).items()} == {0: 40, 1: 1}
    v = view_of(fact(0, profile=PROFILE), fact(1, profile=slow))
    d, s = p.update(Tick(2.0), s, v)
    assert plans(d) == {1: {"local_steps": 10, "push_kind": "delta"}}
    blind = make_policy("diloco_async", {"H": 40, "calibrate": False})
    v = view_of(fact(0, profile=PROFILE), fact(1))
    d, _ = blind.update(Tick(1.0), blind.init(v), v)
    assert {w: f["local_steps"] for w, f in plans(d).items()} == {0: 40, 1: 40}


def test_staleness_factor() -> None:
    assert staleness_factor(0) == 1.0
    assert staleness_factor(3) == pytest.approx(0.5)
    assert staleness_factor(-2) == 1.0
    # applied on arrival, N workers: the other N - 1 arrivals are the schedule, not staleness
    assert staleness_factor(3, workers=4) == 1.0
    assert staleness_factor(6, workers=4) == pytest.approx(0.5)


def test_diloco_async_applies_each_arrival_into_the_outer_optimizer() -> None:
    """A push becomes a one-push buffer with weight 1/√(1+τ)/N flushed at once (so the weight is
    the outer optimizer's input), and nobody is ever held."""
    p = make_policy("diloco_async", {"H": 40})
    profile = {"sample_s": 0.001, "push_s": 0.0, "pull_s": 0.0, "compress_s": 0.0}
    slow = {"sample_s": 0.004, "push_s": 0.0, "pull_s": 0.0, "compress_s": 0.0}
    v = view_of(fact(0, profile=profile), fact(1, profile=slow), version=5)
    d, s = p.update(Tick(1.0), p.init(v), v)
    assert {w: f["local_steps"] for w, f in plans(d).items()} == {0: 40, 1: 10}
    v = view_of(fact(0, 1, True, profile=profile), fact(1, profile=slow), version=5)
    d, s = p.update(push(0, 40 * 32, 40, 1.28, base=1), s, v)  # τ = 4, 3 beyond the other's 1
    assert d[0] == Buffer(0.5 / 2, group=0)
    assert d[1] == Flush(normalize=False, scale=1.0, upto=None)
    assert releases(d) == {0}
    assert plans(d) == {}  # no drift, no re-plan
    assert s.arrivals == 1


def test_diloco_async_replans_on_drift() -> None:
    p = make_policy("diloco_async", {"H": 40, "drift_patience": 2})
    profile = {"sample_s": 0.001, "push_s": 0.0, "pull_s": 0.0, "compress_s": 0.0}
    v = view_of(fact(0, profile=profile), fact(1, profile=profile))
    d, s = p.update(Tick(1.0), p.init(v), v)
    assert {w: f["local_steps"] for w, f in plans(d).items()} == {0: 40, 1: 40}
    for _ in range(3):  # worker 1 is now 4x slower per sample
        v = view_of(fact(0, profile=profile), fact(1, 1, True, profile=profile))
        d, s = p.update(push(1, 32 * 40, 40, 4 * 0.001 * 32 * 40), s, v)
    assert s.steps[1] == 10
    assert "drift" in s.replans[-1]


# --- delayed Nesterov --------------------------------------------------------------------------------


def test_delayed_nesterov_over_n_arrivals_is_one_nesterov_step_on_their_mean() -> None:
    rng = np.random.default_rng(0)
    n, lr, mu = 4, 0.7, 0.9
    params = {"w": jnp.zeros(5)}
    sync = optax.sgd(lr, momentum=mu, nesterov=True)
    dn = delayed_nesterov(lr, mu, n)
    s_sync, s_dn = sync.init(params), dn.init(params)
    w_sync = np.zeros(5, np.float32)
    w_dn = np.zeros(5, np.float32)
    for _ in range(5):
        grads = [rng.normal(size=5).astype(np.float32) for _ in range(n)]
        u, s_sync = sync.update({"w": jnp.asarray(np.mean(grads, axis=0))}, s_sync)
        w_sync = w_sync + np.asarray(u["w"])
        for g in grads:
            u, s_dn = dn.update({"w": jnp.asarray(g / n)}, s_dn)
            w_dn = w_dn + np.asarray(u["w"])
        np.testing.assert_allclose(w_dn, w_sync, rtol=1e-5, atol=1e-6)


def test_delayed_nesterov_moves_momentum_only_every_period() -> None:
    dn = delayed_nesterov(1.0, 0.5, 3)
    s = dn.init({"w": jnp.zeros(1)})
    steps = []
    for _ in range(6):
        u, s = dn.update({"w": jnp.ones(1)}, s)
        steps.append(float(u["w"][0]))
    # plain -1 twice, then -(1 + 0.5 * m) with m = 3; then m = 0.5 * 3 + 3 = 4.5
    assert steps == [-1.0, -1.0, -2.5, -1.0, -1.0, -(1 + 0.5 * 4.5)]


def test_the_outer_optimizer_follows_the_policy_and_the_inner_optimizer() -> None:
    from policies.diloco import outer_for

    # an SGD-family inner optimizer: DiLoCo's Nesterov for synchronous rounds; asynchronous deltas
    # are stale, and an outer gain above 1 (delayed Nesterov's) slowed diloco_async down
    assert outer_for("diloco", {}, 4, "sgd:lr=0.2") == "nesterov:lr=0.7,momentum=0.9"
    assert outer_for("diloco", {}, 4, "momentum") == "nesterov:lr=0.7,momentum=0.9"
    assert outer_for("diloco_async", {}, 8) == "sgd:lr=1"
    assert outer_for("diloco_async", {}, 4, "momentum") == "sgd:lr=1"
    assert outer_for("quorum", {"policy": "diloco"}, 4) == "nesterov:lr=0.7,momentum=0.9"
    # an adaptive one: plain averaging, which does not multiply its steps
    assert outer_for("diloco", {}, 4, "adam:lr=0.002") == "sgd:lr=1"
    assert outer_for("diloco_async", {}, 4, "adam") == "sgd:lr=1"
    # every other policy: plain averaging
    assert outer_for("quorum", {"policy": "bsp"}, 4) == "sgd:lr=1"
    assert outer_for("ashl", {}, 4) == "sgd:lr=1"


def test_serve_and_the_simulator_resolve_auto_in_one_place() -> None:
    from hetd import config
    from hetd.sim.scenario import load_scenario

    assert config.Config().train.outer_optimizer == "auto"
    assert load_scenario("S7").outer_optimizer == "auto"
    # (optimizer, lr, inner, worker_lr, outer, policy, params, workers), as the daemon calls it
    sgd = config.optimizers("sgd", 0.2, "", 0.0, "auto", "diloco", {}, 4)
    assert sgd[2] == "nesterov:lr=0.7,momentum=0.9"
    adam = config.optimizers("adam", 0.002, "", 0.0, "auto", "diloco", {}, 4)
    assert adam[2] == "sgd:lr=1"
    assert config.optimizers("sgd", 0.2, "adam", 0.0, "auto", "diloco", {}, 4)[2] == (
        "sgd:lr=1"  # the inner optimizer decides, not the daemon's
    )
    # diloco_async: plain averaging by default; Liu et al.'s delayed Nesterov when configured
    assert config.optimizers("sgd", 0.2, "", 0.0, "auto", "diloco_async", {}, 4)[2] == "sgd:lr=1"
    delayed = "delayed_nesterov:lr=0.7,momentum=0.9,period=4"
    assert config.optimizers("sgd", 0.2, "", 0.0, delayed, "diloco_async", {}, 4)[2] == delayed
    named = config.optimizers("adam", 0.002, "", 0.0, "nesterov:lr=0.5", "diloco", {}, 4)
    assert named[2] == "nesterov:lr=0.5"  # a configured one is kept
    assert config.optimizers("sgd", 0.2, "", 0.0, "auto")[2] == "sgd:lr=1"  # no policy


@pytest.mark.slow  # builds a daemon from a config: `make test` runs it, `make test-fast` does not
def test_hetd_serve_builds_the_family_outer_optimizer_from_the_config() -> None:
    import jax

    from hetd import config
    from hetd.server.daemon import build_engine

    def outer_state(policy: str, optimizer: str) -> int:
        cfg = config.from_mapping(
            {
                "train": {
                    "model": "mlp",
                    "model_kwargs": {"hidden": [8]},
                    "dataset": "digits",
                    "optimizer": optimizer,
                    "lr": 0.1,
                },
                "policy": {"name": policy, "params": {}},
            }
        )
        engine = build_engine(cfg)
        return len(jax.tree.leaves(engine.store.state()[1]))

    # Nesterov keeps a momentum per parameter next to SGD's (empty) state; plain averaging none
    assert outer_state("diloco", "sgd") > outer_state("ssp", "sgd")
    assert outer_state("diloco", "adam") == outer_state("ssp", "adam")


@pytest.mark.parametrize("name", ["diloco", "diloco_async"])
def test_the_family_can_compress_its_pseudo_gradients(name: str) -> None:
    p = make_policy(name, {"H": 5, "codec": "int8"})
    v = view_of(fact(0, profile=PROFILE), fact(1, profile=PROFILE))
    d, _ = p.update(Tick(1.0), p.init(v), v)
    assert {w: f["codec"] for w, f in plans(d).items()} == {0: "int8", 1: "int8"}
    plain = make_policy(name, {"H": 5})
    d, _ = plain.update(Tick(1.0), plain.init(v), v)
    assert all("codec" not in f for f in plans(d).values())  # the configuration's
    with pytest.raises(PolicyError, match="codec"):
        make_policy(name, {"codec": ""})
