"""A worker loaded while it joins is not planned from its join: a policy built on a running cluster
(``hetd bench --mode real`` builds the run's at t = 0; a hot swap does the same) times each worker
by what its pushes show, not by the few profile steps taken at its join (issue 14: on a shared host
the first worker to join was read 4.5x slow while the others compiled)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import pytest

from policies import ClusterView, Policy
from policies.types import Decision, Event, Push
from tests.conftest import Cluster, spawn_worker

pytestmark = pytest.mark.slow  # a real daemon on loopback (and real worker processes)

BASE_STEP_S = 0.02  # s per 32 samples at slow-down 1
AT_JOIN = 8.0  # the worker's slow-down until the origin is written: the load at its join


def _observed(inner: Policy, seen: list[tuple[float, float]]) -> Policy:
    """``inner``, appending (arrival, per-sample compute) of every push to ``seen``."""

    def update(event: Event, state: Any, view: ClusterView) -> tuple[Sequence[Decision], Any]:
        if isinstance(event, Push) and event.samples > 0:
            seen.append((event.now, event.compute_s / event.samples))
        return inner.update(event, state, view)

    return Policy(inner.name, inner.init, update, inner.params)


async def test_a_swapped_in_policy_times_a_worker_by_its_pushes_not_its_loaded_join(
    cluster: Callable[..., Awaitable[Cluster]],
) -> None:
    """The worker runs at x8 until its origin (its join and profile steps: a loaded host), then
    at x1. After a few pushes at x1, adsp is swapped in: its speed for the worker is within 2x of
    what the pushes since show, where the join's profile is at least 4x off (without the
    pushes' timing the policy would plan from that)."""
    c = await cluster("bsp", profile_steps=3)
    engine = c.engine
    seen: list[tuple[float, float]] = []
    engine.host.policy = _observed(engine.host.policy, seen)
    proc = await spawn_worker(
        c.url,
        "--name",
        "loaded-at-join",
        "--emulate-slowdown",
        str(AT_JOIN),
        "--emulate-shift",
        "0:1",
        "--emulate-base-step",
        str(BASE_STEP_S),
        "--emulate-origin",
        "stdin",
        "--max-retries",
        "3",
        stdin=True,
    )
    c.procs.append(proc)
    await c.wait_for(
        lambda: any(f.profile and f.samples for f in engine.members.facts.values()),
        120.0,
        "the worker's profile and first push",
    )
    (wid,) = engine.members.facts
    joined = engine.members.facts[wid].profile
    assert joined is not None
    assert proc.stdin is not None
    proc.stdin.write(f"{time.time()!r}\n".encode())  # the load is gone: x1 from now on
    await proc.stdin.drain()
    origin = engine.clock.now()
    # the push that straddles the origin started at x8; five more are all x1
    await c.wait_for(
        lambda: sum(t > origin for t, _ in seen) >= 6, 60.0, "six pushes after the origin"
    )

    def swap() -> float:
        engine.swap_policy("adsp", {})
        profile = engine.host.state.tracks[wid].profile
        assert profile is not None and profile.source == "measured"
        return float(profile.sample_s)

    planned = await engine.queue.call(swap)
    truth = statistics.median(x for t, x in seen[-4:])
    assert joined["sample_s"] >= 4 * truth, (joined, truth)  # the join really read it slow
    assert truth / 2 <= planned <= 2 * truth, (planned, truth, joined)
