"""Updates into the model, a part of :class:`hetd.core.engine.Engine` (:class:`Applier`): the store,
the aggregation buffers a policy fills (e.g. one per synchronous round) and the count of updates
applied."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hetd.core.store import Aggregator, Store, Tensors
from policies.types import Flush


class Applier:
    """Applies pushes, buffers them by group, and flushes groups as one update each."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.buffers: dict[int, Aggregator] = {}  # group (e.g. round) -> buffered updates
        self.updates_applied = 0

    def apply(self, kind: str, tensors: Tensors, weight: float) -> None:
        self.store.apply(kind, tensors, weight)
        self.updates_applied += 1

    def buffer(self, group: int, kind: str, tensors: Tensors, weight: float) -> None:
        self.buffers.setdefault(group, Aggregator()).add(kind, tensors, weight)

    def flush(self, d: Flush) -> None:
        """Apply the buffered groups up to ``d.upto`` (all: None), oldest first."""
        groups = sorted(g for g in self.buffers if d.upto is None or g <= d.upto)
        for g in groups:
            agg = self.buffers.pop(g, None)
            if agg is None or not agg.count:
                continue
            for kind, tensors in agg.take(d.normalize):
                self.store.apply(kind, tensors, d.scale)
            self.updates_applied += 1

    def buffered(self) -> int:
        """Pushes waiting in aggregation buffers."""
        return sum(b.count for b in self.buffers.values())

    def saved_buffers(self) -> dict[int, Mapping[str, Any]]:
        """The non-empty buffers as a checkpoint keeps them."""
        return {g: agg.state() for g, agg in self.buffers.items() if agg.count}

    def restore_buffers(self, saved: Mapping[int, Mapping[str, Any]]) -> None:
        self.buffers = {int(g): Aggregator.from_state(b) for g, b in saved.items()}
