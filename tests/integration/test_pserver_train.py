"""Real training through the pservers' data path: a daemon with two local pservers, two real
``hetd-worker`` processes that send each push's parts to the pservers and the push to the head,
and pull every full release from the pservers (the head names its log position); every push is
decided only once both pservers hold its part, both follow every decision, and their slices
saved at the daemon's checkpoint join to the head's parameters bit for bit."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path
from typing import Any

import pytest

from hetd import config as config_mod
from hetd.pserver import disk
from hetd.pserver.partition import join
from hetd.server.daemon import Daemon
from tests.conftest import make_config, spawn_worker, until

WAIT = 240.0  # s: generous, every process imports JAX on a shared 2-core machine
STEPS = 8  # pushes per worker


def _two_local_pservers(state: Path) -> config_mod.Config:
    """asp with momentum (products and sums: bit for bit whatever the cut; Adam's family is bit
    for bit only where both sides compile its division alike, see docs/design.md), int8 pushes,
    and two local pservers keeping their slices under ``state``."""
    cfg = make_config("asp", optimizer="momentum", lr=0.05, codec="int8")
    cfg = config_mod.replace(cfg, "server", admin_port=-1, stop_timeout_s=60.0)
    cfg = config_mod.replace(cfg, "store", dir=str(state / "state"), interval_s=0.0)
    return config_mod.replace(cfg, "pservers", log=True, servers=2, port=0, backend="local")


def _saved_slices(state: Path) -> list[Any]:
    """Each pserver's newest saved slice under ``state`` (the two of :func:`_two_local_pservers`)."""
    dirs = [state / "state" / "pservers" / f"slice{s}" for s in range(2)]
    return [disk.load(disk.listing(d)[0]).slice for d in dirs]


async def _pulled(worker: asyncio.subprocess.Process) -> tuple[int, str]:
    """The releases a finished worker pulled from the pservers (its log says so as it ends),
    and its log; fails when it pulled none or a slice did not match its hash."""
    assert worker.stderr is not None
    text = (await worker.stderr.read()).decode()
    assert worker.returncode == 0, text[-2000:]
    found = re.search(r"releases pulled from the pservers: (\d+)", text)
    assert found is not None, text[-2000:]
    assert "params hash mismatch" not in text, text[-2000:]
    return int(found.group(1)), text


async def _worker(port: int, steps: int, shm: bool = False) -> asyncio.subprocess.Process:
    """A real ``hetd-worker`` (verbose: its log on ``stderr``) making ``steps`` pushes; without
    ``shm`` its releases come over its socket: it pulls them from the pservers."""
    return await spawn_worker(
        f"ws://127.0.0.1:{port}",
        *("--steps", str(steps), "--max-retries", "3", "-v"),
        *(() if shm else ("--no-shm",)),
    )


async def _stop(daemon: Daemon, workers: list[asyncio.subprocess.Process]) -> None:
    for w in workers:
        if w.returncode is None:
            w.kill()
            await w.wait()
    await daemon.stop(final_checkpoint=False)


@pytest.mark.slow
async def test_two_workers_train_through_two_local_pservers_which_end_with_the_head(
    tmp_path: Path,
) -> None:
    daemon = Daemon(_two_local_pservers(tmp_path))
    port = await daemon.start()
    workers = []
    try:
        link = daemon.pservers
        assert link is not None
        await until(link.ready.is_set, "both pservers said where they take parts")
        welcome = daemon.engine.config.welcome["pservers"]
        assert len(welcome["addrs"]) == 2 and welcome["map"] == link.setup.pmap.to_dict()
        # one worker pulls its releases from the pservers; the other, on shared memory, takes
        # them from the head's ring after its first
        workers = [await _worker(port, STEPS), await _worker(port, STEPS, shm=True)]
        for w in workers:
            await asyncio.wait_for(w.wait(), WAIT)
        pulled, text = await _pulled(workers[0])
        # its releases pulled and checked (a push or two may still be unanswered when it stops)
        assert pulled >= STEPS // 2 and "params hash verified" in text
        pulled, text = await _pulled(workers[1])
        # (its join's release and its first push's may come before the daemon reads its
        # shm_ready; every later one comes through the ring)
        assert pulled <= 2 and "shared memory on" in text
        # Every push was decided with both parts in (asp applies each): none lost, none waits.
        assert link.parts.decided == 2 * STEPS and link.parts.lost == 0
        assert link.parts.waiting() == 0 and daemon.engine.store.version == 2 * STEPS
        parts = daemon.describe()["decisions"]["parts"]
        assert parts == {"decided": 2 * STEPS, "dropped": 0, "waiting": 0}
        await daemon.checkpoint()
        position = daemon.engine.store.decisions.position  # type: ignore[union-attr]
        await until(lambda: link.durable == [position] * 2, "both saved the checkpoint")
        head = dict(daemon.engine.store.snapshot().tensors)
        saved = _saved_slices(tmp_path)
        assert [s.position for s in saved] == [position] * 2
        assert [s.version for s in saved] == [2 * STEPS] * 2
        joined = join(link.setup.pmap, [s.params for s in saved])
        assert sorted(joined) == sorted(head)
        assert all(joined[k].tobytes() == head[k].tobytes() for k in head)  # bit for bit
    finally:
        await _stop(daemon, workers)


@pytest.mark.slow
async def test_a_pserver_killed_while_workers_train_comes_back_at_its_address_and_catches_up(
    tmp_path: Path,
) -> None:
    """SIGKILL one of two local pservers while two real workers train: the daemon restarts it on
    its directory, it takes its old port again, the workers send it the parts it had not
    answered, and at the end both slices join to the head's parameters bit for bit, with no push
    lost or applied twice."""
    import os
    import signal

    daemon = Daemon(_two_local_pservers(tmp_path))
    port = await daemon.start()
    workers = []
    steps = 5 * STEPS
    try:
        link, procs = daemon.pservers, daemon.pserver_procs
        assert link is not None and procs is not None
        await until(link.ready.is_set, "both pservers said where they take parts")
        addrs = list(link.addrs)
        workers = [await _worker(port, steps) for _ in range(2)]
        store = daemon.engine.store
        await until(lambda: store.version >= 4, "training under way")
        proc = procs.slots[1].proc
        assert proc is not None
        os.kill(proc.pid, signal.SIGKILL)
        at_kill = store.version
        await until(lambda: procs.slots[1].restarts == 1, "the pserver restarted")
        for w in workers:
            await asyncio.wait_for(w.wait(), WAIT)
        for w in workers:  # pulls went on across the restart: waited for, or asked again
            pulled, _ = await _pulled(w)
            assert pulled >= steps // 2
        assert at_kill < 2 * steps - 2  # pushes came after the kill: they waited for it
        assert link.addrs == addrs  # it came back where the workers send its parts
        assert link.parts.lost == 0 and store.version == 2 * steps  # none lost, none twice
        await daemon.checkpoint()
        position = daemon.engine.store.decisions.position  # type: ignore[union-attr]
        await until(lambda: link.durable == [position] * 2, "both saved the checkpoint")
        head = dict(store.snapshot().tensors)
        saved = _saved_slices(tmp_path)
        joined = join(link.setup.pmap, [s.params for s in saved])
        assert all(joined[k].tobytes() == head[k].tobytes() for k in head)  # bit for bit
    finally:
        await _stop(daemon, workers)
