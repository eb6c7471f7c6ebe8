"""The training core: the engine, the single writer of all training state, and its parts.

:class:`Engine` (:mod:`hetd.core.engine`) owns one queue of :mod:`~hetd.core.commands` and routes
each to its parts, each a plain class with its own state: :class:`~hetd.core.members.Members` (the
worker table), :class:`~hetd.core.policy_host.PolicyHost` (the policy and the stage),
:class:`~hetd.core.applier.Applier` (updates into the :class:`~hetd.core.store.Store`),
:class:`~hetd.core.publish.Publisher` (parameters out, through the
:class:`~hetd.core.downlink.Downlink`), :class:`~hetd.core.replicas.Replicas`,
:class:`~hetd.core.evals.Evaluations`, :class:`~hetd.core.guard.UpdateGuard` and
:class:`~hetd.core.rates.Meters`. It is given a :class:`Clock` and one :class:`Peer` per session;
its training state is an :class:`EngineState`.

Names load on first use (the store brings JAX, which the daemon imports only once it listens).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hetd.core.engine import Engine
    from hetd.core.entries import EngineConfig, WorkerEntry, WorkerStats
    from hetd.core.peers import Clock, MonotonicClock, Peer
    from hetd.core.saved import EngineState
    from hetd.core.store import Snapshot, Store

__all__ = [
    "Clock",
    "Engine",
    "EngineConfig",
    "EngineState",
    "MonotonicClock",
    "Peer",
    "Snapshot",
    "Store",
    "WorkerEntry",
    "WorkerStats",
]

_WHERE = {
    "Engine": "engine",
    "EngineConfig": "entries",
    "EngineState": "saved",
    "WorkerEntry": "entries",
    "WorkerStats": "entries",
    "Clock": "peers",
    "MonotonicClock": "peers",
    "Peer": "peers",
    "Snapshot": "store",
    "Store": "store",
}


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'hetd.core' has no attribute {name!r}")
    return getattr(importlib.import_module(f"hetd.core.{module}"), name)
