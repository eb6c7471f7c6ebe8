"""Parameter frames to workers: full for lossless codecs, shared quantized deltas for lossy ones."""

from __future__ import annotations

import numpy as np
import pytest

from hetd import wire
from hetd.downlink import Downlink
from hetd.store import Snapshot
from workers.client import Held, apply_params


def snap(version: int, rng: np.random.Generator) -> Snapshot:
    return Snapshot(
        version,
        {
            "w": rng.normal(size=(64, 32)).astype(np.float32),
            "b": rng.normal(size=(32,)).astype(np.float32),
        },
    )


def replay(frames: list[bytes], held: Held | None) -> Held | None:
    for frame in frames:
        held = apply_params(held, wire.decode(frame))
    return held


def test_lossless_codec_sends_the_exact_version_in_full() -> None:
    rng = np.random.default_rng(0)
    d = Downlink()
    s = snap(3, rng)
    frames, version, full = d.frames("none", 2, s)
    assert (version, full, len(frames)) == (3, True, 1)
    held = replay(frames, None)
    assert held is not None and held.version == 3
    np.testing.assert_array_equal(held.tensors["w"], s.tensors["w"])
    assert d.frames("none", -1, s)[0][0] is frames[0]  # encoded once per version


@pytest.mark.parametrize("spec", ["int8", "bf16", "sign", "topk:k=0.1"])
def test_lossy_group_shares_deltas_and_tracks_the_model(spec: str) -> None:
    rng = np.random.default_rng(1)
    d = Downlink()
    params = snap(0, rng).tensors
    frames, version, full = d.frames(spec, -1, Snapshot(0, params))
    assert full and version == 0
    a = replay(frames, None)  # worker a follows every version
    b = replay(frames, None)  # worker b skips some, then catches up with the reference in full
    errors = []
    for v in range(1, 41):
        params = {
            k: x + 0.01 * rng.normal(size=x.shape).astype(np.float32) for k, x in params.items()
        }
        s = Snapshot(v, params)
        fa, va, full_a = d.frames(spec, a.version if a else None, s)
        assert not full_a and va == v and len(fa) == 1
        a = replay(fa, a)
        assert a is not None and a.version == v
        if v % 3 == 0:
            fb, vb, full_b = d.frames(spec, b.version if b else None, s)
            # one frame per release: the reference in full, not a chain of three lossy deltas
            assert full_b and vb == v and len(fb) == 1
            assert d.frames(spec, b.version if b else None, s)[0][0] is fb[0]  # encoded once
            b = replay(fb, b)
            assert b is not None
            np.testing.assert_array_equal(b.tensors["w"], a.tensors["w"])
        errors.append(float(np.linalg.norm(a.tensors["w"] - params["w"])))
    # Error feedback: what the codec lost is resent, so the gap stays bounded instead of growing.
    assert max(errors[-10:]) <= 2 * max(errors[:10]) + 1e-6


def test_a_worker_behind_the_previous_reference_gets_it_in_full() -> None:
    rng = np.random.default_rng(2)
    d = Downlink()
    first, _, _ = d.frames("int8", -1, snap(0, rng))
    old = replay(first, None)
    for v in range(1, 6):
        latest = d.frames("int8", v - 1, snap(v, rng))
    frames, version, full = d.frames("int8", 0, snap(5, rng))
    assert full and version == 5
    held = replay(frames, old)
    assert held is not None and held.version == 5
    # The full frame is the group's reference: the worker is back in the group.
    nxt, _, full2 = d.frames("int8", 5, snap(6, rng))
    assert not full2
    assert replay(nxt, held) is not None
    del latest


def test_a_delta_against_another_version_is_refused() -> None:
    rng = np.random.default_rng(3)
    d = Downlink()
    frames, _, _ = d.frames("int8", -1, snap(0, rng))
    held = replay(frames, None)
    delta, _, _ = d.frames("int8", 0, snap(1, rng))
    assert held is not None
    stale = Held(7, held.tensors)
    assert apply_params(stale, wire.decode(delta[0])) is None


def test_a_publish_where_nobody_holds_the_reference_resets_it_to_the_snapshot() -> None:
    """No released worker can use a delta: the reference becomes the snapshot itself (lossless),
    nothing is quantized, and the next delta starts from it."""
    rng = np.random.default_rng(4)
    d = Downlink()
    d.frames("int8", -1, snap(0, rng))
    s3 = snap(3, rng)
    for arr in s3.tensors.values():  # as the store publishes them
        arr.flags.writeable = False
    before = {k: v.copy() for k, v in s3.tensors.items()}
    frames, version, full = d.frames("int8", 1, s3, holders={1, 2})
    assert full and version == 3
    held = replay(frames, None)
    assert held is not None
    for k in s3.tensors:  # the worker holds the exact parameters: no quantization error
        np.testing.assert_array_equal(held.tensors[k], s3.tensors[k])
    nxt, v4, full4 = d.frames("int8", 3, snap(4, rng), holders={3})
    assert not full4 and v4 == 4
    assert replay(nxt, held) is not None
    for k in s3.tensors:  # the snapshot was shared by the reference, never written
        np.testing.assert_array_equal(s3.tensors[k], before[k])
