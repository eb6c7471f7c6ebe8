"""Deferred evaluations (``hetd bench --mode real --evals deferred``): the engine keeps a copy of
the parameters at each point of the evaluation grid instead of evaluating; memory is bounded by a
cap past which copies go to disk; a policy that reads ``Eval`` events keeps getting them live."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import optax
import pytest

from hetd.bench.kept import KeptSnapshots
from hetd.bench.real import EvalOptions, keeper_for
from hetd.core import Engine, EngineConfig
from hetd.core.store import Snapshot, Store
from policies import ClusterView, Policy, compose, make_policy
from policies.types import Decision, Eval, Event
from tests.conftest import FakeClock


def total(snap: Snapshot) -> tuple[float, float]:
    """A stand-in for the test set: the parameters' sum and their first element."""
    return float(sum(v.sum() for v in snap.tensors.values())), float(snap.tensors["w"].flat[0])


def snap(version: int, value: float) -> Snapshot:
    return Snapshot(
        version, {"w": np.full((4, 8), value, np.float32), "b": np.zeros(8, np.float32)}
    )


def test_the_cap_holds_and_what_spilled_evaluates_as_what_stayed(tmp_path: Path) -> None:
    one = 4 * 8 * 4 + 8 * 4  # bytes of one snapshot
    kept = KeptSnapshots(cap_bytes=2 * one + one // 2, spill_dir=tmp_path)
    shared = snap(0, 0.0)
    for v in range(5):  # one buffer, rewritten: the store's snapshot memory is reused too
        shared.tensors["w"][...] = float(v)
        kept(Snapshot(v, shared.tensors), 10.0 + v)
        assert kept.memory_bytes <= kept.cap_bytes
    assert (kept.memory_bytes, kept.peak_bytes, kept.spilled, len(kept)) == (2 * one, 2 * one, 3, 5)
    (spill,) = tmp_path.iterdir()
    assert len(list(spill.iterdir())) == 3 * 2  # one .npy per tensor
    got = kept.evaluate(total)
    assert got == [(10.0 + v, 32.0 * v, float(v)) for v in range(5)]
    assert kept.memory_bytes == 0 and not list(spill.iterdir())
    kept.close()
    assert not spill.exists()


def test_copies_made_in_the_keepers_thread_keep_the_order_and_the_cap(tmp_path: Path) -> None:
    one = 4 * 8 * 4 + 8 * 4
    kept = KeptSnapshots(cap_bytes=3 * one, spill_dir=tmp_path, threaded=True)
    for v in range(6):  # the engine's snapshots are immutable: one per version
        kept(snap(v, float(v)), 10.0 + v)
    assert len(kept) == 6
    kept.wait()
    assert (kept.peak_bytes, kept.spilled) == (3 * one, 3)
    assert kept.evaluate(total) == [(10.0 + v, 32.0 * v, float(v)) for v in range(6)]
    kept.close()
    assert not list(tmp_path.iterdir())


def test_a_zero_cap_keeps_nothing_in_memory(tmp_path: Path) -> None:
    kept = KeptSnapshots(cap_bytes=0, spill_dir=tmp_path)
    kept(snap(1, 2.0), 0.5)
    assert kept.peak_bytes == 0 and kept.spilled == 1
    assert kept.evaluate(total) == [(0.5, 64.0, 2.0)]
    kept.close()


class Counting:
    """A policy wrapper that counts the Eval events it is given."""

    def __init__(self) -> None:
        self.evals = 0

    def wrap(self, inner: Policy) -> Policy:
        def update(event: Event, state: Any, view: ClusterView) -> tuple[Sequence[Decision], Any]:
            self.evals += isinstance(event, Eval)
            return inner.update(event, state, view)

        return inner._replace(update=update)


def engine(policy: Policy) -> tuple[Engine, FakeClock]:
    clock = FakeClock()
    params = {"w": np.zeros((4, 8), np.float32), "b": np.zeros(8, np.float32)}
    config = EngineConfig(batch_size=16, profile_steps=0, eval_interval_s=2.0, eval_inline=True)
    return Engine(Store(params, optax.sgd(0.1)), policy, config, clock, total), clock


def test_deferred_keeps_the_grid_and_evaluates_it_as_live_would() -> None:
    count = Counting()
    live, live_clock = engine(count.wrap(make_policy("asp")))
    deferred, clock = engine(make_policy("asp"))
    kept = KeptSnapshots()
    deferred.evaluations.keep(kept, deferred.host.policy)
    for k in range(1, 5):
        for e, c in ((live, live_clock), (deferred, clock)):
            e.store.restore(
                {"w": np.full((4, 8), float(k), np.float32), "b": np.ones(8, np.float32)},
                e.store.state()[1],
                k,
            )
            c.t += 2.0
            e.tick()
    assert not deferred.evaluations.evals and len(kept) == 4  # nothing evaluated during the run
    assert count.evals == 4  # the live engine's policy saw each evaluation
    got = [(t - deferred.started_at, loss, acc) for t, loss, acc in kept.evaluate(total)]
    assert got == live.evaluations.evals


def test_a_policy_that_reads_evals_is_evaluated_live() -> None:
    ashl = make_policy("ashl")
    assert ashl.reads_evals and not make_policy("asp").reads_evals
    assert compose(make_policy("bsp"), ashl).reads_evals
    assert keeper_for(ashl, EvalOptions("deferred")) is None
    assert keeper_for(make_policy("asp"), EvalOptions("live")) is None
    assert isinstance(keeper_for(make_policy("asp"), EvalOptions("deferred")), KeptSnapshots)
    count = Counting()
    e, clock = engine(count.wrap(ashl))
    with pytest.raises(ValueError, match="reads Eval events"):
        e.evaluations.keep(KeptSnapshots(), e.host.policy)
    clock.t += 2.0
    e.tick()
    assert count.evals == 1 and len(e.evaluations.evals) == 1


def test_the_real_benchs_recorder_keeps_what_the_policy_reads() -> None:
    """The real bench watches the running policy through its Recorder: the wrapped policy must
    still say which events it reads, or ashl's evaluations are deferred (its stages never see
    the loss) and auto is never given a forecast (it stays on its first policy)."""
    from hetd.bench.real import Recorder

    for name in ("ashl", "auto", "asp"):
        inner = make_policy(name)
        e, _ = engine(inner)
        wrapped = Recorder(e).wrap(inner)
        assert wrapped.update is not inner.update and wrapped.name == inner.name
        assert (wrapped.reads_evals, wrapped.reads_forecasts, dict(wrapped.params)) == (
            inner.reads_evals,
            inner.reads_forecasts,
            dict(inner.params),
        ), name
    assert make_policy("ashl").reads_evals and make_policy("auto").reads_forecasts
    assert keeper_for(Recorder(e).wrap(make_policy("ashl")), EvalOptions("deferred")) is None
