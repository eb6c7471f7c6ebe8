"""Real daemon on loopback, real worker processes of different emulated speeds.

The asp tests share one daemon with three workers (x1, x2, x4): each asserts something of its own
about that run (the fast worker runs ahead, joiners are profiled, a wrong token is refused), and
none changes the daemon's policy or its workers."""

from __future__ import annotations

import signal
import time
from collections.abc import AsyncIterator

import aiohttp
import pytest
import pytest_asyncio

from tests.conftest import WORKER_TOKEN, Cluster, clusters

pytestmark = pytest.mark.slow
SHARED = pytest.mark.asyncio(loop_scope="module")  # the tests on the module's asp3 daemon
BASE_STEP = 0.05  # s per 32 samples of the asp3 workers' emulated steps (x1; x2 and x4 times it)


def clocks(engine) -> list[int]:  # type: ignore[no-untyped-def]
    return [f.clock for f in engine.members.facts.values()]


async def test_ssp_bounds_the_clock_gap_and_learns_digits(cluster) -> None:  # type: ignore[no-untyped-def]
    # The paper's gate (patience None): a worker frozen for a second on a loaded machine must not
    # count as silent here, where the bound on every active worker is what is checked.
    c = await cluster("ssp", {"staleness": 3, "patience": None})
    for slowdown in (1, 2, 4):
        await c.spawn(slowdown)
    await c.wait_for(lambda: len(c.engine.members.facts) == 3, 60, "3 workers to join")
    gaps: list[int] = []

    def progressed() -> bool:
        cl = clocks(c.engine)
        if cl:
            gaps.append(max(cl) - min(cl))
        acc = c.engine.evaluations.evals[-1][2] if c.engine.evaluations.evals else 0.0
        return min(cl, default=0) >= 40 and acc > 0.9

    await c.wait_for(progressed, 90, "40 rounds and accuracy > 0.9")
    # The gate: nobody was ever released more than s clocks ahead of the slowest, so the clocks
    # (which count one push more than a release) never drift more than s + 1 apart.
    assert c.engine.meters.max_release_gap <= 3
    assert max(gaps) <= 4
    assert c.engine.meters.max_release_gap >= 1, (
        "the fast worker never ran ahead: the test proves nothing"
    )
    assert c.engine.evaluations.evals[-1][2] > 0.9


async def test_bsp_moves_in_lockstep_and_a_killed_worker_does_not_stall_it(cluster) -> None:  # type: ignore[no-untyped-def]
    c = await cluster("bsp")
    procs = [await c.spawn(slowdown) for slowdown in (1, 2, 4)]
    await c.wait_for(lambda: len(c.engine.members.facts) == 3, 60, "3 workers to join")
    spread: list[int] = []

    def rounds() -> bool:
        cl = clocks(c.engine)
        spread.append(max(cl) - min(cl))
        return min(cl) >= 20

    await c.wait_for(rounds, 60, "20 BSP rounds")
    assert max(spread) <= 1
    assert c.engine.meters.max_release_gap == 0
    # One version per round: every push of a round is aggregated into one update.
    assert c.engine.store.version <= min(clocks(c.engine)) + 1

    # The slowest worker dies without a word: the round goes on without it once the heartbeat
    # timeout says it is gone.
    procs[2].send_signal(signal.SIGKILL)
    killed_at = time.monotonic()
    version = c.engine.store.version
    timeout = c.daemon.cfg.server.heartbeat_timeout_s
    await c.wait_for(lambda: c.engine.store.version >= version + 5, timeout + 10, "progress")
    assert time.monotonic() - killed_at <= timeout + 2
    assert len(c.engine.members.facts) == 2


async def test_a_users_own_model_plugs_in_on_both_sides(cluster) -> None:  # type: ignore[no-untyped-def]
    c = await cluster("asp", model="tests.unit.test_models:tiny_linear")
    await c.spawn(1, 0.01, "--model", "tests.unit.test_models:tiny_linear")  # the operator's word
    await c.wait_for(lambda: c.engine.applier.updates_applied >= 20, 60, "20 updates")
    # The daemon holds the plug-in's parameters and the worker pushed updates of that shape.
    assert len(c.engine.store.shapes) == 2
    assert c.engine.store.n_params == 64 * 10 + 10
    assert all(row["dropped"] == 0 for row in c.engine.workers())


async def test_an_emulated_link_carries_parameters_too(cluster) -> None:  # type: ignore[no-untyped-def]
    """``--emulate-bandwidth`` charges both directions, as the simulator does: with a link that
    needs ~0.15 s per float32 copy of the model, a round (push + parameters back) takes at least
    twice that. Slowness cannot fail this bound; a pull that skipped the link would."""
    c = await cluster("asp")
    nbytes = 4 * c.engine.store.n_params
    rate = nbytes / 0.15  # bytes/s: 0.15 s per copy
    await c.spawn(1.0, 0.001, "--emulate-bandwidth", str(int(rate)))
    await c.wait_for(lambda: c.engine.store.version >= 2, 60, "2 updates")
    start, v0 = time.monotonic(), c.engine.store.version
    await c.wait_for(lambda: c.engine.store.version >= v0 + 6, 60, "6 more updates")
    per_round = (time.monotonic() - start) / (c.engine.store.version - v0)
    assert per_round >= 2 * 0.15 * 0.9, per_round


