"""Parameter frames to workers: full for lossless codecs, quantized deltas against what each worker
holds for lossy ones (shared by every worker holding the same reference)."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import pytest

from hetd.core.downlink import Downlink, Outgoing
from hetd.core.store import Snapshot
from hetd.protocol import wire
from hetd.protocol.frames import as_params
from hetd.protocol.params import Held, apply_params


def snap(version: int, rng: np.random.Generator) -> Snapshot:
    return Snapshot(
        version,
        {
            "w": rng.normal(size=(64, 32)).astype(np.float32),
            "b": rng.normal(size=(32,)).astype(np.float32),
        },
    )


def replay(frames: list[bytes], held: Held | None) -> Held | None:
    for frame in frames:
        held = apply_params(held, as_params(wire.decode(frame)))
    return held


class Worker:
    """What a worker holds, and what the daemon knows it holds (version, reference)."""

    def __init__(self) -> None:
        self.held: Held | None = None
        self.version = -1
        self.ref: int | None = None

    def take(self, out: Outgoing) -> None:
        self.held = replay(out.frames, self.held)
        assert self.held is not None and self.held.version == out.version
        self.version, self.ref = out.version, out.ref

    @property
    def tensors(self) -> Mapping[str, np.ndarray]:
        assert self.held is not None
        return self.held.tensors

    def ask(self, d: Downlink, spec: str, s: Snapshot) -> Outgoing:
        return d.frames(spec, self.version, s, self.ref)


def test_lossless_codec_sends_the_exact_version_in_full() -> None:
    rng = np.random.default_rng(0)
    d = Downlink()
    s = snap(3, rng)
    out = d.frames("none", 2, s)
    assert (out.version, out.full, len(out.frames), out.ref) == (3, True, 1, None)
    held = replay(out.frames, None)
    assert held is not None and held.version == 3
    np.testing.assert_array_equal(held.tensors["w"], s.tensors["w"])
    assert d.frames("none", -1, s).frames[0] is out.frames[0]  # encoded once per version


def walk(rng: np.random.Generator, params: dict[str, np.ndarray], v: int) -> Snapshot:
    return Snapshot(
        v, {k: x + 0.01 * rng.normal(size=x.shape).astype(np.float32) for k, x in params.items()}
    )


@pytest.mark.parametrize("spec", ["int8", "bf16", "sign", "topk:k=0.1"])
def test_every_worker_gets_one_delta_against_what_it_holds(spec: str) -> None:
    """Worker a takes every version, b every third: both get one lossy frame per release (no full
    frame after the first), and each one's error stays bounded (its own error feedback)."""
    rng = np.random.default_rng(1)
    d = Downlink()
    s = snap(0, rng)
    a, b = Worker(), Worker()
    first = a.ask(d, spec, s)
    assert first.full and first.version == 0
    a.take(first)
    b.take(b.ask(d, spec, s))
    errors: dict[str, list[float]] = {"a": [], "b": []}
    for v in range(1, 61):
        s = walk(rng, dict(s.tensors), v)
        out = a.ask(d, spec, s)
        assert not out.full and out.version == v and len(out.frames) == 1
        a.take(out)
        errors["a"].append(float(np.linalg.norm(a.tensors["w"] - s.tensors["w"])))
        if v % 3 == 0:
            out_b = b.ask(d, spec, s)
            assert not out_b.full and len(out_b.frames) == 1
            assert len(out_b.frames[0]) <= len(first.frames[0])
            b.take(out_b)
            errors["b"].append(float(np.linalg.norm(b.tensors["w"] - s.tensors["w"])))
    for name, e in errors.items():
        # What the codec lost is resent with that worker's next delta: the gap does not grow.
        assert max(e[-5:]) <= 2 * max(e[:5]) + 1e-6, name


def test_workers_holding_the_same_reference_share_one_encoding() -> None:
    rng = np.random.default_rng(5)
    d = Downlink()
    s0 = snap(0, rng)
    group = [Worker() for _ in range(3)]
    for w in group:
        w.take(w.ask(d, "int8", s0))
    assert len({w.ref for w in group}) == 1  # the snapshot's reference
    s1 = walk(rng, dict(s0.tensors), 1)
    outs = [w.ask(d, "int8", s1) for w in group]
    assert all(o.frames[0] is outs[0].frames[0] for o in outs)  # encoded once
    for w, o in zip(group, outs, strict=True):
        w.take(o)
    for w in group[1:]:
        np.testing.assert_array_equal(w.tensors["w"], group[0].tensors["w"])


