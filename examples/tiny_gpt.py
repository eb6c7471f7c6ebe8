"""A tiny GPT (``flax.nnx``) that models the bytes of Python's own documentation, read from a
memory-mapped token file.

What it shows:

* a decoder-only transformer as an ``nnx`` module: byte embeddings and learned positions, two
  pre-LayerNorm blocks of causal self-attention and an MLP, the output tied to the embedding.
* data the way large language-model runs keep it: one flat file of tokens (here the bytes of
  :func:`hetd.zoo.text.pydoc_bytes`, vocabulary 256) and an index of where each document starts,
  written once to a cache directory and opened with ``np.memmap(..., mode="r")`` by every process,
  which pages in only the windows it reads. The files are written under a temporary name and then
  renamed, so a daemon and workers starting together never see half a file.
* a masked loss: a window never crosses a document's end (nor this worker's part of the file), so
  its tail is padding; ``mask`` marks the targets that are real bytes and the cross-entropy is the
  mean over those only. ``perplexity`` is ``exp`` of it.
* sharding by bytes: worker ``shard.index`` of ``shard.count`` reads the bytes
  ``shard.slice(train_bytes)`` only, so workers never read the same text; each epoch cuts its part
  into windows on a fresh grid (a random offset), so a pass does not repeat the last one's windows.

The documents that start after 95% of the bytes are held out: ``eval_data`` is one batch of windows
that cover them, every held-out byte after a document's first scored once, so the perplexity it
reports is exactly ``exp`` of the mean over all of them. (The daemon averages batches' metrics by
their size; with several eval batches, padding would weigh in and ``exp`` of a mean would become a
mean of ``exp``.)

The target is a held-out perplexity of 8 (byte frequencies alone give about 24): about 85 steps
of 32 windows, some 10 seconds of one CPU core. Train it::

    hetd serve --task examples/tiny_gpt.py:task
    hetd-worker ws://127.0.0.1:7070 --task examples/tiny_gpt.py:task   # twice
"""

from __future__ import annotations

import functools
import itertools
import os
import platform
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from hetd import Shard, Task

VOCAB = 256  # bytes
CONTEXT = 64  # input tokens per window; a window holds CONTEXT + 1 (inputs and shifted targets)
WIDTH, HEADS, LAYERS = 64, 4, 2
TEST_FRACTION = 0.05


def cache_dir() -> Path:
    """``$XDG_CACHE_HOME/hetd/examples`` (``~/.cache/hetd/examples`` by default)."""
    root = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(root) / "hetd" / "examples"


def _write_atomically(path: Path, data: bytes) -> None:
    """``data`` to ``path`` through a temporary file in the same directory and a rename: readers
    see no file or the whole file, and writers racing each other write the same bytes."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, 0o644)  # mkstemp's 0600 would keep other users' workers out
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


@functools.cache
def token_files() -> tuple[Path, np.ndarray]:
    """The token file's path and the documents' bounds (``bounds[i]:bounds[i + 1]`` is document
    ``i``), written on first use. The text follows the Python version, and so does the name."""
    stem = f"pydoc-{platform.python_version()}"
    tokens, index = cache_dir() / f"{stem}.u8", cache_dir() / f"{stem}.bounds.i64"
    if tokens.exists() and index.exists():
        bounds = np.fromfile(index, np.int64)
        if len(bounds) > 1 and bounds[-1] == tokens.stat().st_size:
            return tokens, bounds
    from pydoc_data.topics import topics

    from hetd.zoo.text import pydoc_bytes

    text = pydoc_bytes()  # the topics in sorted order, separated by a blank line
    sizes = [len(topics[key].encode("utf-8")) + 2 for key in sorted(topics)]
    sizes[-1] -= 2  # no separator after the last one
    bounds = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    assert bounds[-1] == len(text), "hetd.zoo.text joins the topics differently"
    _write_atomically(tokens, text)
    _write_atomically(index, bounds.tobytes())
    return tokens, bounds


def tokens() -> np.memmap:
    """The token file, read-only and paged in on demand."""
    return np.memmap(token_files()[0], np.uint8, mode="r")


def train_bytes() -> int:
    """Where the held-out documents start: ``[0, train_bytes())`` is training text, the rest
    (the documents that start after 95% of the bytes: about 12 KB on Python 3.11) is held out."""
    bounds = token_files()[1]
    return int(bounds[np.searchsorted(bounds, (1 - TEST_FRACTION) * bounds[-1])])


def windows(lo: int, hi: int, offset: int) -> tuple[np.ndarray, np.ndarray]:
    """The windows over bytes ``[lo, hi)``: ``(starts, ends)``, window ``i`` being the tokens
    ``starts[i]:ends[i]`` (2 to ``CONTEXT + 1`` of them). Windows are cut at every document's
    start and at every position ``offset + k * CONTEXT``; each byte in ``(lo, hi)`` that is not a
    document's first is a target in exactly one window."""
    bounds = token_files()[1]
    starts: list[np.ndarray] = []
    ends: list[np.ndarray] = []
    for a, b in itertools.pairwise(bounds.tolist()):
        a, b = max(a, lo), min(b, hi)
        if b - a < 2:
            continue
        grid = np.arange(a + (offset - a) % CONTEXT, b - 1, CONTEXT)
        cuts = np.concatenate([[a], grid[grid > a]])
        starts.append(cuts)
        ends.append(np.append(cuts[1:] + 1, b))
    if not starts:
        raise ValueError(f"bytes [{lo}, {hi}) hold no window of two bytes in one document")
    return np.concatenate(starts), np.concatenate(ends)