async def test_the_profiles_link_is_the_link_not_the_daemons_join_work(cluster) -> None:  # type: ignore[no-untyped-def]
    """A join the daemon is slow to answer (0.4 s of blocking work, as a daemon busy with other
    joiners on a loaded host) must not read as a slow link: the profile times websocket pings
    (the fastest counts), and adds the emulated link's 5 ms latency each way. Its push and pull
    times once rested on the hello -> welcome round trip alone (here >= 0.2 s each)."""
    c = await cluster("asp")
    join = c.engine.join

    def slow_join(*args, **kwargs):  # type: ignore[no-untyped-def]
        time.sleep(0.4)  # blocks the daemon's loop: the welcome leaves 0.4 s late
        return join(*args, **kwargs)

    c.engine.join = slow_join
    await c.spawn(1.0, 0.001, "--emulate-latency", "0.005")
    await c.wait_for(
        lambda: any(f.profile for f in c.engine.members.facts.values()), 60, "a profile"
    )
    (profile,) = [f.profile for f in c.engine.members.facts.values()]
    assert profile is not None
    for key in ("push_s", "pull_s"):
        assert 0.005 <= profile[key] < 0.1, profile


# --- one asp run shared by the last tests (last: a module loop runs only during its own tests) ---


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def asp3() -> AsyncIterator[Cluster]:
    """One asp daemon with workers of emulated speeds x1, x2 and x4, 0.05 s per base step: a step
    takes the longer of that and the real compute, and on a loaded machine the real compute of
    one step can pass 0.08 s (x4 of 0.02 s), which made the x4 worker as fast as the x1 one. The
    x1 worker is started first and joins before the others start, so a slow start-up of its own
    (JAX's import on a busy machine) does not leave it behind them."""
    async with clusters() as make:
        c = await make("asp")
        await c.spawn(1, BASE_STEP)
        await c.wait_for(lambda: len(c.engine.members.facts) == 1, 90, "the x1 worker to join")
        for slowdown in (2, 4):
            await c.spawn(slowdown, BASE_STEP)
        await c.wait_for(lambda: len(c.engine.members.facts) == 3, 60, "3 workers to join")
        yield c


@SHARED
async def test_asp_lets_the_fast_worker_run(asp3: Cluster) -> None:
    c = asp3
    by_name: dict[str, int] = {}

    def ahead() -> bool:
        by_name.update({f.name: f.clock for f in c.engine.members.facts.values()})
        fast = next(v for k, v in by_name.items() if k.endswith("x1"))
        slow = next(v for k, v in by_name.items() if k.endswith("x4"))
        return slow >= 15 and fast >= slow + 5

    # Emulated 4x apart, the gap grows with every push under asp, whatever the start-up order
    # (a loaded machine may start the slow one first); a gate (any bound here is at most 3) would
    # hold it, and the wait would time out.
    await c.wait_for(ahead, 90, "the x1 worker 5 pushes ahead of the x4 one")


@SHARED
async def test_wrong_token_is_refused(asp3: Cluster) -> None:
    c = asp3
    joined = sorted(c.engine.members.facts)
    async with aiohttp.ClientSession() as http:
        for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": WORKER_TOKEN}):
            with pytest.raises(aiohttp.WSServerHandshakeError) as err:
                await http.ws_connect(c.url + "/v1/ws", headers=headers)
            assert err.value.status == 401
    proc = await c.spawn(1, 0.02, token="wrong")
    assert await proc.wait() == 2
    assert proc.stderr is not None
    assert b"401" in await proc.stderr.read()
    assert sorted(c.engine.members.facts) == joined  # nobody joined with a wrong token


@SHARED
async def test_joining_workers_are_profiled(asp3: Cluster) -> None:
    c = asp3
    await c.wait_for(
        lambda: all(f.profile for f in c.engine.members.facts.values()),
        60,
        "every worker's profile",
    )
    by_slowdown = {f.name.split("-x")[1]: f.profile for f in c.engine.members.facts.values()}
    fast, slow = by_slowdown["1"], by_slowdown["4"]
    assert fast is not None and slow is not None
    assert set(fast) == {"sample_s", "push_s", "pull_s", "compress_s"}
    # BASE_STEP per 32 samples, padded to at least that (a loaded machine's real compute can take
    # longer, never less); the x4 worker's profile shows it well over 2.5x slower.
    base = BASE_STEP / 32
    assert fast["sample_s"] >= base * 0.999 and slow["sample_s"] >= 4 * base * 0.999
    assert slow["sample_s"] / fast["sample_s"] > 2.5, (fast, slow)
