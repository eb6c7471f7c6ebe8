"""H-PS on a real daemon: memory caps shape batches; pipelined workers wait less."""

from __future__ import annotations

import pytest

from hetd.local.procs import stop_processes

pytestmark = pytest.mark.slow


async def test_worker_with_half_the_memory_gets_the_smaller_batch(cluster) -> None:  # type: ignore[no-untyped-def]
    # rho 0.8 x 25 MB / 1 MB per sample caps the small worker at 20 of the 64 samples a round.
    c = await cluster(
        "hps", {"global_batch": 64, "mem_per_sample": 1e6, "quantize": False}, global_batch=64
    )
    await c.spawn(1.0, 0.02, "--emulate-memory", str(100_000_000))
    await c.spawn(1.0, 0.02, "--emulate-memory", str(25_000_000))
    await c.wait_for(lambda: len(c.engine.members.facts) == 2, 60, "2 workers to join")
    await c.wait_for(lambda: c.engine.view().min_clock() >= 8, 60, "8 rounds")
    batches = {
        c.engine.members.facts[w].free_mem: c.engine.members.plans[w].batch_size
        for w in c.engine.members.facts
    }
    assert batches[25_000_000] <= 20
    assert batches[25_000_000] < batches[100_000_000]
    assert sum(batches.values()) == 64


async def mean_idle(cluster, pipeline: bool) -> float:  # type: ignore[no-untyped-def]
    c = await cluster("hps", {"pipeline": pipeline, "quantize": False})
    # One worker, so that only its own push and reply can make it wait (two would also wait for
    # each other at the round barrier, which pipelining does not hide).
    await c.spawn(1.0, 0.03, "--emulate-bandwidth", "2MB/s")
    await c.wait_for(lambda: len(c.engine.members.facts) == 1, 60, "the worker to join")
    # Past start-up (compilation, the first plan) before measuring.
    await c.wait_for(lambda: c.engine.view().min_clock() >= 8, 60, "8 rounds")
    start = {
        w: (c.engine.members.stats[w].worker_idle_s, c.engine.members.stats[w].pushes)
        for w in c.engine.members.facts
    }
    await c.wait_for(lambda: c.engine.view().min_clock() >= 40, 90, "40 rounds")
    idle = pushes = 0.0
    for w, (i0, p0) in start.items():
        idle += c.engine.members.stats[w].worker_idle_s - i0
        pushes += c.engine.members.stats[w].pushes - p0
    assert all(bool(c.engine.members.plans[w].pipeline) == pipeline for w in c.engine.members.facts)
    await stop_processes(c.procs)
    await c.daemon.stop()
    return idle / pushes


async def test_pipelined_workers_idle_less(cluster) -> None:  # type: ignore[no-untyped-def]
    plain = await mean_idle(cluster, pipeline=False)
    piped = await mean_idle(cluster, pipeline=True)
    print(f"mean idle per push: plain {plain * 1e3:.2f} ms, pipelined {piped * 1e3:.2f} ms")
    assert piped < plain, (piped, plain)
