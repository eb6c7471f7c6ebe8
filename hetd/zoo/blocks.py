"""The built-in workloads as block-structured models for pipeline stages
(:class:`hetd.zoo.stages.BlockModel`): the ``mlp`` with one block per Dense layer, and the
``transformer`` as its embedding, one block per layer and the output head. Same layers as
:mod:`hetd.zoo.models` and :mod:`hetd.zoo.lm`; parameters are named by block (``b00/...``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from hetd.zoo.lm import _Block as _LMBlock
from hetd.zoo.lm import resolve_size
from hetd.zoo.models import Model
from hetd.zoo.stages import BlockModel, as_model


class _Dense(nn.Module):
    """Flatten (first block only), Dense, relu unless it gives the logits."""

    width: int
    relu: bool
    flatten: bool = False

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        if self.flatten:
            x = x.reshape((x.shape[0], -1))
        out: jax.Array = nn.Dense(self.width)(x)
        return nn.relu(out) if self.relu else out


def mlp_blocks(num_classes: int, hidden: Sequence[int] = (128,)) -> BlockModel:
    """The ``mlp`` workload with one block per Dense layer."""
    widths = [*hidden, num_classes]
    blocks = tuple(
        (f"dense{j}", _Dense(w, relu=j < len(hidden), flatten=j == 0)) for j, w in enumerate(widths)
    )
    return BlockModel("mlp", blocks)


class _Embed(nn.Module):
    vocab: int
    d_model: int

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        tokens = x.astype(jnp.int32)
        h = nn.Embed(self.vocab, self.d_model)(tokens)
        pos = self.param("pos", nn.initializers.normal(0.02), (tokens.shape[1], self.d_model))
        out: jax.Array = h + pos[None]
        return out


class _Causal(nn.Module):
    """One transformer block with its causal mask made from the input's length."""

    d_model: int
    heads: int

    @nn.compact
    def __call__(self, h: jax.Array) -> jax.Array:
        mask = nn.make_causal_mask(jnp.ones(h.shape[:2], jnp.int32))
        out: jax.Array = _LMBlock(d_model=self.d_model, heads=self.heads)(h, mask)
        return out


class _Head(nn.Module):
    vocab: int

    @nn.compact
    def __call__(self, h: jax.Array) -> jax.Array:
        out: jax.Array = nn.Dense(self.vocab)(nn.LayerNorm()(h))
        return out


def transformer_blocks(
    num_classes: int,
    size: str | None = None,
    d_model: int | None = None,
    layers: int | None = None,
    heads: int | None = None,
) -> BlockModel:
    """The ``transformer`` workload as embedding, one block per layer, and the output head."""
    shape = resolve_size(size, d_model, layers, heads)
    blocks: list[tuple[str, nn.Module]] = [("embed", _Embed(num_classes, shape.d_model))]
    blocks += [(f"layer{j}", _Causal(shape.d_model, shape.heads)) for j in range(shape.layers)]
    blocks.append(("head", _Head(num_classes)))
    return BlockModel("transformer", tuple(blocks))


def mlp_model(num_classes: int, hidden: Sequence[int] = (128,)) -> Model:
    """The ``mlp`` workload as blocks, as an ordinary model: serve it as
    ``model = "hetd.zoo.blocks:mlp_model"`` to train it with pipeline stages (parameters
    ``b00/...``, one block per Dense layer)."""
    return as_model(mlp_blocks(num_classes, hidden))


_BLOCK_MODELS = {"hetd.zoo.blocks:mlp_model": mlp_blocks}


def blocks_for(spec: str, num_classes: int, **kwargs: Any) -> BlockModel | None:
    """The blocks behind a model spec that has them (None for a model that is not
    block-structured)."""
    factory = _BLOCK_MODELS.get(spec)
    return None if factory is None else factory(num_classes, **kwargs)
