"""The ``transformer`` workload's network: a small decoder-only (causal) byte-level language model.

Owns :class:`TransformerLM`, :data:`SIZES` and :func:`generate` (text written by a trained
model). Pre-LayerNorm blocks of causal multi-head self-attention and a 4x GELU MLP, learned
token and position embeddings, a final LayerNorm and an untied output layer. It maps a batch of byte windows ``(n, T)`` (float32 byte values, as
:class:`hetd.zoo.data.Dataset` keeps inputs) to next-byte logits ``(n, T, vocab)``, so
:func:`hetd.zoo.models.from_linen`'s loss and accuracy, which work over the last axis, are the
mean next-byte cross-entropy and next-byte accuracy unchanged. The position table is sized by
the input's ``T`` at init: a model always fits the data set's context, and every compiled shape
stays fixed. No dropout: runs stay deterministic per seed.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np


class Size(NamedTuple):
    """Width, depth and heads of one named size."""

    d_model: int
    layers: int
    heads: int


SIZES: dict[str, Size] = {
    "0.5m": Size(d_model=128, layers=2, heads=4),  # 0.47 M parameters at vocab 256, T = 128
    "2m": Size(d_model=192, layers=4, heads=6),  # 1.9 M
    "10m": Size(d_model=384, layers=6, heads=6),  # 10.8 M
}
"""The named sizes (parameters counted with byte vocabulary and context 128)."""


class _Block(nn.Module):
    """``x + attn(ln(x))`` then ``x + mlp(ln(x))``, attention masked to the past."""

    d_model: int
    heads: int

    @nn.compact
    def __call__(self, x: jax.Array, mask: jax.Array) -> jax.Array:
        h = nn.LayerNorm()(x)
        h = nn.MultiHeadDotProductAttention(num_heads=self.heads, qkv_features=self.d_model)(
            h, h, mask=mask
        )
        x = x + h
        h = nn.LayerNorm()(x)
        h = nn.Dense(4 * self.d_model)(h)
        h = nn.gelu(h)
        out: jax.Array = x + nn.Dense(self.d_model)(h)
        return out


class TransformerLM(nn.Module):
    """Byte windows ``(n, T)`` -> next-byte logits ``(n, T, vocab)``."""

    vocab: int
    d_model: int
    layers: int
    heads: int

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        tokens = x.astype(jnp.int32)
        length = tokens.shape[1]
        h = nn.Embed(self.vocab, self.d_model)(tokens)
        pos = self.param("pos", nn.initializers.normal(0.02), (length, self.d_model))
        h = h + pos[None]
        mask = nn.make_causal_mask(tokens)
        for _ in range(self.layers):
            h = _Block(d_model=self.d_model, heads=self.heads)(h, mask)
        h = nn.LayerNorm()(h)
        out: jax.Array = nn.Dense(self.vocab)(h)
        return out


def resolve_size(
    size: str | None, d_model: int | None, layers: int | None, heads: int | None
) -> Size:
    """A named size, with any of its fields overridden (all three given: no name needed)."""
    if size is None:
        base = SIZES["0.5m"] if None in (d_model, layers, heads) else Size(1, 1, 1)
    elif size.lower() in SIZES:
        base = SIZES[size.lower()]
    else:
        raise ValueError(f"unknown transformer size {size!r}; known: {sorted(SIZES)}")
    chosen = Size(d_model or base.d_model, layers or base.layers, heads or base.heads)
    if min(chosen) < 1 or chosen.d_model % chosen.heads:
        raise ValueError(
            f"d_model {chosen.d_model} must be a positive multiple of heads {chosen.heads}"
        )
    return chosen


def generate(
    logits: Callable[[Any, jax.Array], jax.Array],
    params: Mapping[str, Any],
    prompt: bytes,
    context: int,
    length: int,
    temperature: float = 0.0,
    seed: int = 0,
) -> bytes:
    """``length`` bytes that the model writes after ``prompt``, one at a time.

    ``logits`` is the model's ``(params, x) -> (n, T, vocab)`` and ``context`` the ``T`` it was
    built for (its position table's length): every step sees one window of exactly ``context``
    bytes (one compiled shape) that ends with the last byte written, or, while the text is shorter,
    starts at its beginning (the causal mask keeps the bytes after the one read from mattering).
    ``temperature`` 0 is greedy; above 0 samples from ``softmax(logits / temperature)`` with a PRNG
    seeded by ``seed``. The whole loop is one compiled call. The prompt must not be empty.
    """
    if not prompt:
        raise ValueError("the prompt must hold at least one byte")
    if length < 0 or context < 1:
        raise ValueError(f"need length >= 0 and context >= 1, got {length}, {context}")
    if not (temperature >= 0 and math.isfinite(temperature)):
        raise ValueError(f"temperature must be a finite number >= 0, got {temperature}")
    if length == 0:
        return b""
    size = max(len(prompt) + length, context)
    text = jnp.zeros((size,), jnp.int32).at[: len(prompt)].set(jnp.frombuffer(prompt, jnp.uint8))
    out = _written(
        logits,
        context,
        len(prompt),
        length,
        temperature == 0,
        params,
        text,
        jnp.float32(max(temperature, 1e-6)),
        jax.random.PRNGKey(seed),
    )
    return bytes(np.asarray(out[len(prompt) : len(prompt) + length]).astype(np.uint8))


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3, 4))
def _written(
    logits: Callable[[Any, jax.Array], jax.Array],
    context: int,
    start: int,
    length: int,
    greedy: bool,
    params: Mapping[str, Any],
    text: jax.Array,
    temperature: jax.Array,
    key: jax.Array,
) -> jax.Array:
    """:func:`generate`'s loop: writes bytes ``start .. start + length - 1`` of ``text``."""

    def one(i: jax.Array, carry: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
        buf, k = carry
        last = start + i - 1  # the position whose prediction is the next byte
        lo = jnp.maximum(0, last + 1 - context)
        window = jax.lax.dynamic_slice(buf, (lo,), (context,))
        row = logits(params, window[None, :].astype(jnp.float32))[0, last - lo]
        k, sub = jax.random.split(k)
        byte = jnp.argmax(row) if greedy else jax.random.categorical(sub, row / temperature)
        return buf.at[last + 1].set(byte.astype(jnp.int32)), k

    written: tuple[jax.Array, jax.Array] = jax.lax.fori_loop(0, length, one, (text, key))
    return written[0]
