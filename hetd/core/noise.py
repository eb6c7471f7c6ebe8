"""The gradient noise scale, measured from the pushes, a part of :class:`hetd.core.engine.Engine`
(:class:`GradientNoise`).

Two workers' gradients computed on the same parameters (pushes at the same base version) from
independent batches are a pair :class:`policies.efficiency.NoiseScale` estimates the noise scale
from. This part keeps the last plain gradient push applied or buffered (its decoded arrays, held
by reference until the next one replaces them: at most one update's memory), and when another
worker's gradient arrives at the same base version it reduces the pair to three numbers (two
squared norms and a dot product, one pass each over arrays already decoded) and adds them. What
it keeps beyond that one update is the estimator's five numbers. Written only by the engine's
loop; read by the policy's view and ``/v1/status``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from hetd.core.store import Int8
from policies.efficiency import NoiseScale

# Models above this many parameters are not measured: the held update would cost its size in
# memory (4 bytes a parameter) and each pair a pass over it, for a figure no policy reads yet.
MAX_PARAMS = 1 << 26


@dataclass(slots=True)
class _Held:
    base: int
    worker: int
    samples: int
    sq: float  # |g|²
    tensors: Mapping[str, np.ndarray]


class GradientNoise:
    """Pairs of gradients at the same base version into a :class:`NoiseScale`."""

    def __init__(self, max_params: int = MAX_PARAMS, estimator: NoiseScale | None = None) -> None:
        self.max_params = max_params
        self.estimator = estimator or NoiseScale()
        self._held: _Held | None = None

    @property
    def value(self) -> float | None:
        """The noise scale in samples (None until the estimator has enough pairs)."""
        return self.estimator.value

    @property
    def pairs(self) -> int:
        """Pairs added so far."""
        return self.estimator.pairs

    def push(
        self, worker: int, base: int, samples: int, tensors: Mapping[str, Any], norm: float | None
    ) -> None:
        """A plain gradient push (one step, mean over ``samples`` samples) computed at version
        ``base`` was applied or buffered; ``norm``: its L2 norm when ingest measured it. Pushes
        not measured (empty, int8 views, other dtypes, over :attr:`max_params`, not finite) change
        nothing and are not held; one at an older base than the held one is passed over."""
        held = self._held
        if held is not None and base < held.base:
            return
        arrays = self._arrays(tensors)
        if arrays is None or samples < 1:
            return
        sq = norm * norm if norm is not None else _sum_sq(arrays)
        if not math.isfinite(sq):
            return
        if (
            held is not None
            and held.base == base
            and held.worker != worker
            and held.tensors.keys() == arrays.keys()
            and all(held.tensors[k].shape == a.shape for k, a in arrays.items())
        ):
            dot = _dot(held.tensors, arrays)
            self.estimator = self.estimator.add(held.sq, sq, dot, held.samples, samples)
        self._held = _Held(base, worker, samples, sq, arrays)

    def _arrays(self, tensors: Mapping[str, Any]) -> dict[str, np.ndarray] | None:
        if not tensors:
            return None
        out: dict[str, np.ndarray] = {}
        size = 0
        for k, t in tensors.items():
            if isinstance(t, Int8) or not isinstance(t, np.ndarray) or t.dtype != np.float32:
                return None
            size += t.size
            if size > self.max_params:
                return None
            out[k] = t
        return out


def _dot(a: Mapping[str, np.ndarray], b: Mapping[str, np.ndarray]) -> float:
    """``a · b`` over all tensors (each tensor in float32 BLAS, summed in float64)."""
    with np.errstate(over="ignore", invalid="ignore"):
        return float(sum(float(np.dot(a[k].reshape(-1), b[k].reshape(-1))) for k in a))


def _sum_sq(a: Mapping[str, np.ndarray]) -> float:
    return _dot(a, a)
