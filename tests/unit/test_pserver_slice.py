"""One pserver's slice replaying the log: a part counted once, a record that waits for its part,
a gap or a disagreeing version refused, held parts freed, and a slice restarted from its
checkpoint that catches up from the log to the bits of one that never stopped."""

from __future__ import annotations

import numpy as np
import optax
import pytest

from hetd.pserver.log import DecisionLog
from hetd.pserver.partition import join, partition, split
from hetd.pserver.slice import LogMismatch, SliceState
from policies.types import Flush

SHAPES = {"emb": (40, 3), "w": (3, 2), "b": (2,)}
PARAMS = {
    k: np.linspace(-1, 1, int(np.prod(s)), dtype=np.float32).reshape(s) for k, s in SHAPES.items()
}
PMAP = partition(SHAPES, 2, block_bytes=200)  # emb (480 bytes) in two blocks


def _update(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {k: rng.standard_normal(s).astype(np.float32) for k, s in SHAPES.items()}


def _slices() -> list[SliceState]:
    return [SliceState(PMAP, s, p, optax.adam(0.1)) for s, p in enumerate(split(PMAP, PARAMS))]


def test_a_record_waits_for_its_part_and_a_part_counts_once():
    sl = _slices()[0]
    log = DecisionLog()
    sl.offer([log.apply(0, 1, "grad", 1.0), log.step()])
    assert sl.advance() == 0 and sl.waiting_for() == (0, 1)  # the part has not come
    part = split(PMAP, _update(1))[0]
    assert sl.receive(0, 1, part) is True
    assert sl.receive(0, 1, part) is False  # the same part again: held once
    assert sl.advance() == 2 and sl.store.version == 1 and sl.waiting_for() is None
    before = sl.params()
    assert sl.receive(0, 1, part) is False  # after its entry ran: nothing kept
    assert sl.held() == 0
    sl.offer([log.apply(0, 2, "grad", 1.0)])
    assert sl.advance() == 2  # waits for (0, 2), not fooled by (0, 1) again
    assert all(np.array_equal(sl.params()[k], v) for k, v in before.items())


def test_parts_the_log_passed_by_or_dropped_are_freed():
    sl = _slices()[1]
    log = DecisionLog()
    for pid in (1, 2, 3):
        sl.receive(7, pid, split(PMAP, _update(pid))[1])
    sl.receive(8, 1, split(PMAP, _update(9))[1])
    # push 1 of worker 7 was refused at the head (never logged); push 2 is dropped
    sl.offer([log.drop(7, 2), log.apply(7, 3, "grad", 1.0)])
    assert sl.advance() == 2
    assert sl.held() == 1  # only worker 8's part waits
    assert sl.receive(7, 1, split(PMAP, _update(1))[1]) is False


def test_a_gap_in_the_log_or_a_version_that_disagrees_stops_the_slice():
    sl = _slices()[0]
    log = DecisionLog()
    first = log.apply(0, 1, "grad", 1.0)
    second = log.apply(0, 2, "grad", 1.0)
    with pytest.raises(LogMismatch, match="a gap"):
        sl.offer([second])
    sl.offer([first, first])  # a repeat is skipped
    other = DecisionLog(version=5)  # a head that counts from another version
    sl2 = _slices()[0]
    sl2.offer([other.apply(0, 1, "grad", 1.0)])
    sl2.receive(0, 1, split(PMAP, _update(1))[0])
    with pytest.raises(LogMismatch, match="the log says 6"):
        sl2.advance()


def test_a_part_of_another_pserver_is_refused():
    sl = _slices()[0]
    with pytest.raises(ValueError, match="not pserver 0's"):
        sl.receive(0, 1, split(PMAP, _update(1))[1])


def test_a_restarted_slice_catches_up_from_its_checkpoint_to_the_same_bits():
    log = DecisionLog()
    records = []
    for pid in range(1, 4):
        records.append(log.apply(0, pid, "grad", 1.0))
    records.append(log.buffer(0, 4, "grad", 1, 0.5))  # a buffered group crosses the checkpoint
    records.append(log.checkpoint("ck"))
    records.append(log.buffer(1, 1, "delta", 1, 0.5))
    records.append(log.flush(Flush()))
    for pid in range(5, 8):
        records.append(log.apply(0, pid, "grad", 0.5))
    pushes = {(0, p): split(PMAP, _update(p)) for p in range(1, 8)}
    pushes[(1, 1)] = split(PMAP, _update(100))

    steady = _slices()
    crashing = _slices()
    for sl in (*steady, *crashing):
        sl.offer(records)
        for (w, p), parts in pushes.items():
            sl.receive(w, p, parts[sl.server])
    for sl in (*steady, *crashing):
        sl.advance()
    # pserver 1 dies after the checkpoint: a new one starts from its slice there
    restarted = SliceState.resume(PMAP, 1, crashing[1].saved["ck"], optax.adam(0.1))
    assert restarted.position == 5 and restarted.store.version == 3
    restarted.offer(log.since(restarted.position))
    for (w, p), parts in pushes.items():
        restarted.receive(w, p, parts[1])  # the worker sends its unanswered parts again
    assert restarted.advance() == log.position
    want = join(PMAP, [sl.params() for sl in steady])
    got = join(PMAP, [crashing[0].params(), restarted.params()])
    assert all(got[k].tobytes() == want[k].tobytes() for k in want)
    assert restarted.store.version == log.version == 8  # the flush: a grad and a delta


def test_with_combined_steps_the_parameters_are_read_only_where_the_log_ran_the_steps():
    sl = SliceState(PMAP, 0, split(PMAP, PARAMS)[0], optax.adam(0.1), combine=True)
    log = DecisionLog()
    sl.offer([log.apply(0, 1, "grad", 1.0), log.apply(0, 2, "grad", 1.0)])
    sl.receive(0, 1, split(PMAP, _update(1))[0])
    sl.receive(0, 2, split(PMAP, _update(2))[0])
    sl.advance()
    with pytest.raises(LogMismatch, match="2 steps queued"):
        sl.params()  # running them here would choose the sum's cut itself
    sl.offer([log.step()])
    sl.advance()
    assert sl.store.pending == 0 and set(sl.params()) == set(PMAP.slice_shapes(0))
