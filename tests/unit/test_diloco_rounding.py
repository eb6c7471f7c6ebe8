"""Tiny pseudo-gradients are not lost to rounding (issue 16, docs/policies.md §13.4).

A long run of deltas whose small coordinates are far below what a bf16 parameter can resolve
(ulp 2^-7 at 1.0) and below one int8/int4 step of their tensor's scale: summed in bf16 they vanish,
and a quantizer without error feedback sends zeros. The worker's error feedback plus the store's
float32 parameters keep them: after T rounds the small coordinates moved by T times their delta,
within half a quantization step.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import optax
import pytest

from hetd.codecs.feedback import ErrorFeedback, encode_with_feedback
from hetd.codecs.registry import decode_tensor, from_spec
from hetd.core.store import Store

ROUNDS = 1000
TINY = 2e-5  # per round; the true sum over the run is 0.02
BIG = 0.05  # one large coordinate sets the tensor's quantization scale


def _delta() -> np.ndarray:
    d = np.full(64, TINY, np.float32)
    d[0] = BIG
    return d


def test_a_bf16_sum_drops_tiny_deltas() -> None:
    p = jnp.ones(64, jnp.bfloat16)
    d = jnp.asarray(_delta(), jnp.bfloat16)
    for _ in range(ROUNDS):
        p = p + d
    assert np.all(np.asarray(p[1:], np.float32) == 1.0)  # 0.02 of movement silently lost


@pytest.mark.parametrize(("spec", "step"), [("bf16", 0.0), ("int8", BIG / 127), ("int4", BIG / 7)])
def test_error_feedback_and_fp32_accumulation_keep_them(spec: str, step: float) -> None:
    codec = from_spec(spec)
    store = Store({"w": np.ones(64, np.float32)}, optax.sgd(0.1))
    ef = ErrorFeedback()
    without = np.ones(64, np.float32)  # the same codec with no feedback
    for _ in range(ROUNDS):
        wire = encode_with_feedback(ef, {"w": _delta()}, codec)
        store.apply("delta", {"w": decode_tensor(wire["w"], "w")}, 1.0)
        without += decode_tensor(codec.encode(_delta()), "w")
    got = np.asarray(store.snapshot().tensors["w"][1:], np.float64)
    want = 1.0 + ROUNDS * TINY
    assert np.max(np.abs(got - want)) <= step / 2 + 1e-4, spec
    if step:  # a quantizer alone rounds every tiny coordinate to zero, every round
        assert np.all(without[1:] == 1.0)