def test_the_daemon_replays_exactly_what_the_worker_reconstructs() -> None:
    """Two workers at different references each reach version 2 through their own delta: the next
    deltas are computed against what each one holds, so both track the model bit for bit with
    the daemon's references (a mismatch would show as drift)."""
    rng = np.random.default_rng(6)
    d = Downlink()
    s = snap(0, rng)
    a, b = Worker(), Worker()
    a.take(a.ask(d, "int8", s))
    s1 = walk(rng, dict(s.tensors), 1)
    a.take(a.ask(d, "int8", s1))
    b.take(b.ask(d, "int8", s1))  # b joins at 1: full
    for v in range(2, 12):
        s = walk(rng, dict(s1.tensors), v)
        s1 = s
        for w in (a, b):
            w.take(w.ask(d, "int8", s))
            assert w.ref is not None
            ref = d._refs[w.ref]
            for k in s.tensors:
                np.testing.assert_array_equal(ref.tensors[k], w.tensors[k])


def test_an_evicted_reference_means_the_next_release_is_full() -> None:
    rng = np.random.default_rng(2)
    d = Downlink(max_refs=2)
    s = snap(0, rng)
    old, fresh = Worker(), Worker()
    old.take(old.ask(d, "int8", s))
    fresh.take(fresh.ask(d, "int8", s))
    for v in range(1, 6):
        s = walk(rng, dict(s.tensors), v)
        fresh.take(fresh.ask(d, "int8", s))
    assert d.refs <= 2
    out = old.ask(d, "int8", s)
    assert out.full and out.version == 5
    old.take(out)
    for k in s.tensors:  # a full frame is exact
        np.testing.assert_array_equal(old.tensors[k], s.tensors[k])
    s6 = walk(rng, dict(s.tensors), 6)
    nxt = old.ask(d, "int8", s6)
    assert not nxt.full
    old.take(nxt)


def test_a_worker_whose_version_the_daemon_does_not_know_gets_a_full_frame() -> None:
    rng = np.random.default_rng(7)
    d = Downlink()
    w = Worker()
    w.take(w.ask(d, "int8", snap(0, rng)))
    assert d.frames("int8", -1, snap(1, rng), w.ref).full  # a pull that said "nothing usable"
    assert d.frames("int8", 0, snap(1, rng), None).full  # no reference on record


def test_a_delta_against_another_version_is_refused() -> None:
    rng = np.random.default_rng(3)
    d = Downlink()
    w = Worker()
    w.take(w.ask(d, "int8", snap(0, rng)))
    delta = w.ask(d, "int8", snap(1, rng))
    assert w.held is not None
    stale = Held(7, w.held.tensors)
    assert apply_params(stale, as_params(wire.decode(delta.frames[0]))) is None


def test_a_full_release_shares_the_read_only_snapshot() -> None:
    rng = np.random.default_rng(4)
    d = Downlink()
    s3 = snap(3, rng)
    for arr in s3.tensors.values():  # as the store publishes them
        arr.flags.writeable = False
    before = {k: v.copy() for k, v in s3.tensors.items()}
    w = Worker()
    out = w.ask(d, "int8", s3)
    assert out.full
    w.take(out)
    for k in s3.tensors:  # the worker holds the exact parameters: no quantization error
        np.testing.assert_array_equal(w.tensors[k], s3.tensors[k])
    nxt = w.ask(d, "int8", snap(4, rng))
    assert not nxt.full and nxt.version == 4
    w.take(nxt)
    for k in s3.tensors:  # the snapshot was shared by the reference, never written
        np.testing.assert_array_equal(s3.tensors[k], before[k])


def test_a_link_faster_than_the_encoding_gets_full_frames() -> None:
    """Once a delta's cost is known, a worker whose link moves the bytes saved faster than the
    daemon could encode them (loopback) gets the full frame; a slow link keeps getting deltas."""
    rng = np.random.default_rng(8)
    d = Downlink()
    s = snap(0, rng)
    fast, slow = Worker(), Worker()
    fast.take(fast.ask(d, "int8", s))
    slow.take(slow.ask(d, "int8", s))
    s = walk(rng, dict(s.tensors), 1)
    out = d.frames("int8", fast.version, s, fast.ref, link_bps=1e15)
    assert not out.full  # the first delta measures the cost
    fast.take(out)
    for v in range(2, 5):
        s = walk(rng, dict(s.tensors), v)
        out = d.frames("int8", fast.version, s, fast.ref, link_bps=1e15)
        assert out.full
        fast.take(out)
        out = d.frames("int8", slow.version, s, slow.ref, link_bps=1e6)  # 1 MB/s
        assert not out.full
        slow.take(out)


def test_a_fixed_delta_cost_makes_the_choice_without_timing() -> None:
    """The simulator fixes the cost per parameter, so its runs do not depend on this CPU."""
    rng = np.random.default_rng(9)
    for s_per_param, link, full in ((1e-3, 1e9, True), (1e-12, 1e6, False)):
        d = Downlink(s_per_param=s_per_param)
        w = Worker()
        w.take(w.ask(d, "int8", snap(0, rng)))
        assert d.frames("int8", w.version, snap(1, rng), w.ref, link_bps=link).full is full
