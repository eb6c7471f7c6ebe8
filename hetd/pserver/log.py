"""The decision log: what the head decided, in one order, for every pserver to replay.

A policy decides from a push's metadata only, never from its tensors, so one head can decide and
S pservers can carry the decisions out on their own slices. The head writes each decision the
engine's :class:`hetd.core.applier.Applier` would carry out as one *entry*; a pserver replays the
entries in order (:mod:`hetd.pserver.slice`) and so ends at the same version as the head says.

Each entry gets a *position* (1, 2, ...; 0 is the empty log) and the store *version* it leaves
(an apply adds one, a flush one per kind per buffered group, as the single store counts), so a
release is a position and a pserver checks after each entry that it counts the same version. The
kinds, and what the single store does for each:

* :class:`ApplyEntry` — ``Applier.apply``: push ``(worker, pid)``'s update, its step scaled by
  ``scale`` (the policy's weight times any ``Scale`` factors);
* :class:`BufferEntry` — ``Applier.buffer``: the push kept in ``group`` with ``weight``;
* :class:`FlushEntry` — ``Applier.flush``: the buffered groups up to ``upto`` applied;
* :class:`DropEntry` — the push discarded (a pserver frees the part it holds);
* :class:`StepEntry` — ``Store.flush``: the queued steps run now (with the store's ``combine``,
  the steps queued between two of these are summed per kind, so all pservers must cut the same);
* :class:`OuterEntry` — ``Store.set_outer``: deltas go through another outer optimizer;
* :class:`RestartEntry` — ``Store.restart_optimizer``: the gradients' optimizer starts afresh;
* :class:`CheckpointEntry` — each pserver saves its slice as it stands at this position (the
  queued steps run first, as they do when the single store's state is checkpointed);
* :class:`RestoreEntry` — each pserver loads its slice of a checkpoint, at its version.

:class:`DecisionLog` is the head's side: it appends entries, counts versions the way the
applier does, refuses a push logged twice, hands out the entries after a position and forgets
those a checkpoint covers. Entries travel as plain msgpack-able dicts (:func:`to_dict`,
:func:`from_dict`, strict as the wire is).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from hetd.core.decisions import DecisionSink
from hetd.core.store import KINDS
from policies.types import Flush


@dataclass(frozen=True, slots=True)
class ApplyEntry:
    """Apply push ``(worker, pid)`` now, its step scaled by ``scale``."""

    worker: int
    pid: int
    kind: str  # "grad" or "delta"
    scale: float


@dataclass(frozen=True, slots=True)
class BufferEntry:
    """Keep push ``(worker, pid)`` in ``group`` with ``weight`` for a later flush."""

    worker: int
    pid: int
    kind: str
    group: int
    weight: float


@dataclass(frozen=True, slots=True)
class FlushEntry:
    """Apply the buffered groups up to ``upto`` (None: all), oldest first, as ``Flush`` says."""

    normalize: bool = True
    scale: float = 1.0
    upto: int | None = None


@dataclass(frozen=True, slots=True)
class DropEntry:
    """Push ``(worker, pid)`` is discarded (dropped by the policy, or refused by the guard)."""

    worker: int
    pid: int


@dataclass(frozen=True, slots=True)
class StepEntry:
    """Run the queued steps now (where the single store's ``flush`` ran); ``combine``: whether
    the head's store summed them per kind (its ``combine``, which the engine turns off when it
    stops), and so whether the slice sums these and the next; None keeps the slice's own."""

    combine: bool | None = None


@dataclass(frozen=True, slots=True)
class OuterEntry:
    """Apply deltas through the outer optimizer ``spec`` from now on (a fresh state)."""

    spec: str


@dataclass(frozen=True, slots=True)
class RestartEntry:
    """Start the gradients' optimizer afresh (its moments and step count) from here on."""


@dataclass(frozen=True, slots=True)
class CheckpointEntry:
    """Save the slice as it stands here, under the name ``ref``."""

    ref: str


@dataclass(frozen=True, slots=True)
class RestoreEntry:
    """Load the slice saved under ``ref``; the buffered groups it holds are ``groups``
    (group -> kinds, in the order they were first buffered)."""

    ref: str
    groups: Mapping[int, tuple[str, ...]] = dataclasses.field(default_factory=dict)


Entry = (
    ApplyEntry
    | BufferEntry
    | FlushEntry
    | DropEntry
    | StepEntry
    | OuterEntry
    | RestartEntry
    | CheckpointEntry
    | RestoreEntry
)


@dataclass(frozen=True, slots=True)
class Record:
    """One entry at its position, with the store version it leaves."""

    position: int  # 1, 2, ...
    version: int  # the store's version after the entry
    entry: Entry


