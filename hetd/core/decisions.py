"""The decision log as the core sees it (:class:`DecisionSink`): what the engine tells a log of
its decisions, for pservers to replay (docs/design.md, *Parameter servers*). The log itself lives
above the core (:class:`hetd.pserver.log.DecisionLog`); the engine keeps one only when given one,
and costs nothing without (one ``is None`` test per update applied or buffered, per flush and per
run of the store's queued steps)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

from policies.types import Flush

__all__ = ["DecisionSink", "LogMismatch"]


class DecisionSink(Protocol):
    """Where the engine writes what it decides, in the order it carries it out, for pservers to
    replay (:class:`hetd.pserver.log.DecisionLog` is one; the core names only this shape). Each
    call appends one entry and moves :attr:`version` as the store's version moves: an apply by
    one, a flush by one per kind per buffered group it applies. Called on the engine task, or
    in the thread the engine task awaits while a publish runs the store's steps; one writer."""

    position: int  # the last entry's position
    version: int  # the store's version after the last entry

    def apply(self, worker: int, pid: int, kind: str, scale: float) -> object: ...

    def buffer(self, worker: int, pid: int, kind: str, group: int, weight: float) -> object: ...

    def flush(self, d: Flush) -> object: ...

    def drop(self, worker: int, pid: int) -> object: ...

    def step(self, combine: bool | None = None) -> object: ...

    def set_outer(self, spec: str) -> object: ...

    def restart(self) -> object: ...

    def checkpoint(self, ref: str) -> object: ...

    def restore(self, ref: str, version: int, groups: Mapping[int, Sequence[str]]) -> object: ...


class LogMismatch(RuntimeError):
    """The decision log and the store count different versions: what pservers replay would not
    be what the store did."""