def gather(data: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> dict[str, np.ndarray]:
    """A batch: ``tokens`` ``(n, CONTEXT + 1)`` int32 (zero after a window's end) and ``mask``
    ``(n, CONTEXT)`` float32, 1 where the target ``tokens[:, 1:]`` is a real byte."""
    idx = starts[:, None] + np.arange(CONTEXT + 1)
    real = idx < ends[:, None]
    toks = np.where(real, data[np.minimum(idx, len(data) - 1)], 0).astype(np.int32)
    return {"tokens": toks, "mask": real[:, 1:].astype(np.float32)}


def train_data(shard: Shard) -> Iterator[dict[str, np.ndarray]]:
    """This worker's bytes, cut on this epoch's grid, in shuffled batches of
    ``shard.batch_size`` windows (the last incomplete batch is dropped)."""
    data = tokens()
    part = shard.slice(train_bytes())
    rng = np.random.default_rng([shard.seed, shard.index, shard.epoch])
    starts, ends = windows(part.start, part.stop, offset=int(rng.integers(CONTEXT)))
    order = rng.permutation(len(starts))
    if len(order) < shard.batch_size:  # a small data share (policy ashl): fill one batch
        order = np.resize(order, shard.batch_size)
    for i in range(0, len(order) - shard.batch_size + 1, shard.batch_size):
        rows = np.sort(order[i : i + shard.batch_size])  # reads go forward in the file
        yield gather(data, starts[rows], ends[rows])


def eval_data() -> list[dict[str, np.ndarray]]:
    """The held-out documents as one batch of windows."""
    data = tokens()
    return [gather(data, *windows(train_bytes(), len(data), offset=0))]


class Block(nnx.Module):
    """Pre-LayerNorm transformer block: causal self-attention, then a 4x MLP, each residual."""

    def __init__(self, rngs: nnx.Rngs) -> None:
        self.norm1 = nnx.LayerNorm(WIDTH, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(HEADS, WIDTH, decode=False, keep_rngs=False, rngs=rngs)
        self.norm2 = nnx.LayerNorm(WIDTH, rngs=rngs)
        self.up = nnx.Linear(WIDTH, 4 * WIDTH, rngs=rngs)
        self.down = nnx.Linear(4 * WIDTH, WIDTH, rngs=rngs)

    def __call__(self, x: jax.Array, mask: jax.Array) -> jax.Array:
        x = x + self.attn(self.norm1(x), mask=mask)
        return x + self.down(nnx.gelu(self.up(self.norm2(x))))


class GPT(nnx.Module):
    """Byte embeddings and learned positions, ``LAYERS`` blocks, logits by the tied embedding."""

    def __init__(self, rngs: nnx.Rngs) -> None:
        self.embed = nnx.Embed(VOCAB, WIDTH, rngs=rngs)
        self.pos = nnx.Param(0.02 * jax.random.normal(rngs.params(), (CONTEXT, WIDTH)))
        self.blocks = nnx.List([Block(rngs) for _ in range(LAYERS)])
        self.norm = nnx.LayerNorm(WIDTH, rngs=rngs)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = self.embed(tokens) + self.pos[...][: tokens.shape[1]]
        causal = nnx.make_causal_mask(tokens)
        for block in self.blocks:
            x = block(x, causal)
        return self.embed.attend(self.norm(x))


def loss_fn(model: GPT, batch: dict[str, jax.Array]) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Next-byte cross-entropy (nats) over the real targets only, and its perplexity."""
    inputs, targets = batch["tokens"][:, :-1], batch["tokens"][:, 1:]
    ce = optax.softmax_cross_entropy_with_integer_labels(model(inputs), targets)
    loss = jnp.sum(ce * batch["mask"]) / jnp.maximum(jnp.sum(batch["mask"]), 1.0)
    return loss, {"perplexity": jnp.exp(loss)}


def decay_matrices(params: Any) -> Any:
    """AdamW's mask: decay the matrices (kernels, embeddings), not biases, norms or positions."""
    return jax.tree_util.tree_map_with_path(
        lambda path, _: getattr(path[-1], "key", None) in ("kernel", "embedding"), params
    )


optimizer = optax.chain(
    optax.clip_by_global_norm(1.0),
    optax.adamw(
        optax.warmup_cosine_decay_schedule(0.0, 3e-3, 50, 3000, 3e-4),
        b2=0.99,
        weight_decay=0.05,
        mask=decay_matrices,
    ),
)

task = Task.from_nnx(
    GPT,
    loss_fn,
    train_data,
    eval_data=eval_data,
    optimizer=optimizer,
    target={"metric": "perplexity", "mode": "min", "value": 8.0},
)
