"""One pserver's slice: its parts of the parameters, its own optimizer state, the log replayed.

A slice is the single store's machinery run on fewer tensors: a :class:`hetd.core.store.Store`
over the slice's parts (keyed as the partition map names them) behind a
:class:`hetd.core.applier.Applier`, so every step is the same jitted arithmetic the one-process
daemon runs, on a subset of the values. For an optimizer that can be cut
(:mod:`hetd.pserver.separable`) the parameters come out the same: bit for bit for products and
sums; a division by a scalar the step computes (Adam's bias correction) XLA may compile as a
product with the reciprocal in one compiled step and not in another, which is a rounding apart.

Two streams arrive in any interleaving: push *parts* (:meth:`SliceState.receive`, from workers)
and log *records* (:meth:`SliceState.offer`, from the head, in position order). :meth:`advance`
carries out the records in order for as long as it can: an apply or buffer whose part has not
arrived waits, and everything behind it waits too. Exactly once holds per push id: a part is
consumed by the one entry that names it; a part that arrives again, or after its entry ran, is
ignored; ids only grow per worker (the head logs each push once, in id order), so one number
per worker says which are done, and a held part that the log passed by (a push the head refused
without logging it) is freed.

After each record the slice checks that its store counts the version the head wrote; a
difference means the two disagree about what was applied, and stops the slice
(:class:`LogMismatch`) rather than let it serve another model.

**Releases kept for pulls** (``keep`` > 0, a pserver process's slice): the parameters change only
where the store runs its queued steps, so after each record that leaves no step queued and a new
version (or a restore) the slice keeps that version's tensors (read-only host arrays, one copy)
with the position it began at; the newest ``keep`` are kept. :meth:`SliceState.release_at` gives
the version and tensors in force at a position: those of the newest kept release at or before it.
The store packs each version into the memory of one that is no longer kept (:class:`Buffers`):
fresh memory each version would cost its pages' faults, as much as the copy itself.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import jax
import numpy as np
import optax

from hetd.core.applier import Applier
from hetd.core.store import Int8, Store, Tensors
from hetd.pserver.log import (
    ApplyEntry,
    BufferEntry,
    CheckpointEntry,
    DropEntry,
    FlushEntry,
    OuterEntry,
    Record,
    RestartEntry,
    RestoreEntry,
    StepEntry,
)
from hetd.pserver.partition import PartitionMap
from policies.types import Flush


class LogMismatch(RuntimeError):
    """The slice and the log disagree (a version, or a record out of order)."""


@dataclass(frozen=True, slots=True)
class SliceSaved:
    """A slice as a checkpoint keeps it (host values, no references to the live state)."""

    params: dict[str, np.ndarray]  # part key -> array
    opt_state: Any  # the optimizer state as Store.state gives it (host pytree)
    version: int  # the store's version
    position: int  # the last log position carried out
    buffers: dict[int, Mapping[str, Any]]  # the applier's buffered groups
    done: dict[int, int] = field(default_factory=dict)  # worker -> last push id consumed
    outer: str = ""  # the outer optimizer's spec its state is for ("": not recorded)


Loader = Callable[[str], SliceSaved]  # a checkpoint's name -> this slice of it


class Buffers:
    """Where a slice that keeps releases has its store pack each snapshot
    (:class:`hetd.core.peers.FrameSink`): the memory of a release no longer kept, given back
    with :meth:`give`, or fresh memory when there is none."""

    def __init__(self, spare: int = 1) -> None:
        self.spare = spare
        self.free: list[np.ndarray] = []
        self.last: tuple[int, np.ndarray] | None = None  # (version, buffer) packed last

    def reserve(self, nbytes: int) -> np.ndarray | None:
        for i, buf in enumerate(self.free):
            if buf.nbytes == nbytes:
                return self.free.pop(i)
        return np.empty(nbytes, np.uint8)

    def commit(self, buf: np.ndarray, frame: memoryview, version: int) -> None:
        self.last = (version, buf)

    def give(self, buf: np.ndarray) -> None:
        """``buf`` is read by nothing any more."""
        if len(self.free) < self.spare:
            self.free.append(buf)


class SliceState:
    """One pserver's slice of the model, replaying the head's log. One writer."""

    def __init__(
        self,
        pmap: PartitionMap,
        server: int,
        params: Mapping[str, Any],
        tx: optax.GradientTransformation,
        *,
        outer: optax.GradientTransformation | None = None,
        outer_spec: str | None = None,
        combine: bool = False,
        step_each: bool = False,
        version: int = 0,
        position: int = 0,
        load: Loader | None = None,
        keep: int = 0,
    ) -> None:
        """``params``: this pserver's slice (:func:`hetd.pserver.partition.split`'s
        ``[server]``); ``tx``, ``outer``, ``combine``, ``step_each``: as the single store has
        them; ``version``, ``position``: where the log stands for these parameters; ``load``:
        reads a saved slice for a restore entry (None: only those saved here); ``keep``: the
        releases kept for pulls (0: none)."""
        self.shapes = pmap.slice_shapes(server)
        got = {k: tuple(np.shape(v)) for k, v in params.items()}
        if got != self.shapes:
            raise ValueError(f"the slice's tensors do not match pserver {server}'s parts")
        self.server = server
        self.store = Store(params, tx, version, outer, outer_spec)
        self.store.combine = combine
        self.store.step_each = step_each
        self.store.hashes = False  # a slice is hashed as part of a whole version, not alone
        self.applier = Applier(self.store)
        self.position = position  # the last record carried out
        self.saved: dict[str, SliceSaved] = {}  # checkpoints taken here, by name (the shell's)
        self._load = load
        self._parts: dict[tuple[int, int], Tensors] = {}  # (worker, pid) -> this slice's part
        self._done: dict[int, int] = {}  # worker -> the last push id an entry consumed
        self._queue: deque[Record] = deque()  # records offered, not yet carried out
        self._offered = position  # the last position offered
        self.keep = keep
        # (the position it began at, version, tensors), oldest first: what pulls are served from
        self.kept: deque[tuple[int, int, Mapping[str, np.ndarray]]] = deque()
        self._buffers: deque[np.ndarray | None] = deque()  # the kept releases' memory
        self._sink = Buffers() if keep else None
        self.store.frame_sink = self._sink
        self._capture(fresh=True)

    # --- inputs ------------------------------------------------------------------------------

    def receive(self, worker: int, pid: int, tensors: Tensors) -> bool:
        """A push's part arrived; False (nothing kept) when it is a repeat or already done.
        ValueError when its tensors are not this slice's parts."""
        key = (worker, pid)
        if pid <= self._done.get(worker, -1) or key in self._parts:
            return False
        got = {
            k: tuple(v.q.shape if isinstance(v, Int8) else np.shape(v)) for k, v in tensors.items()
        }
        if got != self.shapes:
            raise ValueError(
                f"push {pid} of worker {worker}: its part is not pserver {self.server}'s"
            )
        self._parts[key] = tensors
        return True

    def offer(self, records: Iterable[Record]) -> None:
        """Log records, in position order; those already offered are skipped, a gap raises."""
        for r in records:
            if r.position <= self._offered:
                continue
            if r.position != self._offered + 1:
                raise LogMismatch(f"log position {r.position} after {self._offered}: a gap")
            self._queue.append(r)
            self._offered = r.position

    # --- replay ------------------------------------------------------------------------------

    def advance(self) -> int:
        """Carry out the offered records in order until one waits for its part; the position
        reached."""
        while self._queue:
            r = self._queue[0]
            if not self._ready(r.entry):
                break
            self._queue.popleft()
            self._run(r)
            if self.store.version != r.version:
                raise LogMismatch(
                    f"pserver {self.server} at version {self.store.version} after position "
                    f"{r.position}; the log says {r.version}"
                )
            self.position = r.position
            self._capture(fresh=isinstance(r.entry, RestoreEntry))
        return self.position

    def _capture(self, fresh: bool = False) -> None:
        """Keep the parameters in force from this position when they are a new version
        (``fresh``: a restore, after which nothing kept before holds)."""
        if not self.keep or self.store.pending:
            return
        if fresh:  # (their memory is left to the collector: the store may still read the last)
            self.kept.clear()
            self._buffers.clear()
        elif self.kept and self.kept[-1][1] == self.store.version:
            return
        snap = self.store.snapshot()  # read-only host arrays, one copy per version
        last = self._sink.last if self._sink is not None else None
        self.kept.append((self.position, snap.version, snap.tensors))
        self._buffers.append(last[1] if last is not None and last[0] == snap.version else None)
        if self._sink is not None:
            self._sink.last = None
        while len(self.kept) > self.keep:  # (never the store's own snapshot: the newest)
            self.kept.popleft()
            buf = self._buffers.popleft()
            if buf is not None and self._sink is not None:
                self._sink.give(buf)

    def release_at(self, position: int) -> tuple[int, Mapping[str, np.ndarray]] | None:
        """The version and tensors in force at ``position`` (at most the slice's own); None when
        that release is no longer kept (or ``position`` is not reached yet)."""
        if position > self.position:
            return None
        for began, version, tensors in reversed(self.kept):
            if began <= position:
                return version, tensors
        return None

    def waiting_for(self) -> tuple[int, int] | None:
        """The push (worker, pid) whose part the next record waits for; None if none."""
        if self._queue and not self._ready(self._queue[0].entry):
            e = self._queue[0].entry
            assert isinstance(e, ApplyEntry | BufferEntry)  # _ready is False only for these
            return e.worker, e.pid
        return None

    def held(self) -> int:
        """Parts held for entries still to come."""
        return len(self._parts)

    def holding(self) -> list[tuple[int, int]]:
        """The pushes (worker, pid) whose parts are held for entries still to come."""
        return sorted(self._parts)

    def part(self, worker: int, pid: int) -> Tensors | None:
        """Push ``pid``'s part held here for an entry still to come (its tensors are not
        changed while held, nor after: a thread may read them), or None."""
        return self._parts.get((worker, pid))

    def holds(self, worker: int, pid: int) -> bool:
        """Whether push ``pid`` of ``worker`` has its part here, not yet consumed."""
        return (worker, pid) in self._parts

    def _ready(self, e: object) -> bool:
        return not isinstance(e, ApplyEntry | BufferEntry) or (e.worker, e.pid) in self._parts

    def _run(self, r: Record) -> None:
        e = r.entry
        if isinstance(e, ApplyEntry):
            self.applier.apply(e.kind, self._consume(e.worker, e.pid), e.scale)
        elif isinstance(e, BufferEntry):
            self.applier.buffer(e.group, e.kind, self._consume(e.worker, e.pid), e.weight)
        elif isinstance(e, DropEntry):
            self._consume(e.worker, e.pid)
        elif isinstance(e, FlushEntry):
            self.applier.flush(Flush(normalize=e.normalize, scale=e.scale, upto=e.upto))
        elif isinstance(e, StepEntry):
            if e.combine is not None:  # the head's store summed these (or stopped summing)
                self.store.combine = e.combine
            self.store.flush()
        elif isinstance(e, OuterEntry):
            self.store.set_outer(e.spec)
        elif isinstance(e, RestartEntry):
            self.store.restart_optimizer()
        elif isinstance(e, CheckpointEntry):
            self.saved[e.ref] = self.state(r.position)
        elif isinstance(e, RestoreEntry):
            self._restore(self._saved(e.ref))

    def _consume(self, worker: int, pid: int) -> Tensors:
        """The push's part, taken; held parts of the same worker the log passed by are freed."""
        part = self._parts.pop((worker, pid), {})
        self._done[worker] = pid
        for w, p in [k for k in self._parts if k[0] == worker and k[1] < pid]:
            del self._parts[(w, p)]
        return part

    # --- checkpoints -------------------------------------------------------------------------

    def params(self) -> dict[str, np.ndarray]:
        """The slice's parameters at the last position carried out (host arrays).

        The queued steps run first. With the store's ``combine`` that is allowed only where the
        log ran them (right after a step entry): running them anywhere else would sum other
        updates into one step than the head's store did, and the slice would leave the model."""
        if self.store.combine and self.store.pending:
            raise LogMismatch(
                f"pserver {self.server}: {self.store.pending} steps queued at position "
                f"{self.position}; read the parameters at a step entry (a release), not between"
            )
        return dict(self.store.snapshot().tensors)

    def state(self, position: int | None = None) -> SliceSaved:
        """The slice as a checkpoint keeps it, at ``position`` (default: the last carried out)."""
        params, opt, version = self.store.state()
        # copies: on a CPU the host values may share memory with buffers the next step donates
        return SliceSaved(
            {k: np.array(v) for k, v in params.items()},
            _copy(opt),
            version,
            self.position if position is None else position,
            dict(self.applier.saved_buffers()),
            dict(self._done),
            self.store.outer_spec,
        )

    @classmethod
    def resume(
        cls,
        pmap: PartitionMap,
        server: int,
        saved: SliceSaved,
        tx: optax.GradientTransformation,
        **kwargs: Any,
    ) -> SliceState:
        """A slice restarted from a saved one (a pserver that died): it goes on from the saved
        position; offer it the log from there (``DecisionLog.since(saved.position)``)."""
        s = cls(pmap, server, saved.params, tx, position=saved.position, **kwargs)
        s._restore(saved)
        s._capture(fresh=True)
        return s

    def restore(self, saved: SliceSaved) -> None:
        """Load ``saved`` (its optimizer state in this slice's structure) as this slice's state;
        the position stays."""
        self._restore(saved)
        self._capture(fresh=True)

    def _saved(self, ref: str) -> SliceSaved:
        if ref in self.saved:
            return self.saved[ref]
        if self._load is None:
            raise LogMismatch(f"pserver {self.server} cannot load checkpoint {ref!r}")
        return self._load(ref)

    def _restore(self, saved: SliceSaved) -> None:
        # copies, so that the steps that donate the store's buffers never write into ``saved``
        self.store.restore(_copy(saved.params), _copy(saved.opt_state), saved.version)
        self.applier.restore_buffers(saved.buffers)
        self._done = dict(saved.done)
        for key in [k for k in self._parts if k[1] <= self._done.get(k[0], -1)]:
            del self._parts[key]


def _copy(tree: Any) -> Any:
    """A pytree of host arrays, each a fresh copy."""
    return jax.tree.map(np.array, tree)
