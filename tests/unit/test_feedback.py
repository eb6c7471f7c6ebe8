"""Error feedback: what a lossy codec drops this step is sent in later steps, so the sum of what
was sent tracks the sum of the true updates."""

from __future__ import annotations

import numpy as np
import pytest

from hetd.codecs import registry as codecs
from hetd.codecs.feedback import ErrorFeedback, encode_with_feedback


def drifting_updates(n: int, steps: int, seed: int = 0) -> list[np.ndarray]:
    """Noisy updates around a fixed mean, like gradients along a slope."""
    rng = np.random.default_rng(seed)
    mean = 0.5 * rng.standard_normal(n)
    return [(mean + rng.standard_normal(n)).astype(np.float32) for _ in range(steps)]


@pytest.mark.parametrize("spec", ["int8", "int4", "sign", "topk:k=0.1", "topk:k=0.05,values=int8"])
def test_sum_sent_tracks_sum_of_true_updates(spec: str) -> None:
    codec = codecs.from_spec(spec)
    rng = np.random.default_rng(1)
    ef = ErrorFeedback()
    true_sum = np.zeros(500)
    sent_sum = np.zeros(500)
    plain_sum = np.zeros(500)  # the same codec without feedback
    for g in drifting_updates(500, 300):
        tensors = encode_with_feedback(ef, {"layer/w": g}, codec, rng)
        sent_sum += codecs.decode_tree(tensors, {"layer/w": g.shape})["layer/w"]
        plain_sum += codec.decode(codec.encode(g, rng))
        true_sum += g
    residual = ef.residual("layer/w")
    assert residual is not None
    # What was sent plus what is still owed is exactly what was meant (up to float32 rounding).
    np.testing.assert_allclose(sent_sum + residual, true_sum, atol=1e-3)
    # The gap is only the final residual: small against the sum, and far below no feedback's.
    gap = np.linalg.norm(true_sum - sent_sum)
    assert gap < 0.1 * np.linalg.norm(true_sum)
    assert gap < 0.2 * np.linalg.norm(true_sum - plain_sum)


def test_compensate_adds_the_residual_left_by_update() -> None:
    ef = ErrorFeedback()
    x = np.array([1.0, 2.0, 3.0], np.float32)
    np.testing.assert_array_equal(ef.compensate("a", x), x)  # nothing owed yet
    ef.update("a", x, np.array([1.0, 1.5, 2.0], np.float32))
    np.testing.assert_array_equal(ef.residual("a"), [0.0, 0.5, 1.0])
    np.testing.assert_array_equal(ef.compensate("a", x), [1.0, 2.5, 4.0])
    np.testing.assert_array_equal(x, [1.0, 2.0, 3.0])  # the caller's array is untouched
    np.testing.assert_array_equal(ef.compensate("b", x), x)  # residuals are per path
    assert len(ef) == 1 and list(ef) == ["a"]
    assert ef.norm() == pytest.approx(np.sqrt(1.25))


def test_residual_is_read_only_and_update_reuses_its_buffer() -> None:
    ef = ErrorFeedback()
    ef.update("a", np.ones(4, np.float32), np.zeros(4, np.float32))
    view = ef.residual("a")
    assert view is not None
    with pytest.raises(ValueError):
        view[0] = 5.0
    ef.update("a", np.full(4, 3.0, np.float32), np.ones(4, np.float32))
    np.testing.assert_array_equal(view, [2.0, 2.0, 2.0, 2.0])  # same buffer, new contents


def test_lossless_codec_sends_what_is_owed_and_keeps_no_residual() -> None:
    ef = ErrorFeedback()
    x = np.random.default_rng(2).standard_normal(100).astype(np.float32)
    encode_with_feedback(ef, {"w": x}, codecs.get_codec("sign"))
    owed = ef.residual("w")
    assert owed is not None and np.abs(owed).max() > 0
    owed = owed.copy()
    sent = encode_with_feedback(ef, {"w": x}, codecs.get_codec("none"))
    np.testing.assert_array_equal(codecs.decode_tensor(sent["w"], "w"), x + owed)
    assert ef.residual("w") is None and ef.norm() == 0.0


def test_bf16_keeps_a_tiny_residual() -> None:
    ef = ErrorFeedback()
    x = np.random.default_rng(3).standard_normal(100).astype(np.float32)
    encode_with_feedback(ef, {"w": x}, codecs.get_codec("bf16"))
    owed = ef.residual("w")
    assert owed is not None and 0 < np.abs(owed).max() <= 2.0**-8 * np.abs(x).max()


def test_reset_forgets_one_path_or_all() -> None:
    ef = ErrorFeedback()
    for path in ("a", "b"):
        ef.update(path, np.ones(3, np.float32), np.zeros(3, np.float32))
    ef.reset("a")
    assert ef.residual("a") is None and ef.residual("b") is not None
    ef.reset("missing")  # forgetting what is not there is fine
    ef.reset()
    assert len(ef) == 0


def test_a_shape_change_asks_for_reset() -> None:
    ef = ErrorFeedback()
    ef.update("a", np.ones(3, np.float32), np.zeros(3, np.float32))
    with pytest.raises(ValueError, match="reset"):
        ef.compensate("a", np.ones(4, np.float32))
    with pytest.raises(ValueError, match="sent shape"):
        ef.update("a", np.ones(3, np.float32), np.zeros(2, np.float32))
    ef.update("a", np.ones((2, 2), np.float32), np.zeros((2, 2), np.float32))  # replaced whole
    assert ef.compensate("a", np.zeros((2, 2), np.float32)).shape == (2, 2)


def test_encode_with_feedback_encodes_every_path() -> None:
    ef = ErrorFeedback()
    tensors = {"a": np.ones((2, 3), np.float32), "b": np.arange(5, dtype=np.float32)}
    wire = encode_with_feedback(ef, tensors, codecs.get_codec("int8"))
    out = codecs.decode_tree(wire, {k: v.shape for k, v in tensors.items()})
    for path, x in tensors.items():
        residual = ef.residual(path)
        assert residual is not None
        np.testing.assert_allclose(out[path] + residual, x, atol=1e-6)
