"""A stage compiles ahead and its link carries frames in flight (:mod:`workers.stage`): the
``stage`` message compiles the stage's kernels for its micro-batch, so the step that follows
traces nothing; a return to a shape the worker ran costs no compile; an arriving frame is ready
after the frames before it have crossed the downlink plus one latency, and the outbox sends each
frame its bytes after the one before it, never before its time, not a latency each."""

from __future__ import annotations

import asyncio
import time
from itertools import count

import jax
import numpy as np
import pytest

from hetd.protocol import frames, wire
from hetd.protocol.frames import StepOrder
from hetd.protocol.params import Held
from hetd.zoo.blocks import mlp_model
from hetd.zoo.data import load_dataset
from tests.unit.test_stage_host import _stage
from workers.emulate import Emulation
from workers.stage import Outbox, StageHost

SETUP = {"spec": "hetd.zoo.blocks:mlp_model", "kwargs": {"hidden": [32]}}
MICRO = 8


def _step(micro: int = MICRO, gen: int = 1) -> StepOrder:
    msg = frames.decode(
        wire.encode(
            "step",
            0,
            replica=2,
            gen=gen,
            step=1,
            base=0,
            micro_batches=3,
            micro=micro,
            shard=0,
            offset=0,
        )
    )
    assert isinstance(msg, StepOrder)
    return msg


@pytest.mark.slow  # a stage compiles its kernels: `make test` runs it, `make test-fast` does not
def test_a_stage_compiles_on_its_assignment_and_a_known_shape_compiles_nothing() -> None:
    data = load_dataset("digits", seed=0)
    model = mlp_model(data.num_classes, hidden=(32,))
    params = {
        k: np.asarray(v) for k, v in model.init(jax.random.PRNGKey(1), data.input_shape).items()
    }
    shapes = {k: v.shape for k, v in params.items()}
    ids = count(1)
    host = StageHost(SETUP, data, lambda: next(ids), None, shapes)
    host.assign(_stage(0))
    host.wait_warm()
    stage = host.stage
    assert stage is not None and host.compile_s is not None
    traced = dict(stage.traces)
    assert traced["fwd"] == 1 and traced["bwd"] == 1  # compiled before any step
    sent = host.begin(_step(), Held(0, params))
    assert [wire.decode(f).type for _, f in sent] == ["act", "act"]  # the step ran its forwards
    assert stage.traces == traced  # ... on the kernels compiled ahead
    host.assign(_stage(0, micro=4, gen=2))  # another micro-batch: compiled ahead again
    host.wait_warm()
    assert stage.traces["fwd"] == 2 and host.stage is stage
    host.assign(_stage(0, gen=3))  # back to a shape it ran: the same kernels, nothing compiled
    host.wait_warm()
    assert host.stage is stage and stage.traces["fwd"] == 2
    host.begin(_step(gen=3), Held(0, params))
    assert stage.traces["fwd"] == 2


def test_frames_cross_the_emulated_link_with_the_latency_in_flight() -> None:
    data = load_dataset("digits", seed=0)
    emu = Emulation(bandwidth=1e6, latency_s=0.05)  # 1 MB/s, 50 ms
    host = StageHost(SETUP, data, lambda: 1, emu)
    now = time.perf_counter()
    first, second, third = (host.arrive(10_000) for _ in range(3))  # 10 ms each on the wire
    assert first >= now + 0.01 + 0.05
    # the next frame waits for the link's bytes, not for the latency before it
    assert second - first == pytest.approx(0.01, abs=1e-3)
    assert third - second == pytest.approx(0.01, abs=1e-3)

    async def run() -> tuple[list[float], list[tuple[float, bytes]]]:
        sent: list[tuple[float, bytes]] = []

        async def send(frame: bytes) -> None:
            sent.append((time.perf_counter(), frame))

        out = Outbox(send, emu)
        due = time.perf_counter()
        at = out.put([(due, b"a" * 10_000), (due, b"b" * 10_000), (due, b"c" * 10_000)])
        await asyncio.sleep(max(at) - time.perf_counter() + 0.05)
        await out.close()
        return at, sent

    at, sent = asyncio.run(run())
    assert [f[:1] for _, f in sent] == [b"a", b"b", b"c"]  # in order
    assert at[2] - at[0] == pytest.approx(0.02, abs=1e-3)  # two frames' bytes, no latency
    assert all(t >= a for (t, _), a in zip(sent, at, strict=True))  # never before its time
