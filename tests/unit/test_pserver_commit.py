"""A pserver's group commit: the parts that arrive together share one fsync, none is answered held
before it is durable, and a restart reads every part answered held back.

The pserver is the real one (:class:`hetd.server.pserver_proc.Pserver`) serving its parts port on
loopback, its node on a real directory (real fsyncs); eight senders, each on its own connection,
send their parts at once, as the workers of one round do, then each sends a few more in turn.
"""

from __future__ import annotations

import asyncio
import os
import threading
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest

from hetd.core.store import PLAIN_OUTER
from hetd.protocol.sockframes import FrameServer
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
    site = await FrameServer.start(ps.serve_pushers, "127.0.0.1", 0)
    port = site.port
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


async def test_parts_handed_over_are_written_in_order_and_waits_end_after_their_fsync(
    tmp_path: Path,
) -> None:
    """Parts handed to the writer thread: each wait returns only once the part is in the file
    and fsynced, the file holds them in the order handed over (byte for byte the record the
    replay reads), and a wait for parts already durable returns without an fsync."""
    parts = disk.PartsFile(tmp_path)
    commit = GroupCommit(parts)
    raw = link.encode_tensors({"w": np.ones((64, 64), np.float32)})
    firsts = [commit.submit(w, 1, raw) for w in range(4)]
    waits = [asyncio.create_task(commit.wait(n)) for n in firsts]
    later = commit.submit(9, 1, raw)  # handed over while the first batch may be being written
    await asyncio.wait_for(asyncio.gather(*waits, commit.wait(later)), 60)
    assert commit.durable == later == 5 and parts.synced == parts.written == 5
    assert 1 <= commit.syncs <= 5
    syncs = commit.syncs
    await commit.wait(later)  # nothing new: no fsync
    assert commit.syncs == syncs
    data = parts.path.read_bytes()
    body = msgpack.packb([0, 1, raw], use_bin_type=True)
    assert data.startswith(len(body).to_bytes(4, "big") + body)
    assert [(w, p) for w, p, _ in disk.read_parts(parts.path)] == [
        (0, 1),
        (1, 1),
        (2, 1),
        (3, 1),
        (9, 1),
    ]
    commit.close()


async def test_no_part_is_answered_held_while_the_fsync_that_covers_it_has_not_returned(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The real pserver with its fsyncs held back (each waits for a gate, then runs): a part is
    not answered while its fsync waits; once the fsync returns it is answered held, and it is
    in the file, where a node started on the directory (a crash right after ``held``) finds it."""
    gate = threading.Event()
    real = os.fsync

    def gated(fd: int) -> None:
        gate.wait()
        real(fd)

    setup = _setup(PLAIN_OUTER, servers=2)
    base = split(setup.pmap, PARAMS)[0]
    shapes = {k: np.shape(v) for k, v in base.items()}
    ps = Pserver(("127.0.0.1", 1), 0, tmp_path)
    ps.node = node = Node(tmp_path, 0, setup, base)
    monkeypatch.setattr(disk.os, "fsync", gated)  # (the parts file's fsyncs, from here on)
    site = await FrameServer.start(ps.serve_pushers, "127.0.0.1", 0)
    port = site.port
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        await link.send(writer, "part", worker=1, pid=1, tensors=_part(1, shapes))
        reply = asyncio.create_task(link.recv(reader))
        done, _ = await asyncio.wait({reply}, timeout=0.5)
        assert not done  # its fsync has not returned: no answer
        assert node.commit.durable == 0 and node.parts.synced == 0
        gate.set()
        answer = await asyncio.wait_for(reply, 60)
        assert answer["t"] == "held" and answer["new"] is True
        assert node.parts.synced == 1
        monkeypatch.undo()
        back = Node(tmp_path, 0, setup, base)  # the file as it stands, not closed
        assert back.slice.holding() == [(1, 1)]
        back.close()
    finally:
        gate.set()
        writer.close()
        site.close()
        node.close()


async def test_a_part_waiting_when_the_file_closes_is_written_and_fsynced_by_the_close(
    tmp_path: Path,
) -> None:
    """A node replaced (a new head life) closes its parts file with a sender still waiting: the
    close writes and fsyncs what was handed over, and the wait returns (it neither hangs nor
    fails)."""
    parts = disk.PartsFile(tmp_path)
    commit = GroupCommit(parts)
    n = commit.submit(1, 1, link.encode_tensors({"w": np.ones((8, 8), np.float32)}))
    commit.close()
    await asyncio.wait_for(commit.wait(n), 10)
    assert parts.synced == parts.written == n and parts.closed
    assert [(w, p) for w, p, _ in disk.read_parts(parts.path)] == [(1, 1)]
