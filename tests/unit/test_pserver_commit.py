"""A pserver's group commit: the parts that arrive together share one fsync, none is answered held
before it is durable, and a restart reads every part answered held back.

The pserver is the real one (:class:`hetd.server.pserver_proc.Pserver`) serving its parts port on
loopback, its node on a real directory (real fsyncs); eight senders, each on its own connection,
send their parts at once, as the workers of one round do, then each sends a few more in turn.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import numpy as np

from hetd.core.store import PLAIN_OUTER
from hetd.pserver import disk, link
from hetd.pserver.commit import GroupCommit
from hetd.pserver.node import Node
from hetd.pserver.partition import split
from hetd.server.pserver_proc import Pserver
from tests.unit.test_pserver_engine import PARAMS
from tests.unit.test_pserver_node import _setup

SENDERS = 8
ROUNDS = 3  # parts each sender sends, one after the other


def _part(seed: int, shapes: dict[str, Any]) -> Any:
    rng = np.random.default_rng(seed)
    return link.encode_tensors(
        {k: rng.standard_normal(shape).astype(np.float32) for k, shape in shapes.items()}
    )


async def _ask(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, **fields: Any
) -> dict[str, Any]:
    await link.send(writer, "part", **fields)
    reply = await asyncio.wait_for(link.recv(reader), 60)
    assert reply["t"] == "held", reply
    return reply


async def test_parts_sent_together_share_an_fsync_and_all_come_back_after_a_restart(
    tmp_path: Path,
) -> None:
    setup = _setup(PLAIN_OUTER, servers=2)
    base = split(setup.pmap, PARAMS)[0]
    ps = Pserver(("127.0.0.1", 1), 0, tmp_path)  # (no head: nothing is reported to one)
    ps.node = node = Node(tmp_path, 0, setup, base)
    shapes = {k: np.shape(v) for k, v in base.items()}
    site = await asyncio.start_server(ps.serve_pushers, "127.0.0.1", 0)
    port = site.sockets[0].getsockname()[1]
    conns = [await asyncio.open_connection("127.0.0.1", port) for _ in range(SENDERS)]
    try:

        async def sender(worker: int) -> list[dict[str, Any]]:
            reader, writer = conns[worker]
            out = []
            for pid in range(1, ROUNDS + 1):
                tensors = _part(worker * 10 + pid, shapes)
                out.append(await _ask(reader, writer, worker=worker, pid=pid, tensors=tensors))
                # answered held: an fsync that covers its place in the file has returned
                order = [(w, p) for w, p, _ in disk.read_parts(node.parts.path)]
                assert order.index((worker, pid)) < node.parts.synced
            return out

        replies = await asyncio.gather(*(sender(w) for w in range(SENDERS)))
        parts = SENDERS * ROUNDS
        assert all(r["new"] for rs in replies for r in rs)
        assert node.parts.synced == node.parts.written == parts  # every part held is durable
        assert 1 <= node.commit.syncs < parts  # the parts that came together shared an fsync

        reader, writer = conns[0]  # a repeat: answered held, not written again
        again = await _ask(reader, writer, worker=3, pid=2, tensors=_part(32, shapes))
        assert again["new"] is False and node.parts.written == parts
    finally:
        for _, writer in conns:
            writer.close()
        site.close()
    # killed: the file as it stands (not closed); a new node on the directory holds every part
    back = Node(tmp_path, 0, setup, base)  # (no saved slice: it starts from the initial tensors)
    assert back.slice.holding() == sorted(
        (w, p) for w in range(SENDERS) for p in range(1, ROUNDS + 1)
    )
    back.close()
    node.close()


async def test_a_part_is_not_durable_before_the_fsync_that_covers_it_returns(
    tmp_path: Path,
) -> None:
    """Written parts wait; each wait returns only once ``synced`` covers its part, and a wait
    for parts already durable returns without an fsync."""
    parts = disk.PartsFile(tmp_path)
    commit = GroupCommit(parts)
    shapes = {"w": (64, 64)}
    tensors = {k: np.ones(s, np.float32) for k, s in shapes.items()}
    firsts = [parts.write(w, 1, tensors) for w in range(4)]
    assert parts.synced == 0
    waits = [asyncio.create_task(commit.wait(n)) for n in firsts]
    later = parts.write(9, 1, tensors)  # written while the first fsync is about to run
    await asyncio.gather(*waits, commit.wait(later))
    assert parts.synced == later == 5
    assert 1 <= commit.syncs <= 2
    syncs = commit.syncs
    await commit.wait(later)  # nothing new: no fsync
    assert commit.syncs == syncs
    assert [(w, p) for w, p, _ in disk.read_parts(parts.path)] == [
        (0, 1),
        (1, 1),
        (2, 1),
        (3, 1),
        (9, 1),
    ]
    parts.close()


async def test_a_part_waiting_when_the_file_closes_is_fsynced_by_the_close(tmp_path: Path) -> None:
    """A node replaced (a new head life) closes its parts file with a sender still waiting: the
    close fsyncs what is written, and the wait returns (it neither hangs nor fails)."""
    parts = disk.PartsFile(tmp_path)
    commit = GroupCommit(parts)
    n = parts.write(1, 1, {"w": np.ones((8, 8), np.float32)})
    parts.close()
    await asyncio.wait_for(commit.wait(n), 10)
    assert parts.synced == n and commit.syncs == 0
