"""Error feedback: what a lossy codec failed to send this time is added to the next update.

Owns :class:`ErrorFeedback` (one float32 residual per tensor path) and
:func:`encode_with_feedback`, which does compensate -> encode -> decode -> update for a flat map.
With feedback, the sum of what was sent over ``T`` steps equals the sum of the true updates minus
the final residual, so a biased codec (``sign``, ``topk``) still converges (EF-SGD, EF-signSGD).
The worker keeps one per connection for its pushes; the daemon keeps one per stream it encodes.

Pure computation, no I/O. The residuals are the one piece of mutable state here: they are as big as
the model, so :meth:`ErrorFeedback.update` writes into the previous residual's buffer instead of
allocating a new one each step (fresh memory is slow, docs/benchmark.md).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import numpy as np

from hetd.codecs.registry import Codec, WireTensor


class ErrorFeedback:
    """Residuals of lossy encodings, keyed by tensor path (each float32, the tensor's shape)."""

    def __init__(self) -> None:
        self._residual: dict[str, np.ndarray] = {}

    def compensate(self, path: str, x: np.ndarray) -> np.ndarray:
        """``x + residual`` as a new float32 array (``x`` as float32 when there is none yet).

        A residual whose shape differs from ``x`` raises ``ValueError``: the model changed under
        the feedback, so call :meth:`reset` first.
        """
        x32 = np.asarray(x, dtype=np.float32)
        residual = self._residual.get(path)
        if residual is None:
            return x32
        if residual.shape != x32.shape:
            raise ValueError(
                f"error feedback for {path!r} holds shape {list(residual.shape)}, got "
                f"{list(x32.shape)}: call reset() when the model's shapes change"
            )
        compensated: np.ndarray = np.add(x32, residual)
        return compensated

    def update(self, path: str, target: np.ndarray, sent: np.ndarray) -> None:
        """Remember ``target - sent``: what was meant (the compensated update) minus what the
        receiver will decode."""
        target32 = np.asarray(target, dtype=np.float32)
        if np.shape(sent) != target32.shape:
            raise ValueError(
                f"error feedback for {path!r}: sent shape {list(np.shape(sent))} differs from "
                f"the target's {list(target32.shape)}"
            )
        residual = self._residual.get(path)
        if residual is None or residual.shape != target32.shape:
            self._residual[path] = np.subtract(target32, sent, dtype=np.float32)
        else:
            np.subtract(target32, sent, out=residual)  # reuse the buffer (see module docstring)

    def residual(self, path: str) -> np.ndarray | None:
        """The residual held for ``path``, or None (read-only view)."""
        residual = self._residual.get(path)
        if residual is None:
            return None
        view = residual.view()
        view.flags.writeable = False
        return view

    def norm(self) -> float:
        """The L2 norm of all residuals together (a metric: how much is still owed)."""
        return float(np.sqrt(sum(float(np.linalg.norm(r)) ** 2 for r in self._residual.values())))

    def reset(self, path: str | None = None) -> None:
        """Forget the residual of ``path``, or every residual (on a full resync)."""
        if path is None:
            self._residual.clear()
        else:
            self._residual.pop(path, None)

    def __len__(self) -> int:
        return len(self._residual)

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._residual))


def encode_with_feedback(
    ef: ErrorFeedback,
    tensors: Mapping[str, np.ndarray],
    codec: Codec,
    rng: np.random.Generator | None = None,
) -> dict[str, WireTensor]:
    """Encode a flat ``path -> array`` map with ``codec``, adding each path's residual first and
    keeping the new one (``compensated - decode(wire)``). A lossless codec sends the residual
    along with the update and leaves none behind."""
    out: dict[str, WireTensor] = {}
    for path, x in tensors.items():
        target = ef.compensate(path, x)
        wire = codec.encode(target, rng)
        if codec.lossless:
            ef.reset(path)
        else:
            ef.update(path, target, codec.decode(wire))
        out[path] = wire
    return out
