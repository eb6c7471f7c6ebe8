"""``decode_aligned`` gives what ``wire.decode`` gives, with big byte strings 64-byte aligned (so
JAX takes them without a copy), and refuses what it refuses."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from hetd.codecs import registry as codecs
from hetd.protocol import wire
from hetd.protocol.aligned import ALIGN, decode_aligned
from hetd.protocol.params import full_frame, param_hash


def _push(n: int) -> bytes:
    grads = {"a/w": np.linspace(-1, 1, n, dtype=np.float32), "b": np.ones(3, np.float32)}
    return wire.encode(
        "push",
        7,
        base=3,
        kind="grad",
        tensors=codecs.encode_tree(grads, codecs.none_codec()),
        samples=32,
        steps=1,
        compute_s=0.25,
        loss=-1.5,
        free_mem=1 << 40,
        idle_s=None,
    )


def test_same_message_and_big_tensors_aligned_and_taken_by_jax_without_a_copy() -> None:
    tensors = {"x": np.arange(50_000, dtype=np.float32).reshape(250, 200), "y": np.ones(4, "f4")}
    params, _ = full_frame(5, tensors, param_hash(tensors))
    for frame in (_push(40_000), params, memoryview(params)):
        got, want = decode_aligned(frame), wire.decode(frame)
        assert (got.type, got.id, got.body) == (want.type, want.id, want.body)
    msg = decode_aligned(params)
    big = msg["tensors"]["x"]["data"]
    assert isinstance(big, memoryview) and big.readonly
    x = codecs.decode_tree(msg["tensors"])["x"]
    assert x.ctypes.data % ALIGN == 0 and np.array_equal(x, tensors["x"])
    assert jax.device_put(x).unsafe_buffer_pointer() == x.ctypes.data  # no copy into XLA


@pytest.mark.parametrize(
    "frame",
    [b"", b"\xc1", b"\x81\xa1v", b"\x80\x00", b"\xc7\x01\x05x", b"\x91\x01", _push(10)[:-3]],
)
def test_what_decode_refuses_is_refused(frame: bytes) -> None:
    with pytest.raises(wire.ProtocolError) as want:
        wire.decode(frame)
    with pytest.raises(wire.ProtocolError) as got:
        decode_aligned(frame)
    assert got.value.code == want.value.code


def test_damaged_frames_get_the_same_outcome() -> None:
    rng = np.random.default_rng(0)
    good = _push(300)
    for _ in range(400):
        frame = bytearray(good)
        for i in rng.integers(0, len(frame), 2):
            frame[i] = int(rng.integers(0, 256))
        outcomes = []
        for decode in (wire.decode, decode_aligned):
            try:
                msg = decode(bytes(frame))
                outcomes.append((msg.type, msg.id, msg.body))
            except wire.ProtocolError as exc:
                outcomes.append(exc.code)
        assert outcomes[0] == outcomes[1], bytes(frame)


def test_too_large_is_refused_before_reading() -> None:
    with pytest.raises(wire.ProtocolError) as exc:
        decode_aligned(_push(40_000), max_size=1000)
    assert exc.value.code == "too_large"
