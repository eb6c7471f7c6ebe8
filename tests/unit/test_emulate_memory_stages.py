"""An emulated worker's memory and its pipeline stages' pace (:mod:`workers.emulate`,
:mod:`workers.stage`): a whole-model step that does not fit ``--emulate-memory`` fails as the
simulator's worker fails it, and a stage's frames leave at the emulated device's pace (its share
of the model's compute, a third per forward and two per backward), its push timing the step so."""

from __future__ import annotations

import time
from itertools import count

import jax
import numpy as np
import pytest

from hetd.protocol import frames, wire
from hetd.protocol.frames import Act, Push, StageOrder, StepOrder
from hetd.protocol.params import Held
from hetd.sim.scenario import load_scenario
from hetd.zoo.blocks import mlp_model
from hetd.zoo.data import load_dataset
from workers.emulate import Emulation, OutOfMemory, whole_step_bytes
from workers.stage import StageHost, stage_share

SETUP = {"spec": "hetd.zoo.blocks:mlp_model", "kwargs": {"hidden": [32]}}
M, MICRO = 2, 8
SAMPLE_S = 10.0  # s per whole-model sample at slow-down 1: far above the host's compute, compiles
# included (the due times are only computed: nothing here waits for them)
SLOW = 2.0


def _shapes(hidden: tuple[int, ...], inputs: int, classes: int) -> dict[str, tuple[int, ...]]:
    model = mlp_model(classes, hidden=hidden)
    tree = jax.eval_shape(lambda: model.init(jax.random.PRNGKey(0), (inputs,)))
    return {k: tuple(v.shape) for k, v in tree.items()}


def test_a_whole_model_step_that_does_not_fit_the_emulated_memory_fails() -> None:
    sc = load_scenario("B")
    shapes = _shapes(tuple(sc.model_kwargs["hidden"]), 784, 10)
    need = whole_step_bytes(shapes, sc.micro_batch)
    poor = next(w.memory for w in sc.workers if w.memory is not None)
    assert poor == round(0.75 * need)  # the scenario's memory-poor worker: 0.75 of the need
    with pytest.raises(OutOfMemory, match=r"out of memory: a whole-model step needs 7\.66 MB"):
        Emulation(memory=poor).check_whole_step(shapes, sc.micro_batch)
    Emulation(memory=int(need)).check_whole_step(shapes, sc.micro_batch)  # just fits
    Emulation().check_whole_step(shapes, sc.micro_batch)  # no emulated memory: the host's


def test_the_simulators_worker_fails_the_same_steps() -> None:
    """The engine's simulator ends a worker whose whole-model step does not fit; the real
    worker refuses exactly the same ones."""
    import dataclasses

    from hetd.sim.agent import EmuWorker

    sc = load_scenario("B")
    shapes = _shapes(tuple(sc.model_kwargs["hidden"]), 784, 10)
    need = whole_step_bytes(shapes, sc.micro_batch)
    for memory in (int(need) - 1, int(need)):
        spec = dataclasses.replace(sc.workers[0], memory=memory)
        one = dataclasses.replace(sc, workers=(spec,))
        sim = EmuWorker(0, one, None, 0, shapes)  # type: ignore[arg-type]  # fits() reads no data
        refused = False
        try:
            Emulation(memory=memory).check_whole_step(shapes, sc.micro_batch)
        except OutOfMemory:
            refused = True
        assert sim.fits() is not refused
        assert refused is (memory < need)


def _read(kind: type, frame: bytes):  # type: ignore[no-untyped-def]
    msg = frames.decode(frame)
    assert isinstance(msg, kind)
    return msg


def _stage(s: int) -> StageOrder:
    return _read(  # type: ignore[no-any-return]
        StageOrder,
        wire.encode(
            "stage", 0, replica=2, gen=1, stage=s, of=2, blocks=[s, s + 1], micro=MICRO,
            inflight=2 - s, prev=None if s == 0 else 10, next=11 if s == 0 else None,
        ),
    )  # fmt: skip


def _step() -> StepOrder:
    return _read(  # type: ignore[no-any-return]
        StepOrder,
        wire.encode(
            "step", 0, replica=2, gen=1, step=1, base=0, micro_batches=M, micro=MICRO,
            shard=0, offset=0,
        ),
    )  # fmt: skip


@pytest.mark.slow  # two stage hosts compile their kernels: `make test` runs it, test-fast not
def test_a_stage_sends_at_the_emulated_pace_and_its_push_times_the_step() -> None:
    data = load_dataset("digits", seed=0)
    model = mlp_model(data.num_classes, hidden=(32,))
    params = {
        k: np.asarray(v) for k, v in model.init(jax.random.PRNGKey(1), data.input_shape).items()
    }
    shapes = {k: v.shape for k, v in params.items()}
    shares = [stage_share(shapes, 0, 1), stage_share(shapes, 1, 2)]
    assert sum(shares) == pytest.approx(1.0) and shares[0] > 0.6  # 64x32 against 32x10
    ids = count(1)
    emu = Emulation(slowdown=SLOW, base_step_s=SAMPLE_S * 32, base_batch=32)
    hosts = [StageHost(SETUP, data, lambda: next(ids), emu, shapes) for _ in range(2)]
    for s, h in enumerate(hosts):
        h.assign(_stage(s))
    fwd = [SLOW * SAMPLE_S * MICRO * share / 3 for share in shares]  # one micro-batch's forward

    def timed(call):  # type: ignore[no-untyped-def]
        before = time.perf_counter()
        out = call()
        return before, time.perf_counter(), out

    b0, a0, first = timed(lambda: hosts[0].begin(_step(), Held(0, params)))
    assert [wire.decode(f).type for _, f in first] == ["act", "act"]  # its in-flight cap
    # each activation leaves when its forward is done on the emulated device
    assert first[0][0] - a0 <= fwd[0] <= first[0][0] - b0
    assert first[1][0] - first[0][0] == pytest.approx(fwd[0])
    hosts[1].begin(_step(), Held(0, params))
    act = _read(Act, first[0][1])
    b1, a1, back = timed(lambda: hosts[1].offer(act))
    # the last stage's forward and backward in one: its gradient leaves 3 forwards' time later
    assert [wire.decode(f).type for _, f in back] == ["gact"]
    assert back[0][0] - a1 <= 3 * fwd[1] <= back[0][0] - b1
    last = hosts[1].offer(_read(Act, first[1][1]))
    assert [wire.decode(f).type for _, f in last] == ["gact", "push"]  # its step is done
    # stage 0's two backwards: its push times the step at its forwards and backwards at least
    assert hosts[0].offer(_read(Act, back[0][1])) == []
    (_, push), *rest = hosts[0].offer(_read(Act, last[0][1]))
    assert rest == []
    assert _read(Push, push).compute_s >= M * 3 * fwd[0]