OPS: dict[str, type[Any]] = {
    "apply": ApplyEntry,
    "buffer": BufferEntry,
    "flush": FlushEntry,
    "drop": DropEntry,
    "step": StepEntry,
    "outer": OuterEntry,
    "restart": RestartEntry,
    "checkpoint": CheckpointEntry,
    "restore": RestoreEntry,
}
_OP_OF = {cls: op for op, cls in OPS.items()}
# each field's accepted types on the wire (bool is an int to Python: listed apart)
_FIELDS: dict[str, tuple[type, ...]] = {
    "worker": (int,),
    "pid": (int,),
    "kind": (str,),
    "scale": (float, int),
    "group": (int,),
    "weight": (float, int),
    "normalize": (bool,),
    "upto": (int, type(None)),
    "spec": (str,),
    "ref": (str,),
    "combine": (bool, type(None)),
}


def to_dict(r: Record) -> dict[str, Any]:
    """A record as plain values (msgpack-able)."""
    out: dict[str, Any] = {"pos": r.position, "version": r.version, "op": _OP_OF[type(r.entry)]}
    for f in dataclasses.fields(r.entry):
        value = getattr(r.entry, f.name)
        if f.name == "groups":
            value = [[g, list(kinds)] for g, kinds in value.items()]
        out[f.name] = value
    return out


def from_dict(d: Mapping[str, Any]) -> Record:
    """A record read back from :func:`to_dict`'s value; ValueError unless it is well-formed."""
    try:
        op, pos, version = d["op"], d["pos"], d["version"]
        cls = OPS.get(op) if isinstance(op, str) else None
        if cls is None:
            raise ValueError(f"unknown log entry {op!r}; known: {', '.join(OPS)}")
        if not (_is_int(pos) and _is_int(version) and pos >= 1 and version >= 0):
            raise ValueError(f"bad position {pos!r} or version {version!r}")
        names = {f.name for f in dataclasses.fields(cls)}
        if set(d) - names - {"op", "pos", "version"}:
            raise ValueError(f"unknown fields {sorted(set(d) - names - {'op', 'pos', 'version'})}")
        kwargs = {name: _field(name, d[name]) for name in names if name in d}
        entry = cls(**kwargs)
    except (KeyError, TypeError) as exc:
        raise ValueError(f"malformed log entry: {exc!r}") from exc
    if getattr(entry, "kind", "grad") not in KINDS:
        raise ValueError(f"unknown update kind {entry.kind!r}; known: {', '.join(KINDS)}")
    return Record(pos, version, entry)


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _field(name: str, value: Any) -> Any:
    if name == "groups":
        return {int(g): tuple(str(k) for k in kinds) for g, kinds in value}
    types = _FIELDS[name]
    ok = isinstance(value, types) and (bool in types or not isinstance(value, bool))
    if not ok:
        raise ValueError(f"log entry field {name!r} has a bad value {value!r}")
    return float(value) if float in types else value


