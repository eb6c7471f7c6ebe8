"""Two real ``hetd-worker`` processes as one 2-stage pipeline replica through a real daemon: the
daemon assigns each a stage, releases one step, the workers exchange activations and their
gradients through the daemon's relay, and the two pushed slices are disjoint, cover the model and
equal the whole model's gradient on the same batch."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
import pytest

from hetd import config as config_mod
from hetd.codecs import registry as codecs
from hetd.protocol import wire
from hetd.zoo.blocks import mlp_model
from hetd.zoo.data import load_dataset

pytestmark = pytest.mark.slow

M, MICRO, OFFSET = 4, 16, 100  # micro-batches, samples each, where the samples start


async def test_a_two_stage_replica_of_real_workers_gives_the_whole_model_gradient(cluster) -> None:  # type: ignore[no-untyped-def]
    # a tiny lr: a data-parallel push that lands after the step's release moves the parameters
    # far below the tolerance, so the reference below is that of the parameters the stages used
    c = await cluster("asp", model="hetd.zoo.blocks:mlp_model", lr=1e-9)
    relay = c.daemon.relay
    parts: list[tuple[int, wire.Message]] = []
    relay.on_part = lambda wid, msg: parts.append((wid, msg))
    for _ in range(2):
        await c.spawn(1.0, 0.01)
    await c.wait_for(lambda: len(c.engine.facts) == 2, 90, "2 workers to join")
    w0, w1 = sorted(c.engine.facts)
    relay.install({(0, 0, 0): w0, (0, 0, 1): w1})
    common: dict[str, Any] = {"replica": 0, "gen": 0, "of": 2, "micro": MICRO}
    relay.send(
        w0,
        wire.encode("stage", 0, stage=0, blocks=[0, 1], inflight=2, prev=None, next=w1, **common),
    )
    relay.send(
        w1,
        wire.encode("stage", 0, stage=1, blocks=[1, 2], inflight=1, prev=w0, next=None, **common),
    )

    # a step whose base version moves on before a stage holds it is given up by the workers;
    # the workers run no data-parallel step once staged, so the version settles and a step runs
    for step in range(1, 6):
        base = c.engine.store.version
        frame = wire.encode(
            "step",
            0,
            replica=0,
            gen=0,
            step=step,
            base=base,
            micro_batches=M,
            micro=MICRO,
            shard=0,
            offset=OFFSET,
        )
        relay.send(w0, frame)
        relay.send(w1, frame)
        await c.wait_for(
            lambda step=step, base=base: (
                sum(m["step"] == step for _, m in parts) == 2 or c.engine.store.version != base
            ),
            90,
            f"the slices of step {step}",
        )
        done = [(w, m) for w, m in parts if m["step"] == step]
        if len(done) == 2:
            break
    else:
        pytest.fail("no step ran on a settled version in 5 tries")

    assert {w for w, _ in done} == {w0, w1}
    slices = {w: codecs.decode_tree(m["tensors"]) for w, m in done}
    snap = c.engine.store.snapshot()
    assert all(m["base"] == base and m["samples"] == M * MICRO for _, m in done)
    assert all(p.startswith("b00/") for p in slices[w0]) and all(
        p.startswith("b01/") for p in slices[w1]
    )
    assert set(slices[w0]).isdisjoint(slices[w1])
    assert set(slices[w0]) | set(slices[w1]) == set(c.engine.store.shapes)

    # the reference: jax.grad of the whole model on the same samples and parameters
    setup = config_mod.worker_setup(c.daemon.cfg)
    data = load_dataset(
        setup["dataset"]["spec"], seed=setup["dataset"]["seed"], **setup["dataset"]["kwargs"]
    )
    rows = (OFFSET + np.arange(M * MICRO)) % len(data.y_train)
    model = mlp_model(data.num_classes)
    params = {k: np.asarray(v) for k, v in snap.tensors.items()}
    loss, grads = jax.value_and_grad(model.loss)(params, data.x_train[rows], data.y_train[rows])
    got = {**slices[w0], **slices[w1]}
    for path, g in grads.items():
        np.testing.assert_allclose(got[path], np.asarray(g), atol=2e-5, err_msg=path)
    last = next(m for w, m in done if w == w1)
    assert last["loss"] == pytest.approx(float(loss), abs=1e-4)
    assert relay.stats().frames >= 2 * M  # every micro-batch's activation and its gradient
