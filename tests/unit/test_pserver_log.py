"""The decision log: versions counted as the single store counts them, a push logged once, the
entries after a position, forgetting what a checkpoint covers, and every entry through msgpack."""

from __future__ import annotations

from typing import Any

import msgpack
import numpy as np
import optax
import pytest

from hetd.core.applier import Applier
from hetd.core.store import Store
from hetd.pserver.log import (
    ApplyEntry,
    BufferEntry,
    CheckpointEntry,
    DecisionLog,
    DropEntry,
    FlushEntry,
    OuterEntry,
    Record,
    RestartEntry,
    RestoreEntry,
    StepEntry,
    from_dict,
    to_dict,
)
from policies.types import Flush

PARAMS = {"w": np.ones((3, 2), np.float32), "b": np.zeros(2, np.float32)}


def _update(x: float) -> dict[str, np.ndarray]:
    return {k: np.full_like(v, x) for k, v in PARAMS.items()}


def test_the_log_counts_the_versions_the_single_store_counts():
    applier = Applier(Store(PARAMS, optax.sgd(0.1)))
    log = DecisionLog()
    # (what the engine does, what the head logs): applies, buffers of both kinds, partial flushes
    script: list[tuple[str, Any]] = [
        ("apply", (0, 1, "grad", 0.5)),
        ("buffer", (1, 1, "grad", 7, 0.25)),
        ("buffer", (0, 2, "delta", 7, 0.25)),  # group 7 now holds two kinds: two versions
        ("buffer", (2, 1, "grad", 8, 1.0)),
        ("flush", Flush(normalize=True, scale=1.0, upto=7)),
        ("apply", (1, 2, "delta", 1.0)),
        ("buffer", (2, 2, "grad", 9, 1.0)),
        ("flush", Flush(normalize=False, scale=0.5, upto=None)),  # groups 8 and 9
        ("flush", Flush()),  # nothing buffered: no version
    ]
    for i, (op, args) in enumerate(script):
        if op == "apply":
            worker, pid, kind, scale = args
            applier.apply(kind, _update(i), scale)
            log.apply(worker, pid, kind, scale)
        elif op == "buffer":
            worker, pid, kind, group, weight = args
            applier.buffer(group, kind, _update(i), weight)
            log.buffer(worker, pid, kind, group, weight)
        else:
            applier.flush(args)
            log.flush(args)
        assert log.version == applier.store.version, (i, op)
    assert log.position == len(script) and log.version == 6
    assert log.buffered_groups() == {}


def test_a_push_is_logged_once_and_in_id_order_per_worker():
    log = DecisionLog()
    log.apply(0, 5, "grad", 1.0)
    log.buffer(1, 5, "grad", 0, 1.0)  # another worker's ids are its own
    for again in (lambda: log.apply(0, 5, "grad", 1.0), lambda: log.drop(0, 4)):
        with pytest.raises(ValueError, match="logged once"):
            again()
    with pytest.raises(ValueError, match="unknown update kind"):
        log.apply(0, 6, "weights", 1.0)
    assert log.position == 2


def test_entries_after_a_position_and_forgetting_what_a_checkpoint_covers():
    log = DecisionLog(version=10, position=100)  # resumed from a checkpoint at 100
    for pid in range(1, 6):
        log.apply(0, pid, "grad", 1.0)
    log.checkpoint("ck-105")
    log.apply(0, 6, "grad", 1.0)
    assert [r.position for r in log.since(104)] == [105, 106, 107]
    assert log.version_at(100) == 10 and log.version_at(106) == 15 and log.version_at(107) == 16
    log.compact(106)
    assert log.first == 107 and [r.position for r in log.since(106)] == [107]
    assert log.version_at(106) == 15
    with pytest.raises(ValueError, match="needs a checkpoint first"):
        log.since(105)
    with pytest.raises(ValueError, match="not held"):
        log.version_at(105)


def test_the_head_log_state_goes_on_where_it_stopped():
    log = DecisionLog()
    log.apply(3, 9, "grad", 1.0)
    log.buffer(3, 10, "delta", 4, 1.0)
    wire = msgpack.unpackb(msgpack.packb(log.state()), strict_map_key=False)
    again = DecisionLog.from_state(wire)
    assert (again.position, again.version, again.buffered_groups()) == (2, 1, {4: ("delta",)})
    with pytest.raises(ValueError, match="logged once"):
        again.apply(3, 10, "grad", 1.0)
    assert again.flush(Flush()).version == 2


ENTRIES = [
    ApplyEntry(1, 2, "grad", 0.5),
    BufferEntry(1, 3, "delta", 4, 0.25),
    FlushEntry(False, 2.0, None),
    FlushEntry(True, 1.0, 7),
    DropEntry(2, 9),
    StepEntry(),
    StepEntry(combine=False),
    OuterEntry("nesterov:lr=0.7,momentum=0.9"),
    RestartEntry(),
    CheckpointEntry("ck-1"),
    RestoreEntry("ck-1", {3: ("grad", "delta")}),
]


@pytest.mark.parametrize("entry", ENTRIES, ids=lambda e: type(e).__name__)
def test_every_entry_goes_through_msgpack_and_back(entry):
    record = Record(12, 5, entry)
    wire = msgpack.unpackb(msgpack.packb(to_dict(record)))
    assert from_dict(wire) == record


@pytest.mark.parametrize(
    ("change", "says"),
    [
        ({"op": "rewind"}, "unknown log entry"),
        ({"scale": "1"}, "bad value"),
        ({"pid": True}, "bad value"),
        ({"kind": "weights"}, "unknown update kind"),
        ({"pos": 0}, "bad position"),
        ({"extra": 1}, "unknown fields"),
    ],
)
def test_a_malformed_entry_is_refused(change, says):
    d = to_dict(Record(1, 1, ApplyEntry(0, 1, "grad", 1.0)))
    d.update(change)
    with pytest.raises(ValueError, match=says):
        from_dict(d)
    d = to_dict(Record(1, 1, ApplyEntry(0, 1, "grad", 1.0)))
    del d["worker"]
    with pytest.raises(ValueError, match="malformed"):
        from_dict(d)
