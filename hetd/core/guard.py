"""The update guard, a part of the engine: it refuses a push whose norm is out of range for a
float32 model, or (once warmed up) over ``factor`` times the median norm of the accepted pushes
of its kind ([train] guard_factor, guard_warmup). Nothing refused counts: the worker goes on from
what it holds."""

from __future__ import annotations

import math
import statistics
from collections import deque

import numpy as np

__all__ = ["GUARD_WINDOW", "MAX_NORM", "UpdateGuard"]

GUARD_WINDOW = 256  # accepted pushes' norms per kind the median is taken over
MAX_NORM = math.sqrt(float(np.finfo(np.float32).max))  # a larger norm's square overflows float32


class UpdateGuard:
    """Norms of the accepted pushes, per kind (``"grad"``, ``"delta"``), and the rule that
    refuses the others. ``factor`` 0 turns it off."""

    def __init__(self, factor: float, warmup: int) -> None:
        self.factor = factor
        self.warmup = warmup
        # kind -> the norms of its last accepted pushes, newest last
        self.norms: dict[str, deque[float]] = {}

    def check(self, kind: str, norm: float) -> str | None:
        """Why a push of ``kind`` with update norm ``norm`` is refused (None: it passes, and its
        norm joins its kind's window). A norm whose square overflows float32 is refused whenever
        the guard is on, warm-up included."""
        if self.factor <= 0:
            return None
        if not norm < MAX_NORM:
            return f"update norm {norm:.3g} is out of range for a float32 model; not applied"
        window = self.norms.get(kind)
        if window is None:
            window = self.norms[kind] = deque(maxlen=max(GUARD_WINDOW, self.warmup))
        if window and len(window) >= self.warmup:
            median = statistics.median(window)
            if median > 0 and norm > self.factor * median:
                return (
                    f"update norm {norm:.3g} is over {self.factor:g} x the median {median:.3g} "
                    f"of the last {len(window)} accepted {kind} pushes; not applied"
                )
        window.append(norm)
        return None

    @property
    def on(self) -> bool:
        return self.factor > 0
