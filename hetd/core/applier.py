"""Updates into the model, a part of :class:`hetd.core.engine.Engine` (:class:`Applier`): the store,
the aggregation buffers a policy fills (e.g. one per synchronous round) and the count of updates
applied; and, when the engine is given one, the decision log it tells each of them
(:class:`DecisionSink`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hetd.core.decisions import DecisionSink, LogMismatch
from hetd.core.store import Aggregator, Store, Tensors
from policies.types import Flush


class Applier:
    """Applies pushes, buffers them by group, and flushes groups as one update each. With a
    decision log (the store's :attr:`~hetd.core.store.Store.decisions`), each of these is
    logged before the store moves, and the log's version checked against the store's after."""

    def __init__(self, store: Store, decisions: DecisionSink | None = None) -> None:
        """``decisions``: a decision log to write every decision carried out into, in order
        (None, the default: none is kept, at no cost); it must stand at the store's version."""
        if decisions is not None:
            if decisions.version != store.version:
                raise LogMismatch(
                    f"the decision log stands at version {decisions.version}, the store at "
                    f"{store.version}: give the engine a log that starts where its store is"
                )
            store.decisions = decisions
        self.store = store
        self.checkpoint_ref: str | None = None  # the log's last checkpoint entry's name
        self.buffers: dict[int, Aggregator] = {}  # group (e.g. round) -> buffered updates
        self.updates_applied = 0

    def apply(
        self, kind: str, tensors: Tensors, weight: float, push: tuple[int, int] | None = None
    ) -> None:
        """Apply one update; ``push``: its (worker, push id), which a decision log needs."""
        sink = self.store.decisions
        if sink is not None:
            sink.apply(*_named(push), kind, weight)
        self.store.apply(kind, tensors, weight)
        self.updates_applied += 1
        if sink is not None:
            self._check(sink)

    def buffer(
        self,
        group: int,
        kind: str,
        tensors: Tensors,
        weight: float,
        push: tuple[int, int] | None = None,
    ) -> None:
        """Keep one update in ``group`` (``push`` as for :meth:`apply`)."""
        sink = self.store.decisions
        if sink is not None:
            sink.buffer(*_named(push), kind, group, weight)
        self.buffers.setdefault(group, Aggregator()).add(kind, tensors, weight)

    def discard(self, worker: int, pid: int) -> None:
        """A push that will never be applied (dropped, or refused by the guard): only a
        decision log hears of it (a pserver frees its part)."""
        sink = self.store.decisions
        if sink is not None:
            sink.drop(worker, pid)

    def flush(self, d: Flush) -> None:
        """Apply the buffered groups up to ``d.upto`` (all: None), oldest first."""
        groups = sorted(g for g in self.buffers if d.upto is None or g <= d.upto)
        sink = self.store.decisions
        if sink is not None and groups:
            sink.flush(d)
        for g in groups:
            agg = self.buffers.pop(g, None)
            if agg is None or not agg.count:
                continue
            for kind, tensors in agg.take(d.normalize):
                self.store.apply(kind, tensors, d.scale)
            self.updates_applied += 1
        if sink is not None and groups:
            self._check(sink)

    def buffered(self) -> int:
        """Pushes waiting in aggregation buffers."""
        return sum(b.count for b in self.buffers.values())

    def saved_buffers(self) -> dict[int, Mapping[str, Any]]:
        """The non-empty buffers as a checkpoint keeps them."""
        return {g: agg.state() for g, agg in self.buffers.items() if agg.count}

    def restore_buffers(self, saved: Mapping[int, Mapping[str, Any]]) -> None:
        self.buffers = {int(g): Aggregator.from_state(b) for g, b in saved.items()}

    def buffered_kinds(self) -> dict[int, tuple[str, ...]]:
        """Each non-empty group's kinds, in the order first buffered (a log's restore entry)."""
        return {g: agg.kinds for g, agg in self.buffers.items() if agg.count}

    def log_checkpoint(self) -> None:
        """With a decision log, a ``checkpoint`` entry named :attr:`checkpoint_ref` (each
        pserver saves its slice there)."""
        sink = self.store.decisions
        if sink is not None:
            self.checkpoint_ref = f"p{sink.position + 1}"
            sink.checkpoint(self.checkpoint_ref)

    def log_restore(self, name: str, version: int) -> None:
        """With a decision log, a ``restore`` entry naming the checkpoint ``name`` (at
        ``version``) whose slices pservers load (after the buffers were restored)."""
        sink = self.store.decisions
        if sink is not None:
            sink.restore(name, version, self.buffered_kinds())

    def _check(self, sink: DecisionSink) -> None:
        if sink.version != self.store.version:
            raise LogMismatch(
                f"the decision log is at version {sink.version} after position {sink.position}; "
                f"the store at {self.store.version}"
            )


def _named(push: tuple[int, int] | None) -> tuple[int, int]:
    if push is None:  # a caller's bug, not input: every logged update names its push
        raise ValueError("a decision log is kept: an applied or buffered update must name its push")
    return push
