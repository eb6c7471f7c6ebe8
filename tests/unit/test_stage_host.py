"""A worker's pipeline side (:class:`workers.stage.StageHost`) in one process: two hosts wired
back to back through real wire frames give the whole model's gradient; a step waits for its base
version and is given up when that version is gone; what a host cannot act on is refused."""

from __future__ import annotations

import dataclasses
from itertools import count
from typing import TypeVar

import jax
import numpy as np
import pytest

from hetd.codecs import registry as codecs
from hetd.protocol import frames, wire
from hetd.protocol.frames import Abort, Act, Push, StageOrder, StepOrder
from hetd.protocol.params import Held
from hetd.zoo.blocks import mlp_model
from hetd.zoo.data import load_dataset
from workers.stage import StageError, StageHost

SETUP = {"spec": "hetd.zoo.blocks:mlp_model", "kwargs": {"hidden": [32]}}
M, MICRO = 3, 8
T = TypeVar("T")


def _act(width: int) -> Act:
    """An ``act`` frame of step 1, micro-batch 0, for replica 2 generation 1: ones of ``width``."""
    return _read(
        Act,
        wire.encode(
            "act",
            0,
            replica=2,
            gen=1,
            step=1,
            mb=0,
            tensor=codecs.get_codec("none").encode(np.ones((MICRO, width), np.float32), None),
        ),
    )


def _read(kind: type[T], frame: bytes) -> T:
    """A frame as the worker reads it: decoded, checked and typed."""
    msg = frames.decode(frame)
    assert isinstance(msg, kind)
    return msg


def _stage(s: int, micro: int = MICRO, gen: int = 1) -> StageOrder:
    """Stage ``s`` of a two-stage replica (generation ``gen``), as the worker reads its order."""
    return _read(
        StageOrder,
        wire.encode(
            "stage",
            0,
            replica=2,
            gen=gen,
            stage=s,
            of=2,
            blocks=[s, s + 1],
            micro=micro,
            inflight=2 - s,
            prev=None if s == 0 else 10,
            next=11 if s == 0 else None,
        ),
    )


def _step(step: int, base: int) -> StepOrder:
    return _read(
        StepOrder,
        wire.encode(
            "step",
            0,
            replica=2,
            gen=1,
            step=step,
            base=base,
            micro_batches=M,
            micro=MICRO,
            shard=0,
            offset=5,
        ),
    )


@pytest.fixture(scope="module")
def world() -> tuple[object, dict[str, np.ndarray]]:
    data = load_dataset("digits", seed=0)
    model = mlp_model(data.num_classes, hidden=(32,))
    params = {
        k: np.asarray(v) for k, v in model.init(jax.random.PRNGKey(1), data.input_shape).items()
    }
    return data, params


@pytest.mark.slow  # two stage hosts compile and run a pipeline step: `make test` runs it, `make test-fast` does not
def test_two_hosts_through_wire_frames_give_the_whole_gradient(world) -> None:  # type: ignore[no-untyped-def]
    data, params = world
    ids = count(1)
    hosts = [StageHost(SETUP, data, lambda: next(ids)) for _ in range(2)]  # type: ignore[arg-type]
    for s, h in enumerate(hosts):
        h.assign(_stage(s))
    held = Held(4, params)
    mail = [(0, f) for _, f in hosts[0].begin(_step(9, 4), held)]
    mail += [(1, f) for _, f in hosts[1].begin(_step(9, 4), held)]
    pushes: dict[int, Push] = {}
    while mail:
        src, frame = mail.pop(0)
        msg = frames.decode(frame)
        if isinstance(msg, Push):
            pushes[src] = msg
            continue
        assert isinstance(msg, Act)
        dst = src + 1 if msg.type == "act" else src - 1
        mail += [(dst, f) for _, f in hosts[dst].offer(msg)]
    assert set(pushes) == {0, 1}
    assert [pushes[s].stage for s in (0, 1)] == [0, 1]
    assert all(p.base == 4 and p.samples == M * MICRO and p.step == 9 for p in pushes.values())
    got = {**codecs.decode_tree(pushes[0].tensors), **codecs.decode_tree(pushes[1].tensors)}
    rows = (5 + np.arange(M * MICRO)) % len(data.y_train)
    model = mlp_model(data.num_classes, hidden=(32,))
    loss, ref = jax.value_and_grad(model.loss)(params, data.x_train[rows], data.y_train[rows])
    assert set(got) == set(ref)
    for path in ref:
        np.testing.assert_allclose(got[path], np.asarray(ref[path]), atol=2e-5, err_msg=path)
    assert pushes[1].loss == pytest.approx(float(loss), abs=1e-4) and pushes[0].loss is None


def test_a_step_waits_for_its_base_and_is_dropped_when_it_is_gone(world) -> None:  # type: ignore[no-untyped-def]
    data, params = world
    host = StageHost(SETUP, data, lambda: 1)
    host.assign(_stage(0))
    assert host.begin(_step(1, 5), Held(4, params)) == [] and host.waiting_for() == 5
    acts = host.params(Held(5, params))  # its version arrived: stage 0 starts its forwards
    assert [wire.decode(f).type for _, f in acts] == ["act", "act"]  # up to its in-flight cap 2
    assert host.waiting_for() is None
    host.begin(_step(2, 7), Held(5, params))
    assert host.params(Held(8, params)) == [] and host.step is None and host.dropped == 2


def test_what_a_host_cannot_act_on_is_refused(world) -> None:  # type: ignore[no-untyped-def]
    data, params = world
    host = StageHost(SETUP, data, lambda: 1)
    with pytest.raises(StageError, match="holds no stage"):
        host.begin(_step(1, 0), Held(0, params))
    act = _act(32)
    with pytest.raises(StageError, match="not running"):
        host.offer(act)
    plain = StageHost({"spec": "mlp", "kwargs": {}}, data, lambda: 1)
    with pytest.raises(StageError, match="not block-structured"):
        plain.assign(_stage(0))
    host.assign(_stage(1))
    stale = dataclasses.replace(_step(1, 0), gen=0)
    with pytest.raises(StageError, match="holds no stage"):
        host.begin(stale, Held(0, params))
    host.begin(_step(1, 0), Held(0, params))
    wrong = _act(5)
    with pytest.raises(StageError, match=r"act 0: .*step given up"):
        host.offer(wrong)
    assert host.step is None  # a runner that failed half-way is not trusted again
    host.begin(_step(2, 0), Held(0, params))
    host.abort(_read(Abort, wire.encode("abort", 0, replica=2, gen=1, step=2)))
    assert host.step is None
