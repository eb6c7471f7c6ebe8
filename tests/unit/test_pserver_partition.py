"""The partition map: whole tensors and row blocks over S pservers, balanced, the same every time,
through msgpack and back; split and join give back the very bits."""

from __future__ import annotations

from typing import Any

import msgpack
import numpy as np
import pytest

from hetd.core.store import Int8
from hetd.pserver.partition import BLOCK_BYTES, PartitionMap, join, partition, split

MB = 1 << 20


def test_small_tensors_stay_whole_and_big_ones_are_cut_into_blocks_of_at_least_the_block_size():
    shapes = {"emb": (50_000, 64), "w": (256, 256), "b": (256,), "scale": ()}  # emb: 12.8 MB
    pmap = partition(shapes, 3)
    emb = [p for p in pmap.parts if p.path == "emb"]
    assert len(emb) == 12_800_000 // BLOCK_BYTES == 3
    assert all(not p.whole and p.nbytes >= BLOCK_BYTES - 64 * 4 for p in emb)
    assert [(p.start, p.stop) for p in emb] == [(0, 16666), (16666, 33333), (33333, 50000)]
    assert {p.path for p in pmap.parts if p.whole} == {"w", "b", "scale"}
    # a tensor under twice the block size is not cut: a block never falls below the size
    assert all(p.whole for p in partition({"x": (2 * BLOCK_BYTES // 4 - 1,)}, 4).parts)
    # the parts do not depend on S (a checkpoint per part loads under another S)
    assert [p.key for p in partition(shapes, 1).parts] == [p.key for p in pmap.parts]


def test_bytes_are_balanced_and_the_map_is_deterministic():
    rng = np.random.default_rng(0)
    shapes = {f"layer{i}/w": (int(rng.integers(1, 600)), 1024) for i in range(40)}
    shapes["emb"] = (32_000, 512)
    pmap = partition(shapes, 4, block_bytes=MB)
    assert sum(pmap.loads()) == sum(4 * int(np.prod(s)) for s in shapes.values())
    assert pmap.imbalance() < 1.05
    # the same shapes in another order: the same map
    again = partition(dict(reversed(list(shapes.items()))), 4, block_bytes=MB)
    assert again == pmap
    # one pserver owns everything at S = 1
    assert set(p.server for p in partition(shapes, 1).parts) == {0}


def test_whole_tensors_only_when_block_bytes_is_zero():
    pmap = partition({"emb": (100_000, 64), "b": (3,)}, 2, block_bytes=0)
    assert [p.key for p in pmap.parts] == ["b", "emb"] and all(p.whole for p in pmap.parts)


def test_the_map_goes_through_msgpack_and_back_unchanged():
    pmap = partition({"emb": (40_000, 64), "w": (8, 8), "s": ()}, 3, dtypes={"w": "float16"})
    wire = msgpack.unpackb(msgpack.packb(pmap.to_dict()))
    assert PartitionMap.from_dict(wire) == pmap
    assert pmap.dtypes["w"] == "float16" and pmap.shapes["s"] == ()


def _mangled(d: dict[str, Any], key: str, i: int, value: Any) -> dict[str, Any]:
    d = msgpack.unpackb(msgpack.packb(d))
    d[key][i] = value
    return d


@pytest.mark.parametrize(
    ("key", "i", "value", "says"),
    [
        ("parts", 0, ["emb", 0, 100, False, 0], "do not cover"),  # a gap in emb's rows
        ("parts", 0, ["emb", 0, 13333, False, 7], "server 7"),
        ("parts", 0, ["nope", 0, 1, True, 0], "unknown tensor"),
        ("parts", 0, ["emb", "0", 13333, False, 0], "bad part fields"),
        ("tensors", 0, ["emb", [-1, 64], "float32"], "bad shape"),
        ("parts", 0, ["emb"], "malformed"),
    ],
)
def test_a_malformed_map_is_refused_saying_what_is_wrong(key, i, value, says):
    d = partition({"emb": (40_000, 64), "w": (8, 8)}, 3).to_dict()
    with pytest.raises(ValueError, match=says):
        PartitionMap.from_dict(_mangled(d, key, i, value))


def test_a_block_key_that_is_another_parameters_path_is_refused():
    with pytest.raises(ValueError, match="rename the parameter"):
        partition({"a": (40_000, 64), "a#rows=0:20000": (2,)}, 2)


def test_split_then_join_gives_back_the_same_bits():
    rng = np.random.default_rng(1)
    shapes = {"emb": (5_000, 48), "w": (30, 7), "b": (7,), "s": ()}
    flat = {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}
    pmap = partition(shapes, 3, block_bytes=64 << 10)
    slices = split(pmap, flat)
    assert sum(len(s) for s in slices) == len(pmap.parts) > len(shapes)
    for server, sl in enumerate(slices):
        assert {k: v.shape for k, v in sl.items()} == pmap.slice_shapes(server)
    back = join(pmap, slices)
    assert list(back) == sorted(shapes)
    for k in shapes:
        assert back[k].tobytes() == flat[k].tobytes() and back[k].shape == flat[k].shape


def test_split_cuts_int8_updates_by_rows_keeping_their_scale():
    q = np.arange(5_000 * 48, dtype=np.int64).reshape(5_000, 48).astype(np.int8)
    pmap = partition({"emb": (5_000, 48)}, 2, block_bytes=64 << 10)
    slices = split(pmap, {"emb": Int8(q, np.float32(0.5))})
    parts = [v for sl in slices for v in sl.values()]
    assert all(isinstance(v, Int8) and v.scale == np.float32(0.5) for v in parts)
    assert np.array_equal(join(pmap, [{k: v.q for k, v in s.items()} for s in slices])["emb"], q)


def test_split_refuses_tensors_that_do_not_match_the_map():
    pmap = partition({"w": (4, 4)}, 2)
    with pytest.raises(ValueError, match="missing"):
        split(pmap, {"v": np.zeros((4, 4), np.float32)})
    with pytest.raises(ValueError, match="shape"):
        split(pmap, {"w": np.zeros((4, 5), np.float32)})


def test_a_part_key_reads_back_as_its_path_and_rows() -> None:
    from hetd.protocol.pslink import FrameError, part_key, read_part_key

    assert read_part_key(part_key("a/b#c", 0, 7, True)) == ("a/b#c", None)
    assert read_part_key(part_key("layers/0/kernel", 128, 256, False)) == (
        "layers/0/kernel",
        (128, 256),
    )
    for bad in ("w#rows=", "w#rows=3", "w#rows=a:4", "w#rows=-1:4"):
        with pytest.raises(FrameError, match="bad rows"):
            read_part_key(bad)
