"""One pserver's state machine, without its sockets: the slice, its saved copies and its parts file.

A :class:`Node` starts from its newest saved slice (:mod:`hetd.pserver.disk`), or from the
initial tensors the head sent when it has none, and reads its parts file back, so that every part
it ever reported held is held again. Then it takes parts (:meth:`Node.receive`: appended to the
parts file before it answers) and the head's records (:meth:`Node.offer`), and :meth:`Node.advance`
carries the records out in order. At each ``checkpoint`` entry the slice is saved to disk, the parts
file keeps only the parts of pushes the slice has not consumed, and the position becomes
*durable*: the head may forget the records up to it once every pserver reports as much.

A restart therefore loses nothing and applies nothing twice: the saved slice holds each worker's
last consumed push id, the records after its position come again from the head, and the parts
they name come back from the parts file (those consumed after the saved position included).

**A new head life** (the head restarted from its own checkpoint, at log position ``start``): the
records after ``start`` are a new history, which begins with a ``restore`` entry naming the
checkpoint entry of the head's file; every pserver saved its slice there. A node that followed
another life goes back to position ``start`` and the restore entry loads that slice from disk.

**For a head that sees only the pushes' headers** (``Setup.headers``) the node also measures
each part it holds (:meth:`Node.measuring`: its sum of squares and value bytes, a
:class:`Measure`, computed once in a thread and forgotten once the part is consumed or freed) and
hashes each release it keeps for pulls (:meth:`Node.release_hash`, once per release, in a
thread): that head holds no tensors to measure or hash. Without it neither is computed.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import jax
import numpy as np

from hetd.core.ingest import update_norm
from hetd.core.store import Int8, Tensors, make_optimizer, make_outer
from hetd.protocol.params import param_hash
from hetd.pserver import disk
from hetd.pserver.commit import GroupCommit
from hetd.pserver.link import LinkError, decode_tensors
from hetd.pserver.log import Record
from hetd.pserver.partition import PartitionMap
from hetd.pserver.slice import LogMismatch, SliceSaved, SliceState

log = logging.getLogger("hetd.pserver")

KEEP = 3  # releases a node keeps for pulls (see :class:`~hetd.pserver.slice.SliceState`)


class NodeError(RuntimeError):
    """The node cannot start or go on (no slice to start from, a saved slice it cannot find)."""


@dataclass(frozen=True, slots=True)
class Setup:
    """What the head's welcome says: the model's cut and how its store steps."""

    pmap: PartitionMap
    optimizer: str  # the daemon's optimizer spec
    outer: str  # the outer optimizer's spec at the log's start
    combine: bool
    step_each: bool
    epoch: str  # the head's life
    start: int  # the log position this head life began at
    headers: bool = False  # the head sees only the pushes' headers (see :class:`Measure`)


@dataclass(frozen=True, slots=True)
class Measure:
    """What a head that sees only the pushes' headers reads of a part (its ``have`` frame's
    ``sq`` and ``bytes``): the head measured these itself from the whole push before."""

    sq: float  # the part's sum of squares as the slice reads it (NaN or inf: not all finite)
    nbytes: int  # its tensors' value bytes: 1 per int8 value, 4 per float32 one


def measure(tensors: Tensors) -> Measure:
    """A part's :class:`Measure`: its squares summed as the daemon measures a whole push for its
    update guard (:func:`hetd.core.ingest.update_norm`, squared: an int8 tensor's values squared
    times its scale squared), and its values' bytes (as it came, or as read back from the
    parts file: the same)."""
    nbytes = sum(
        t.q.nbytes if isinstance(t, Int8) else np.asarray(t).nbytes for t in tensors.values()
    )
    return Measure(update_norm(tensors) ** 2, nbytes)


class Node:
    """One pserver: its slice following the log, saved at each checkpoint entry."""

    def __init__(
        self,
        directory: Path,
        server: int,
        setup: Setup,
        base: Mapping[str, Any] | None = None,
        *,
        sync: bool = True,
    ) -> None:
        """``base``: the slice's initial tensors (the head's parameters at position 0), used
        when nothing is saved; ``sync``: fsync each part appended (off only in tests)."""
        self.directory = directory
        self.server = server
        self.setup = setup
        self._tx = make_optimizer(setup.optimizer)
        self.slice = self._start(base)
        self.durable = self.slice.position  # the newest position saved to disk
        self.parts = disk.PartsFile(directory, sync)
        self.commit = GroupCommit(self.parts)  # one fsync for the parts that come together
        # headers mode: each held part's measure, computed once in a thread (see :meth:`measuring`)
        self._measures: dict[tuple[int, int], asyncio.Future[Measure]] = {}
        # headers mode: each kept release's hash, by the release's tensors (held here, so the
        # identity stays theirs), computed once in a thread (see :meth:`release_hash`)
        self._hashes: list[tuple[Mapping[str, np.ndarray], asyncio.Future[str]]] = []
        replayed = 0
        for worker, pid, raw in self.parts.read():
            try:
                replayed += self.slice.receive(worker, pid, decode_tensors(raw, self.slice.shapes))
            except (LinkError, ValueError):  # not this map's parts: a file of another model
                raise NodeError(f"{self.parts.path}: a part that is not this slice's") from None
        log.info(
            "pserver %d at position %d (version %d), %d parts read back",
            server,
            self.slice.position,
            self.slice.store.version,
            replayed,
        )

    @property
    def position(self) -> int:
        """The last log position carried out."""
        return self.slice.position

    def _start(self, base: Mapping[str, Any] | None) -> SliceState:
        setup = self.setup
        saved = self._newest()
        if saved is None:
            if base is None:
                raise NodeError(
                    f"pserver {self.server} has no saved slice in {self.directory} and the head "
                    "sent no initial tensors (its log no longer starts at position 0)"
                )
            return self._slice(base, setup.outer, 0, setup.start)
        state = saved.slice
        if saved.epoch != setup.epoch:  # a new head life: its records begin after `start`
            if state.position > setup.start:
                older = [s for s in self._all() if s.slice.position <= setup.start]
                if older:
                    state = older[0].slice
            state = replace(state, position=setup.start)
        return self._resume(state)

    def _all(self) -> list[disk.Saved]:
        out = []
        for path in disk.listing(self.directory):
            try:
                out.append(disk.load(path))
            except disk.DiskError as exc:
                log.warning("skipping %s", exc)
        return out

    def _newest(self) -> disk.Saved | None:
        found = self._all()
        return found[0] if found else None

    def _slice(
        self, params: Mapping[str, Any], outer: str, version: int, position: int
    ) -> SliceState:
        return SliceState(
            self.setup.pmap,
            self.server,
            params,
            self._tx,
            outer=make_outer(outer),
            outer_spec=outer,
            combine=self.setup.combine,
            step_each=self.setup.step_each,
            version=version,
            position=position,
            load=self._load,
            keep=KEEP,
        )

    def _resume(self, state: SliceSaved) -> SliceState:
        """A slice restarted from ``state`` (its optimizer state a list of leaves)."""
        outer = state.outer or self.setup.outer
        fresh = self._slice(state.params, outer, state.version, state.position)
        target = fresh.store.state()[1]
        opt = jax.tree.unflatten(jax.tree.structure(target), list(state.opt_state))
        fresh.restore(replace(state, opt_state=opt))
        return fresh

    def _load(self, ref: str) -> SliceSaved:
        """A restore entry's slice, from disk."""
        found = disk.find(self.directory, ref)
        if found is None:
            raise LogMismatch(f"pserver {self.server} has no saved slice {ref!r} to restore")
        target = self.slice.store.state()[1]
        leaves = list(found.slice.opt_state)
        return replace(
            found.slice, opt_state=jax.tree.unflatten(jax.tree.structure(target), leaves)
        )

    # --- inputs ---------------------------------------------------------------------------------

    def receive(self, worker: int, pid: int, raw: Any, *, fsync: bool = True) -> bool:
        """A push's part (as the link carries it): checked, kept and appended to the parts file;
        False when it is a repeat or already consumed (nothing written). ``fsync``: written and
        fsynced here before this returns; else handed as it is (``raw``, not copied) to the
        writer thread (:class:`GroupCommit`), and the caller awaits :meth:`parts_durable` before
        it reports the part held. :class:`LinkError` when it is not this slice's part."""
        tensors = decode_tensors(raw, self.slice.shapes)
        if not self.slice.receive(worker, pid, tensors):
            return False
        # an error here (disk full) stops the pserver
        if fsync:
            self.parts.append(worker, pid, tensors)
        else:
            self.commit.submit(worker, pid, raw)  # (what replay decodes: the same checks passed)
        return True

    async def parts_durable(self) -> None:
        """Return once every part handed to the writer so far is written and fsynced (with the
        parts handed over meanwhile by other senders: one fsync for them all, off the event
        loop). A repeat's earlier copy is among them, so a repeat is answered held no sooner
        than the part it repeats."""
        await self.commit.wait(self.commit.submitted)

    def measuring(self, worker: int, pid: int) -> asyncio.Future[Measure] | None:
        """The held part of push ``pid``'s :class:`Measure` (headers mode), computed once, off
        the event loop (a thread reads the part's tensors, which nothing changes), from the
        first call: call it as the part is taken, and await it after its fsync. None when the
        part is not held (consumed, or freed). Called on the event loop."""
        key = (worker, pid)
        found = self._measures.get(key)
        if found is not None:
            return found
        part = self.slice.part(worker, pid)
        if part is None:
            return None
        made = asyncio.get_running_loop().run_in_executor(None, measure, part)
        self._measures[key] = made
        return made

    def release_hash(self, tensors: Mapping[str, np.ndarray]) -> asyncio.Future[str]:
        """A kept release's :func:`~hetd.protocol.params.param_hash` (headers mode: a ``slice``
        answer carries it), computed once per release in a thread. ``tensors``: as
        :meth:`SliceState.release_at` gives them. The hash read while the release is kept is
        its own: check :meth:`keeps` after awaiting it (a release no longer kept may have its
        memory reused for a newer one's)."""
        kept = [t for _, _, t in self.slice.kept]
        self._hashes = [(t, f) for t, f in self._hashes if any(t is k for k in kept)]
        for t, f in self._hashes:
            if t is tensors:
                return f
        made = asyncio.get_running_loop().run_in_executor(None, param_hash, tensors)
        self._hashes.append((tensors, made))
        return made

    def keeps(self, tensors: Mapping[str, np.ndarray]) -> bool:
        """Whether ``tensors`` (a release :meth:`SliceState.release_at` gave) is still kept."""
        return any(t is tensors for _, _, t in self.slice.kept)

    def offer(self, records: Iterable[Record]) -> None:
        """The head's records, in position order (those already offered are skipped)."""
        self.slice.offer(records)

    def advance(self) -> list[int]:
        """Carry out what can be; save the slice at each checkpoint entry passed; the positions
        that became durable (in order)."""
        self.slice.advance()
        if self._measures:  # (headers mode) forget the measures of parts no longer held
            for key in [k for k in self._measures if not self.slice.holds(*k)]:
                del self._measures[key]
        durable = []
        for ref, saved in sorted(self.slice.saved.items(), key=lambda kv: kv[1].position):
            disk.save(self.directory, saved, ref=ref, epoch=self.setup.epoch)
            kept = self.parts.keep(saved.done)
            del self.slice.saved[ref]  # on disk now; a restore entry loads it from there
            self.durable = saved.position
            durable.append(saved.position)
            log.info(
                "pserver %d saved at position %d (%d parts kept)", self.server, saved.position, kept
            )
        return durable

    def params(self) -> dict[str, Any]:
        """The slice's tensors at its position (see :meth:`SliceState.params`)."""
        return self.slice.params()

    def close(self) -> None:
        """Write and fsync the parts handed over, then close the parts file."""
        self.commit.close()
