"""Heterogeneity emulation: make a fast box act like a slow one (slow-down, bandwidth cap,
transient stragglers). Pure arithmetic on measured times; the caller does the sleeping."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import numpy as np

_UNITS = {
    "": 1.0,
    "b": 1.0,
    "kb": 1e3,
    "mb": 1e6,
    "gb": 1e9,
    "kib": 1024.0,
    "mib": 1024.0**2,
    "gib": 1024.0**3,
}


def parse_rate(text: str) -> float:
    """``"20MB/s"``, ``"500kB/s"``, ``"1e6"`` -> bytes per second; bad text raises ValueError."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*([a-zA-Z]*)\s*(?:/s)?\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"bad rate {text!r}: use e.g. 20MB/s, 500kB/s or a number of bytes/s")
    rate = float(m.group(1)) * _UNITS[m.group(2).lower()]
    if rate <= 0:
        raise ValueError(f"rate must be > 0, got {text!r}")
    return rate


@dataclass
class Emulation:
    """How much slower than the hardware this worker should behave.

    ``slowdown`` multiplies every step's compute time (padded to at least ``base_step_s``, so
    that emulated time dominates real contention on a small machine); ``bandwidth`` (bytes/s) caps the link;
    ``stragglers`` is the chance per step that a slow episode (``straggle_factor`` ×, geometric
    length with mean ``straggle_mean`` steps) begins (docs/benchmark.md, scenario S2);
    ``bad_pushes`` injects faults: the chance that a push carries NaN, which the daemon refuses.
    """

    slowdown: float = 1.0
    base_step_s: float = 0.0  # s per step of base_batch samples, before the slow-down
    base_batch: int = 32
    memory: int | None = None  # bytes of free memory to report instead of the real figure
    bandwidth: float | None = None
    stragglers: float = 0.0
    straggle_factor: float = 5.0
    straggle_mean: float = 10.0
    bad_pushes: float = 0.0  # chance that a push carries NaN (fault injection: refused, not fatal)
    seed: int = 0
    _left: int = 0  # steps left in the current slow episode
    _rng: np.random.Generator = field(default_factory=lambda: np.random.default_rng(0))
    _fault_rng: np.random.Generator = field(default_factory=lambda: np.random.default_rng(0))

    def __post_init__(self) -> None:
        if self.slowdown < 1.0:
            raise ValueError(f"slowdown must be >= 1, got {self.slowdown}")
        if self.base_step_s < 0:
            raise ValueError(f"base step time must be >= 0, got {self.base_step_s}")
        if not 0.0 <= self.stragglers <= 1.0:
            raise ValueError(f"stragglers must be a probability, got {self.stragglers}")
        if not 0.0 <= self.bad_pushes <= 1.0:
            raise ValueError(f"bad pushes must be a probability, got {self.bad_pushes}")
        self._rng = np.random.default_rng(self.seed)
        self._fault_rng = np.random.default_rng([self.seed, 1])

    def corrupt_push(self) -> bool:
        """Whether the next push should carry NaN (its own random stream: faults do not change
        the straggler pattern)."""
        return self.bad_pushes > 0 and bool(self._fault_rng.random() < self.bad_pushes)

    def step_seconds(self, compute_s: float, samples: int | None = None) -> float:
        """The emulated duration of a step over ``samples`` that really took ``compute_s``: at
        least ``base_step_s × samples/base_batch``, times the slow-down and any straggle."""
        factor = self.slowdown
        if self._left == 0 and self.stragglers > 0 and self._rng.random() < self.stragglers:
            self._left = int(self._rng.geometric(1.0 / self.straggle_mean))
        if self._left > 0:
            self._left -= 1
            factor *= self.straggle_factor
        base = self.base_step_s * (samples if samples is not None else self.base_batch)
        return max(compute_s, base / self.base_batch) * factor

    def transfer_seconds(self, nbytes: int) -> float:
        """Extra seconds to move ``nbytes`` over the capped link (0 without a cap)."""
        return 0.0 if self.bandwidth is None else nbytes / self.bandwidth