class DecisionLog:
    """The head's log: entries appended in decision order, versions counted as the applier
    counts them; one writer (the engine's task)."""

    def __init__(self, version: int = 0, position: int = 0) -> None:
        """An empty log that starts at ``position`` (the last one a checkpoint covers) and
        ``version`` (the store's version there)."""
        self.position = position  # the last entry's position
        self.version = version  # the store's version after it
        self.first = position + 1  # the first position still held
        self._base_version = version  # the version at position first - 1
        self._records: list[Record] = []
        self._groups: dict[int, list[str]] = {}  # buffered group -> kinds, first buffered first
        self._last_pid: dict[int, int] = {}  # worker -> the last push id logged
        # called after each append (a link's wake-up; from the engine task or the thread the
        # engine task awaits during a publish): it must be quick and thread-safe
        self.on_append: Callable[[], None] | None = None

    def apply(self, worker: int, pid: int, kind: str, scale: float) -> Record:
        """Log an applied push (one version)."""
        self._check_push(worker, pid, kind)
        return self._append(ApplyEntry(worker, pid, kind, scale), self.version + 1)

    def buffer(self, worker: int, pid: int, kind: str, group: int, weight: float) -> Record:
        """Log a buffered push (no version until its group is flushed)."""
        self._check_push(worker, pid, kind)
        kinds = self._groups.setdefault(group, [])
        if kind not in kinds:
            kinds.append(kind)
        return self._append(BufferEntry(worker, pid, kind, group, weight), self.version)

    def flush(self, d: Flush) -> Record:
        """Log a flush: one version per kind of each group it applies."""
        due = [g for g in self._groups if d.upto is None or g <= d.upto]
        added = sum(len(self._groups.pop(g)) for g in due)
        return self._append(FlushEntry(d.normalize, d.scale, d.upto), self.version + added)

    def drop(self, worker: int, pid: int) -> Record:
        """Log a discarded push (its parts are freed; no version)."""
        self._check_push(worker, pid, None)
        return self._append(DropEntry(worker, pid), self.version)

    def step(self, combine: bool | None = None) -> Record:
        """Log that the queued steps run here (``combine``: as :class:`StepEntry` says)."""
        return self._append(StepEntry(combine), self.version)

    def set_outer(self, spec: str) -> Record:
        """Log a change of outer optimizer."""
        return self._append(OuterEntry(spec), self.version)

    def restart(self) -> Record:
        """Log a fresh start of the gradients' optimizer."""
        return self._append(RestartEntry(), self.version)

    def checkpoint(self, ref: str) -> Record:
        """Log a checkpoint: each pserver saves its slice at this position."""
        return self._append(CheckpointEntry(ref), self.version)

    def restore(self, ref: str, version: int, groups: Mapping[int, Sequence[str]]) -> Record:
        """Log a restore of checkpoint ``ref``, taken at ``version`` with ``groups`` buffered."""
        self._groups = {int(g): list(k) for g, k in groups.items()}
        frozen = {g: tuple(k) for g, k in self._groups.items()}
        return self._append(RestoreEntry(ref, frozen), version)

    def state(self) -> dict[str, Any]:
        """What the head's checkpoint keeps of the log (plain values): where it stands, the
        buffered groups and each worker's last logged push."""
        return {
            "position": self.position,
            "version": self.version,
            "groups": [[g, list(k)] for g, k in self._groups.items()],
            "last_pid": [[w, p] for w, p in self._last_pid.items()],
        }

    @classmethod
    def from_state(cls, state: Mapping[str, Any]) -> DecisionLog:
        """A log that goes on from :meth:`state`'s value (holding no records)."""
        log = cls()
        log.resume(state)
        return log

    def resume(self, state: Mapping[str, Any]) -> None:
        """Go on from :meth:`state`'s value (a checkpoint's), in place: the engine that writes
        this log keeps it. Only a log that holds nothing yet (positions 0) may; ValueError else,
        or when the value is malformed."""
        if self.position != 0 or self._records:
            raise ValueError(f"the log already stands at position {self.position}")
        try:
            position, version = int(state["position"]), int(state["version"])
            groups = {int(g): [str(k) for k in kinds] for g, kinds in state["groups"]}
            last_pid = {int(w): int(p) for w, p in state["last_pid"]}
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"malformed decision log state: {exc!r}") from None
        if position < 0 or version < 0:
            raise ValueError(f"bad log position {position} or version {version}")
        self.position = position
        self.version = self._base_version = version
        self.first = position + 1
        self._groups, self._last_pid = groups, last_pid

    def buffered_groups(self) -> dict[int, tuple[str, ...]]:
        """The groups waiting for a flush and their kinds (what a checkpoint records)."""
        return {g: tuple(k) for g, k in self._groups.items()}

    def since(self, position: int) -> list[Record]:
        """The records after ``position``; ValueError if some were forgotten (the reader must
        load a checkpoint first)."""
        if position < self.first - 1:
            raise ValueError(
                f"the log holds positions from {self.first}; position {position} needs a "
                "checkpoint first"
            )
        return self._records[position - self.first + 1 :]

    def version_at(self, position: int) -> int:
        """The store version after ``position`` (a held one, or the one just before them)."""
        if position == self.first - 1:
            return self._base_version
        i = position - self.first
        if not 0 <= i < len(self._records):
            raise ValueError(f"position {position} is not held ({self.first}..{self.position})")
        return self._records[i].version

    def compact(self, upto: int) -> None:
        """Forget the records up to ``upto`` (a checkpoint at ``upto`` covers them)."""
        if upto > self.position:
            raise ValueError(f"cannot forget up to {upto}: the log ends at {self.position}")
        if upto < self.first:
            return
        self._base_version = self.version_at(upto)
        self._records = self._records[upto - self.first + 1 :]
        self.first = upto + 1

    def _check_push(self, worker: int, pid: int, kind: str | None) -> None:
        if kind is not None and kind not in KINDS:
            raise ValueError(f"unknown update kind {kind!r}; known: {', '.join(KINDS)}")
        last = self._last_pid.get(worker)
        if last is not None and pid <= last:
            raise ValueError(
                f"push {pid} of worker {worker} after push {last}: a push is logged once, "
                "in id order"
            )
        self._last_pid[worker] = pid

    def _append(self, entry: Entry, version: int) -> Record:
        self.position += 1
        self.version = version
        record = Record(self.position, version, entry)
        self._records.append(record)
        if self.on_append is not None:
            self.on_append()
        return record


def as_sink(log: DecisionLog) -> DecisionSink:
    """The log as the engine takes it (``Engine(..., decisions=...)``); mypy checks here that a
    :class:`DecisionLog` is the shape the core writes to."""
    return log
