"""Releases pulled from the pservers: what a slice keeps for pulls (the version in force at each
position, the newest few, none across a restore), the head's ``params_at`` naming a snapshot's
slices, a worker's join of the slices back into the model, and a slice frame read strictly."""

from __future__ import annotations

import numpy as np
import optax
import pytest

from hetd.core.store import Store
from hetd.protocol import frames, pslink
from hetd.protocol.frames import ParamsAt
from hetd.protocol.params import param_hash
from hetd.pserver.log import DecisionLog
from hetd.pserver.partition import partition, split
from hetd.pserver.slice import SliceState
from hetd.server.pserver_pulls import Pointers
from workers.parts import read_map
from workers.pulls import join, slice_shapes

SHAPES = {"emb": (40, 3), "w": (3, 2), "b": (2,), "t": ()}
PARAMS = {
    k: np.linspace(-1, 1, int(np.prod(s)), dtype=np.float32).reshape(s) for k, s in SHAPES.items()
}
PMAP = partition(SHAPES, 2, block_bytes=200)  # emb (480 bytes) in blocks over both


def _update(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {k: rng.standard_normal(s).astype(np.float32) for k, s in SHAPES.items()}


def _pair(keep: int) -> tuple[SliceState, SliceState]:
    """Pserver 0's slice kept for pulls, and the same slice read as it goes (keeping nothing)."""
    part = split(PMAP, PARAMS)[0]
    made = [SliceState(PMAP, 0, part, optax.sgd(0.1), combine=True, keep=k) for k in (keep, 0)]
    return made[0], made[1]


def test_a_slice_keeps_the_version_in_force_at_each_position_the_newest_few() -> None:
    kept, plain = _pair(keep=2)
    log = DecisionLog()
    assert kept.release_at(0) is not None and kept.release_at(0)[0] == 0  # the start
    seen: dict[int, tuple[int, dict[str, np.ndarray]]] = {}  # position -> what was in force
    for pid in range(1, 5):
        records = [log.apply(0, pid, "grad", 1.0), log.drop(1, pid), log.step()]
        for sl in (kept, plain):
            sl.receive(0, pid, split(PMAP, _update(pid))[0])
            sl.offer(records)
            sl.advance()
        assert kept.release_at(log.position - 1) is not None  # (a drop: the older version)
        seen[log.position] = (plain.store.version, plain.params())
    assert [(p, v) for p, v, _ in kept.kept] == [(9, 3), (12, 4)]  # the newest two
    for position in (9, 10, 11, 12):  # each the version in force there, bit for bit
        version, tensors = kept.release_at(position)  # type: ignore[misc]
        want_version, want = seen[9 if position < 12 else 12]
        assert version == want_version
        assert all(tensors[k].tobytes() == want[k].tobytes() for k in want)
    assert kept.release_at(6) is None  # no longer kept: the worker asks the head again
    assert kept.release_at(13) is None  # not reached yet
    assert all(not t.flags.writeable for _, _, t in kept.kept for t in t.values())


def test_a_restore_forgets_every_release_kept_before_it() -> None:
    kept, _ = _pair(keep=4)
    log = DecisionLog()
    kept.receive(0, 1, split(PMAP, _update(1))[0])
    kept.offer([log.checkpoint("p1"), log.apply(0, 1, "grad", 1.0), log.step()])
    kept.advance()
    assert [v for _, v, _ in kept.kept] == [0, 1]
    kept.offer([log.restore("p1", 0, {})])  # back to version 0: a new history from here
    kept.advance()
    assert [(p, v) for p, v, _ in kept.kept] == [(4, 0)] and kept.release_at(3) is None


def test_the_heads_params_at_names_the_snapshots_slices_and_a_worker_joins_them_back() -> None:
    store = Store(PARAMS, optax.sgd(0.1))
    store.hashes = True
    log = DecisionLog()
    log.apply(0, 1, "grad", 1.0)
    pointers = Pointers(PMAP, log)
    snap = store.snapshot()
    frame = pointers(snap)
    assert pointers(snap) is frame  # once per version
    named = frames.decode(frame)
    assert isinstance(named, ParamsAt)
    assert (named.version, named.position, named.hash) == (0, 1, snap.hash)
    slices = split(PMAP, snap.tensors)
    assert named.slices == tuple(param_hash(s) for s in slices)
    shapes, cuts, servers = read_map(PMAP.to_dict())
    assert slice_shapes(shapes, cuts, servers) == [PMAP.slice_shapes(s) for s in range(2)]
    joined = join([{k: np.array(v) for k, v in s.items()} for s in slices], shapes, cuts)
    assert sorted(joined) == sorted(PARAMS)
    assert all(joined[k].shape == PARAMS[k].shape for k in PARAMS)
    assert param_hash(joined) == snap.hash


def test_a_slice_frame_is_read_back_only_as_the_pservers_parts() -> None:
    part = split(PMAP, PARAMS)[1]
    shapes = PMAP.slice_shapes(1)
    body = b"".join(bytes(s) for s in pslink.slice_frame(7, 3, part))[4:]
    msg = pslink.unpack(body)
    got = pslink.read_slice(msg, shapes)
    assert all(got[k].tobytes() == np.asarray(part[k]).tobytes() for k in shapes)
    key = next(iter(shapes))
    bad = [
        {**msg, "tensors": {k: v for k, v in msg["tensors"].items() if k != key}},  # one missing
        {**msg, "tensors": {**msg["tensors"], key: ["int8", *msg["tensors"][key][1:]]}},
        {**msg, "tensors": {**msg["tensors"], key: ["float32", [999], msg["tensors"][key][2]]}},
        {**msg, "tensors": {**msg["tensors"], key: [*msg["tensors"][key][:2], b"\0" * 3]}},
    ]
    for wrong in bad:
        with pytest.raises(pslink.FrameError):
            pslink.read_slice(wrong, shapes)
    with pytest.raises(ValueError, match="float32"):
        pslink.slice_frame(7, 3, {"x": np.zeros(3, np.float64)})
