"""A store that keeps the count and holds no tensors (:class:`LedgerStore`): the head's, when its
pservers hold the parameters and it takes each push's header only (``[pservers] headers``).

The engine runs unchanged on it: each update it applies or flushes moves the version and is
written to the decision log exactly as :class:`~hetd.core.store.Store` writes it (one entry per
update, one ``step`` per run of queued steps, at the same counts), so the pservers, which replay
the log on their slices, carry out what the engine decided. What needs the parameters themselves
(an evaluation, an export) pulls them from the pservers; asking this store for them is a bug and
raises :class:`NoParameters`. A checkpoint of it holds the version and the log's place, and no
parameters: each pserver saves its slice at the checkpoint's entry.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import numpy as np
import optax

from hetd.core.store import KINDS, MAX_PENDING, Snapshot, Store, Tensors, outer_name

T = TypeVar("T")

__all__ = ["LedgerStore", "NoParameters"]


class NoParameters(RuntimeError):
    """What asks a head without parameters for them (a caller's bug: it must pull them)."""


class LedgerStore(Store):
    """The version, the queued steps' count and the optimizers' specs, without tensors."""

    holds_params = False

    def __init__(
        self,
        params: Mapping[str, Any],
        tx: optax.GradientTransformation,
        version: int = 0,
        outer: optax.GradientTransformation | None = None,
        outer_spec: str | None = None,
    ) -> None:
        """The model's shapes are read from ``params``, which are not kept."""
        # (no jitted steps, no device buffers: only what the engine and the log read)
        self._tx = tx
        self._params = {}
        self._opt_state = tx.init({})
        self._outer = outer
        self._outer_state = outer.init({}) if outer is not None else None
        self.outer_spec = outer_name(outer_spec, outer)
        self.version = version
        self.shapes = {k: tuple(np.shape(v)) for k, v in params.items()}
        self._n_params = sum(math.prod(s) for s in self.shapes.values())
        self._snapshot = None
        self._pending = []
        self.combine = False
        self.step_each = False
        self.hashes = False
        self.frame_sink = None
        self.decisions = None
        self._lock = threading.RLock()

    def restart_optimizer(self) -> None:
        with self._lock:
            self.flush()
            if self.decisions is not None:
                self.decisions.restart()

    def apply(self, kind: str, tensors: Tensors, scale: float) -> int:
        """Queue one update (a header's: ``tensors`` empty) and bump the version."""
        if kind not in KINDS:
            raise ValueError(f"unknown update kind {kind!r}; known: {', '.join(KINDS)}")
        with self._lock:
            self._pending.append((kind, {}, scale))
            self.version += 1
            if len(self._pending) >= MAX_PENDING:
                self.flush()
            return self.version

    def warm(self, int8: bool = False) -> None:
        """Nothing to compile."""

    def flush(self) -> None:
        """The queued steps' run, written to the log (the pservers run theirs there)."""
        with self._lock:
            pending, self._pending = self._pending, []
            if pending and self.decisions is not None:
                self.decisions.step(self.combine)

    def snapshot(self) -> Snapshot:
        raise NoParameters("the head holds no parameters ([pservers] headers): pull them")

    def read(self, fn: Callable[[int, Mapping[str, np.ndarray]], T]) -> T:
        raise NoParameters("the head holds no parameters ([pservers] headers): pull them")

    def state(self) -> tuple[dict[str, np.ndarray], Any, int]:
        """No parameters, the (empty) optimizer state's shape, and the version: a checkpoint's."""
        with self._lock:
            self.flush()
            opt: Any = self._opt_state
            if self._outer is not None:
                opt = {"grad": self._opt_state, "outer": self._outer_state}
            return {}, opt, self.version

    def restore(self, params: Tensors, opt_state: Any, version: int) -> None:
        """A checkpoint's version (its parameters, when it has any, are the pservers')."""
        with self._lock:
            self._pending = []
            self.version = version
