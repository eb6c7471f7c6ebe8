"""The daemon's pipeline replicas (docs/policies.md §11): :class:`ReplicaDriver` is replica 0
(a :class:`hetd.server.replica.Replica`, the one ``POST /v1/replicas`` forms) and owns the
others a policy's ``Regroup`` asks for, replicas 1, 2, ... It takes the relay's and the engine's
hooks and hands each event to the replica it concerns: a slice by its ``replica`` field, a
release by the replica's head, a lost worker to every replica. Its ``assembled`` and ``aborted``
count every replica's steps.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from hetd.core.engine import Engine
from hetd.protocol import wire
from hetd.server.relay import Relay
from hetd.server.replica import Replica
from policies.types import ReplicaShape

log = logging.getLogger("hetd.server.replicas")

__all__ = ["Replica", "ReplicaDriver"]


def _key(shape: ReplicaShape) -> tuple[tuple[int, ...], tuple[int, ...], int]:
    return (tuple(shape.members), tuple(shape.cuts), shape.micro)


class ReplicaDriver(Replica):
    """Replica 0 and the owner of the others."""

    def __init__(self, engine: Engine, relay: Relay) -> None:
        super().__init__(engine, relay, 0)
        self.others: dict[int, Replica] = {}  # replica id (1, 2, ...) -> replica
        relay.on_part = self.part
        relay.on_detach = self.lost
        engine.pipelines.run_step = self.released
        engine.pipelines.regroup_to = self.regroup

    def _all(self) -> list[Replica]:
        return [self, *(self.others[r] for r in sorted(self.others))]

    def part(self, wid: int, msg: wire.Message) -> None:
        """A stage's slice, to the replica it names."""
        other = self.others.get(msg["replica"])
        if other is not None:
            other.part(wid, msg)
        else:
            super().part(wid, msg)

    def lost(self, wid: int) -> None:
        """A worker's session ended: every replica it was a stage of dissolves."""
        for r in self.others.values():
            r.lost(wid)
        super().lost(wid)

    def released(self, head: int) -> None:
        """The engine released the replica headed by ``head``."""
        for r in self._all():
            if r.members[:1] == (head,):
                if r is self:
                    super().released(head)
                else:
                    r.released(head)

    def regroup(self, shapes: Sequence[ReplicaShape]) -> None:
        """A policy's Regroup (on the engine task): exactly these replicas run. One running as
        asked keeps going (its next steps take the asked micro-batch count); any other
        dissolves; each asked one not running is formed by an idle replica (a new one when
        none is idle)."""
        wanted = {_key(s): s for s in shapes}
        for r in self._all():
            if not r.members:
                continue
            shape = wanted.pop((r.members, r.cuts, r.micro), None)
            if shape is None:
                r.dissolve("regrouped")
            else:
                r.micro_batches = shape.micro_batches
        for shape in wanted.values():
            idle = next((r for r in self._all() if not r.members), None)
            if idle is None:
                rid = max(self.others, default=0) + 1
                idle = self.others[rid] = Replica(self.engine, self.relay, rid, parent=self)
                idle.min_timeout_s, idle.timeout_factor = self.min_timeout_s, self.timeout_factor
                idle.first_timeout_s = self.first_timeout_s
            try:
                idle.form_now(
                    shape.members, shape.cuts, shape.micro, shape.micro_batches, shape.inflight
                )
            except ValueError as exc:
                log.warning("replica %s not formed: %s", list(shape.members), exc)

    def describe(self) -> dict[str, Any]:
        """Replica 0 as the admin API shows it, with the others that ever ran."""
        out = super().describe()
        out["others"] = [r.describe() for r in self.others.values()]
        return out
