"""The update guard: a push whose norm is far above the running median of accepted pushes of its
kind is refused with ``error{out_of_range}`` and the push's id, and nothing of it is applied."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import optax
import pytest

from hetd import config
from hetd.codecs import registry as codecs
from hetd.core import Engine, EngineConfig
from hetd.core.ingest import decode_push, update_norm
from hetd.core.store import Int8, Store
from hetd.protocol import wire
from hetd.protocol.messages import Ack, ErrorReply, JoinIn, PushIn
from hetd.server.metrics import Metrics
from policies import make_policy
from tests.conftest import FakeClock, FakePeer

SHAPES = {"dense/w": (3, 2), "dense/b": (2,)}
GUARDED = EngineConfig(profile_steps=0, guard_factor=100.0, guard_warmup=20)


class Worker:
    """One worker on an engine: pushes with increasing request ids."""

    def __init__(self, engine: Engine, name: str = "w") -> None:
        self.engine = engine
        self.peer = FakePeer()
        hello = JoinIn(id=1, name=name, device={}, codecs=("none",))
        self.wid = engine.join(hello, self.peer)
        self.next_id = 1

    def push(self, value: float, kind: str = "grad") -> object:
        """Push every value = ``value``; the reply the push got."""
        self.next_id += 1
        tensors = {k: np.full(s, value, np.float32) for k, s in SHAPES.items()}
        e = self.engine
        e.push(
            PushIn(self.wid, self.next_id, e.store.version, kind, tensors, 8, 1, 0.1, None, None, 1)
        )
        return self.peer.replies[-1]


def make(config: EngineConfig = GUARDED) -> Engine:
    params = {k: np.zeros(s, np.float32) for k, s in SHAPES.items()}
    return Engine(Store(params, optax.sgd(0.1)), make_policy("asp"), config, FakeClock())


def snapshot(e: Engine) -> dict[str, np.ndarray]:
    return {k: np.array(v) for k, v in e.store.snapshot().tensors.items()}


def test_a_poisoned_push_is_refused_with_its_id_and_changes_nothing() -> None:
    e = make()
    w = Worker(e)
    for i in range(25):
        assert isinstance(w.push(0.01 * (1 + i % 3)), Ack)
    before, version, clock = snapshot(e), e.store.version, e.members.facts[w.wid].clock
    reply = w.push(1e30)  # finite, and it would destroy the model
    assert isinstance(reply, ErrorReply), reply
    assert (reply.code, reply.id) == ("out_of_range", w.next_id)
    assert "norm" in reply.text
    assert e.store.version == version and e.members.facts[w.wid].clock == clock
    for k, v in snapshot(e).items():
        np.testing.assert_array_equal(v, before[k])
    assert e.members.stats[w.wid].refused == 1 and e.members.stats[w.wid].pushes == 25
    assert reply.encode() == wire.error_frame(reply.code, reply.text, reply.id)
    assert isinstance(w.push(0.02), Ack)  # the worker carries on


def test_the_bound_is_k_times_the_median_per_kind() -> None:
    e = make()
    w = Worker(e)
    for _ in range(20):
        w.push(0.01)
    assert isinstance(w.push(0.01 * 90), Ack)  # 90 x the median: accepted
    refused = w.push(0.01 * 150)  # 150 x: refused
    assert isinstance(refused, ErrorReply) and "median" in refused.text
    # deltas have their own scale: their warm-up and median are their own
    for _ in range(20):
        assert isinstance(w.push(5.0, "delta"), Ack)
    assert isinstance(w.push(5.0 * 90, "delta"), Ack)
    assert isinstance(w.push(5.0 * 150, "delta"), ErrorReply)
    assert isinstance(w.push(0.01 * 90, "grad"), Ack)
    assert e.members.stats[w.wid].refused == 2


def test_warm_up_accepts_large_steps_but_never_an_overflowing_one() -> None:
    e = make()
    w = Worker(e)
    assert isinstance(w.push(0.01), Ack)
    assert isinstance(w.push(100.0), Ack)  # within the warm-up: no median yet
    assert isinstance(w.push(1e30), ErrorReply)  # its square overflows float32: always refused


def test_the_guard_is_off_by_default_in_the_engine_and_at_zero() -> None:
    for cfg in (EngineConfig(profile_steps=0), EngineConfig(profile_steps=0, guard_factor=0.0)):
        e = make(cfg)
        w = Worker(e)
        for _ in range(25):
            w.push(0.01)
        assert isinstance(w.push(1e6), Ack)


def test_the_median_window_is_bounded() -> None:
    e = make()
    w = Worker(e)
    for _ in range(5000):
        w.push(0.01)
    assert max(len(n) for n in e.guard.norms.values()) <= 512


def test_refusals_are_counted_per_worker_in_metrics() -> None:
    e = make()
    a, b = Worker(e, "a"), Worker(e, "b")
    for _ in range(25):
        a.push(0.01)
    b.push(1e4)
    b.push(1e4)
    m = Metrics(e)
    m.sample()
    text = m.render().decode()
    assert f'hetd_worker_updates_refused_total{{name="b",worker="{b.wid}"}} 2.0' in text
    assert f'hetd_worker_updates_refused_total{{name="a",worker="{a.wid}"}} 0.0' in text
    assert f'hetd_worker_updates_duplicate_total{{name="a",worker="{a.wid}"}} 0.0' in text


def frame(tensors: dict[str, object]) -> wire.Message:
    return wire.decode(
        wire.encode(
            "push", 5, base=0, kind="grad", tensors=tensors, samples=8, steps=1, compute_s=0.1
        )
    )


def test_ingest_measures_the_norm_once_per_push() -> None:
    rng = np.random.default_rng(0)
    values = {k: rng.standard_normal(s).astype(np.float32) for k, s in SHAPES.items()}
    expected = math.sqrt(sum(float(np.sum(v.astype(np.float64) ** 2)) for v in values.values()))
    p = decode_push(SHAPES, 1, frame(codecs.encode_tree(values, codecs.get_codec("none"))), 100)
    assert p.norm == pytest.approx(expected, rel=1e-5)
    assert update_norm(p.tensors) == pytest.approx(expected, rel=1e-5)
    # an int8 tensor kept as a view of the frame: its norm without a float32 copy
    q = codecs.encode_tree(values, codecs.from_spec("int8"))
    fused = decode_push(SHAPES, 1, frame(q), 100, fused=True)
    assert any(isinstance(t, Int8) for t in fused.tensors.values())
    plain = decode_push(SHAPES, 1, frame(q), 100)
    assert fused.norm == pytest.approx(plain.norm, rel=1e-5)
    # NaN is still not_finite; a huge finite value is measured, not refused here
    bad = dict(values, **{"dense/b": np.array([np.nan, 0], np.float32)})
    with pytest.raises(wire.ProtocolError, match="NaN"):
        decode_push(SHAPES, 1, frame(codecs.encode_tree(bad, codecs.get_codec("none"))), 1)
    huge = dict(values, **{"dense/b": np.array([1e30, 0], np.float32)})
    p = decode_push(SHAPES, 1, frame(codecs.encode_tree(huge, codecs.get_codec("none"))), 1)
    assert p.norm is not None and p.norm >= 1e30


def test_the_guard_is_configured_in_train() -> None:
    cfg = config.Config()
    assert (cfg.train.guard_factor, cfg.train.guard_warmup) == (100.0, 20)
    with pytest.raises(config.ConfigError, match="guard_factor"):
        config.replace(cfg, "train", guard_factor=-1.0)
    with pytest.raises(config.ConfigError, match="guard_warmup"):
        config.replace(cfg, "train", guard_warmup=-1)
    assert config.replace(cfg, "train", guard_factor=0.0).train.guard_factor == 0.0


def test_a_session_measures_an_int8_norm_only_for_the_guard() -> None:
    """The daemon's sessions scan an int8 push for its norm only when the guard will read it; a
    guarded engine that gets one unmeasured (norm None) measures it itself and still refuses."""
    from hetd.server.sessions import _checked_push

    rng = np.random.default_rng(1)
    values = {k: rng.standard_normal(s).astype(np.float32) for k, s in SHAPES.items()}
    q = frame(codecs.encode_tree(values, codecs.from_spec("int8")))
    off = _checked_push(make(EngineConfig(profile_steps=0)), 1, q, 100)
    assert off.norm is None and all(isinstance(t, Int8) for t in off.tensors.values())
    on = _checked_push(make(), 1, q, 100)
    assert on.norm == pytest.approx(update_norm(off.tensors), rel=1e-6)
    # unmeasured, dense tensors are still checked for NaN
    bad = dict(values, **{"dense/b": np.array([np.nan, 0], np.float32)})
    with pytest.raises(wire.ProtocolError, match="NaN"):
        decode_push(
            SHAPES, 1, frame(codecs.encode_tree(bad, codecs.get_codec("none"))), 1, norm=False
        )
    e = make()
    w = Worker(e)
    for _ in range(25):
        w.push(0.01)
    huge = codecs.encode_tree(
        {k: np.full(s, 1e3, np.float32) for k, s in SHAPES.items()}, codecs.from_spec("int8")
    )
    p = decode_push(SHAPES, w.wid, frame(huge), 100, fused=True, norm=False)
    assert p.norm is None
    e.push(dataclasses.replace(p, id=w.next_id + 1, base=e.store.version))
    reply = w.peer.replies[-1]
    assert isinstance(reply, ErrorReply) and reply.code == "out_of_range"


def test_the_guard_alone_warms_up_then_refuses_by_kind() -> None:
    from hetd.core.guard import MAX_NORM, UpdateGuard

    g = UpdateGuard(factor=10.0, warmup=3)
    assert [g.check("grad", 1.0) for _ in range(3)] == [None, None, None]
    refusal = g.check("grad", 11.0)
    assert refusal is not None and "over 10 x the median 1" in refusal
    assert len(g.norms["grad"]) == 3  # a refused norm does not join the window
    assert g.check("delta", 11.0) is None  # another kind warms up on its own
    assert g.check("grad", 9.0) is None
    assert "out of range" in (g.check("delta", MAX_NORM) or "")
    off = UpdateGuard(factor=0.0, warmup=3)
    assert not off.on and off.check("grad", math.inf) is None and off.norms == {}
