"""Pipeline replicas under barriers, real workers through a real daemon: the engine shows the
policy a replica as one unit (its head), so a bsp round waits for one assembled push of the
replica and one push of each data-parallel worker. A replica forms under bsp, trains, survives
swaps bsp -> asp -> bsp without a stall, and when a stage dies the survivors rejoin the barrier
as data-parallel workers."""

from __future__ import annotations

from functools import partial

import pytest

from tests.integration.test_admin_cli import hetd

pytestmark = pytest.mark.slow


async def test_a_replica_is_one_participant_of_bsp_and_swaps_never_stall(cluster) -> None:  # type: ignore[no-untyped-def]
    c = await cluster("bsp", model="hetd.zoo.blocks:mlp_model")
    procs = [await c.spawn(1.0, 0.01) for _ in range(3)]
    await c.wait_for(lambda: len(c.engine.members.facts) == 3, 120, "3 workers to join")
    by_name = {f.name.split("-")[0]: w for w, f in c.engine.members.facts.items()}
    w0, w1, w2 = by_name["w0"], by_name["w1"], by_name["w2"]
    driver = c.daemon.replicas
    assert driver is not None
    await driver.form([w0, w1], [0, 1, 2], micro=16, micro_batches=2)
    # the policy sees the replica (its head) and the data-parallel worker, not stage 1
    assert set(c.engine.members.facts) == {w0, w2} and c.engine.pipelines.view == {w0: (w0, w1)}

    async def progress(steps: int, what: str) -> None:
        v, a = c.engine.store.version, driver.assembled
        dp = c.engine.members.stats[w2].applied + c.engine.members.stats[w2].buffered
        await c.wait_for(
            lambda: (
                c.engine.store.version >= v + steps
                and driver.assembled >= a + steps
                and c.engine.members.stats[w2].applied + c.engine.members.stats[w2].buffered
                >= dp + steps
            ),
            120,
            what,
        )

    await progress(4, "bsp rounds of the replica and the data-parallel worker")
    code, out, err = await hetd("replicas", url=c.admin_url)  # the operator's view
    assert code == 0 and f"{w0} > {w1}" in out, (out, err)
    # bsp: every round flushes one push of each participant, so neither runs ahead
    assert abs(c.engine.members.facts[w0].clock - c.engine.members.facts[w2].clock) <= 1
    for policy in ("asp", "bsp"):
        await c.engine.queue.call(partial(c.engine.swap_policy, policy))
        await progress(3, f"progress after the swap to {policy}")
    assert driver.aborted == 0, driver.dropped

    procs[1].kill()  # stage 1 dies under bsp: the barrier must not wait for the replica
    await c.wait_for(lambda: not driver.members and not c.engine.pipelines.view, 60, "dissolution")
    assert set(c.engine.members.facts) == {w0, w2}
    v = c.engine.store.version
    await c.wait_for(lambda: c.engine.store.version >= v + 3, 90, "bsp rounds of w0 and w2")
