"""A pserver's node: its slice saved at each checkpoint entry, its parts file, a restart from disk.

The log and the pushes are a real engine's (``test_pserver_engine``'s run: the bundled MLP, three
workers pushing real gradients, one in int8, under ``asp`` with stale drops, a guard refusal, a
duplicate and a checkpoint). Two nodes replay it on the partition map's two slices; one is
killed past the checkpoint (its memory gone, its directory kept), after it consumed parts of
pushes logged after the checkpoint, and a torn record is left at its parts file's end. Restarted
on its directory it stands at the checkpoint's position with every part it had reported held, and
both end with the engine's store bit for bit.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from hetd.pserver import disk
from hetd.pserver.link import LinkError, encode_tensors
from hetd.pserver.log import CheckpointEntry, Record, RestoreEntry
from hetd.pserver.node import Node, NodeError, Setup
from hetd.pserver.partition import join, partition, split
from tests.unit.test_pserver_engine import BLOCK, OPTIMIZERS, PARAMS, _run


def _setup(outer: str, servers: int = 2, epoch: str = "e1", start: int = 0) -> Setup:
    pmap = partition({k: v.shape for k, v in PARAMS.items()}, servers, block_bytes=BLOCK)
    return Setup(pmap, OPTIMIZERS["adam"].specs()[0], outer, True, False, epoch, start)


def test_a_node_killed_past_a_checkpoint_restarts_from_its_directory(tmp_path: Path) -> None:
    run = _run("asp", OPTIMIZERS["adam"], pushes=18, seed=7)
    setup = _setup(run.outer_spec)
    pmap = setup.pmap
    dirs = [tmp_path / f"slice{s}" for s in range(2)]
    nodes = [Node(dirs[s], s, setup, split(pmap, PARAMS)[s], sync=False) for s in range(2)]
    for key, (_, tensors) in run.pushes.items():  # every part first, as a pusher sends them
        for s in range(2):
            assert nodes[s].receive(*key, encode_tensors(split(pmap, tensors)[s]))
    key = next(iter(run.pushes))
    assert not nodes[0].receive(*key, encode_tensors(split(pmap, run.pushes[key][1])[0]))
    ckpt = next(r.position for r in run.records if isinstance(r.entry, CheckpointEntry))
    crash = ckpt + 5  # past the checkpoint: parts consumed since
    for node in nodes:
        node.offer([r for r in run.records if r.position <= crash])
        assert node.advance() == [ckpt]  # saved there, and that position is durable
        assert node.position == crash and node.durable == ckpt
    assert len(disk.listing(dirs[1])) == 1
    held = nodes[1].slice.held()
    nodes[1].parts.close()  # killed: nothing else of its memory survives
    with open(dirs[1] / disk.WAL, "ab") as fh:
        fh.write((1000).to_bytes(4, "big") + b"torn")  # a crash mid-append
    again = Node(dirs[1], 1, setup, sync=False)  # no initial tensors: it has a saved slice
    assert again.position == ckpt and again.slice.store.version == next(
        r.version for r in run.records if r.position == ckpt
    )
    assert again.slice.held() > held  # the parts consumed after the checkpoint came back
    for node in (nodes[0], again):
        node.offer(run.records)
        node.advance()
        assert node.position == run.records[-1].position and node.slice.held() == 0
    got = join(pmap, [nodes[0].params(), again.params()])
    end = dict(run.engine.store.snapshot().tensors)
    assert all(got[k].tobytes() == end[k].tobytes() for k in end)
    assert sum(int(np.sum(got[k] != PARAMS[k])) for k in got) > 0  # it trained
    for node in (nodes[0], again):
        node.close()

    # the head restarted from its file written at the checkpoint: a new life whose records begin
    # after that position with a restore entry naming it; the node goes back and loads its slice
    entry = next(r for r in run.records if r.position == ckpt)
    assert isinstance(entry.entry, CheckpointEntry)
    life = _setup(run.outer_spec, epoch="e2", start=ckpt)
    back = Node(dirs[0], 0, life, sync=False)
    assert back.position == ckpt
    back.offer([Record(ckpt + 1, entry.version, RestoreEntry(entry.entry.ref))])
    back.advance()
    saved = disk.find(dirs[0], entry.entry.ref)
    assert saved is not None and back.slice.store.version == entry.version
    assert all(
        back.params()[k].tobytes() == saved.slice.params[k].tobytes() for k in saved.slice.params
    )
    back.close()


def test_a_node_refuses_what_it_cannot_start_from_or_hold(tmp_path: Path) -> None:
    setup = _setup("sgd:lr=1")
    with pytest.raises(NodeError, match="no saved slice"):
        Node(tmp_path / "empty", 0, setup, sync=False)
    node = Node(tmp_path / "s0", 0, setup, split(setup.pmap, PARAMS)[0], sync=False)
    wrong = encode_tensors(split(setup.pmap, PARAMS)[1])
    with pytest.raises(LinkError, match="not the expected parts"):
        node.receive(1, 1, wrong)
    part = encode_tensors(split(setup.pmap, PARAMS)[0])
    key = next(iter(part))
    part[key] = [part[key][0], part[key][1], part[key][2][:-4]]  # a short buffer
    with pytest.raises(LinkError, match="bytes for shape"):
        node.receive(1, 1, part)
    assert node.slice.held() == 0 and not list(node.parts.read())  # nothing kept or written
    node.close()


def test_tensors_cross_the_link_as_they_are() -> None:
    from hetd.core.store import Int8
    from hetd.pserver.link import decode_tensors

    q = np.arange(-6, 6, dtype=np.int8).reshape(3, 4)
    sent = {
        "count": np.array(7, np.int32).astype(np.float32),  # 0-d stays 0-d
        "rows": np.arange(12, dtype=np.float32).reshape(4, 3)[1:3],
        "q": Int8(q, np.float32(0.25)),
    }
    got = decode_tensors(encode_tensors(sent), {"count": (), "rows": (2, 3), "q": (3, 4)})
    assert np.shape(got["count"]) == () and float(got["count"]) == 7.0
    assert np.array_equal(got["rows"], sent["rows"])
    g = got["q"]
    assert isinstance(g, Int8) and np.array_equal(g.q, q) and g.scale == np.float32(0.25)
    with pytest.raises(LinkError, match="shape"):
        decode_tensors(encode_tensors(sent), {"count": (1,), "rows": (2, 3), "q": (3, 4)})
