"""int8 pushes stay int8 until the jitted step: checked as strictly as the decoder, applied as the
decoded update would be, and refused with the same error codes."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from hetd.codecs import registry as codecs
from hetd.core import Engine, EngineConfig
from hetd.core.ingest import decode_push
from hetd.core.store import Aggregator, Int8, Store, dense, make_optimizer
from hetd.protocol import wire
from policies import make_policy

SHAPES = {"dense/w": (64, 48), "dense/b": (48,)}


def make_engine(optimizer: str = "adam") -> Engine:
    rng = np.random.default_rng(0)
    params = {k: rng.standard_normal(s).astype(np.float32) for k, s in SHAPES.items()}
    return Engine(
        Store(params, make_optimizer(optimizer, 0.01)), make_policy("asp"), EngineConfig()
    )


def push(tensors: dict[str, Any]) -> wire.Message:
    frame = wire.encode(
        "push", 3, base=0, kind="grad", tensors=tensors, samples=8, steps=1, compute_s=0.1
    )
    return wire.decode(frame)


def grads(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {k: rng.standard_normal(s).astype(np.float32) for k, s in SHAPES.items()}


def test_int8_with_one_scale_stays_int8_and_means_what_the_decoder_says() -> None:
    engine = make_engine()
    g = grads(1)
    tensors = {
        "dense/w": codecs.get_codec("int8").encode(g["dense/w"], None),
        "dense/b": codecs.get_codec("int8", block=16).encode(g["dense/b"], None),
    }
    fused = decode_push(engine.store.shapes, 1, push(tensors), 100, fused=True).tensors
    plain = decode_push(engine.store.shapes, 1, push(tensors), 100).tensors
    assert isinstance(fused["dense/w"], Int8)
    assert not isinstance(fused["dense/b"], Int8)  # blocks: decoded on the host as before
    for k in SHAPES:
        np.testing.assert_array_equal(dense(fused[k]), plain[k])


@pytest.mark.parametrize(
    ("change", "code"),
    [
        ({"data": b"\x01" * 5}, "bad_tensor"),
        ({"bits": 4}, "bad_tensor"),
        ({"dtype": "float16"}, "bad_tensor"),
        ({"shape": [48, 64]}, "bad_tensor"),
        ({"scales": np.float32([-1.0]).tobytes()}, "bad_tensor"),
        ({"scales": np.float32([np.nan]).tobytes()}, "bad_tensor"),
        ({"extra": 1}, "bad_tensor"),
        ({"scales": np.float32([3e37]).tobytes()}, "not_finite"),
    ],
)
def test_a_bad_int8_tensor_is_refused_as_the_decoder_would(
    change: dict[str, Any], code: str
) -> None:
    engine = make_engine()
    g = grads(2)
    tensors = {k: codecs.get_codec("int8").encode(v, None) for k, v in g.items()}
    tensors["dense/w"] = {**tensors["dense/w"], **change}
    with pytest.raises(wire.ProtocolError) as fused:
        decode_push(engine.store.shapes, 1, push(tensors), 100, fused=True)
    assert fused.value.code == code


@pytest.mark.parametrize("kind", ["grad", "delta"])
def test_the_jitted_step_applies_int8_as_the_decoded_update(kind: str) -> None:
    a, b = make_engine().store, make_engine().store
    for seed in range(3):
        g = grads(10 + seed)
        enc = {k: codecs.get_codec("int8").encode(v, None) for k, v in g.items()}
        decoded = {k: codecs.decode_tensor(t, k) for k, t in enc.items()}
        q = {
            k: Int8(
                np.frombuffer(t["data"], np.int8).reshape(SHAPES[k]),
                np.frombuffer(t["scales"], np.float32)[0],
            )
            for k, t in enc.items()
        }
        a.apply(kind, decoded, 0.5)
        b.apply(kind, q, 0.5)
    for k in SHAPES:
        np.testing.assert_allclose(a.snapshot().tensors[k], b.snapshot().tensors[k], atol=1e-6)
    agg = Aggregator()
    agg.add("grad", q, 2.0)
    [(_, summed)] = agg.take(normalize=True)
    for k in SHAPES:
        np.testing.assert_allclose(summed[k], dense(q[k]), rtol=1e-6)
