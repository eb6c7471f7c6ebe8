"""Real mode of DP+MP: one 2-stage pipeline replica of real ``hetd-worker`` processes beside a
data-parallel worker, through a real daemon. The stages' slices of a step are disjoint, cover the
model and equal the whole model's ``jax.grad`` on the same samples; each stage is sent only its
slice of the parameters; assembled steps are applied as
whole pushes; killing stage 1 mid-run discards that step (nothing partial applied), and stage 0
goes on as a data-parallel worker."""

from __future__ import annotations

from typing import Any

import aiohttp
import jax
import numpy as np
import pytest

from hetd import config as config_mod
from hetd.codecs import registry as codecs
from hetd.local.demo import DemoOptions
from hetd.protocol import wire
from hetd.zoo.blocks import mlp_model
from hetd.zoo.data import load_dataset
from tests.conftest import ADMIN_TOKEN

pytestmark = pytest.mark.slow


async def test_a_replica_trains_beside_dp_and_falls_back_when_a_stage_dies(cluster) -> None:  # type: ignore[no-untyped-def]
    c = await cluster("asp", model="hetd.zoo.blocks:mlp_model")
    procs = [await c.spawn(1.0, 0.01) for _ in range(3)]
    await c.wait_for(lambda: len(c.engine.members.facts) == 3, 120, "3 workers to join")
    by_name = {f.name.split("-")[0]: w for w, f in c.engine.members.facts.items()}
    w0, w1 = by_name["w0"], by_name["w1"]
    driver = c.daemon.replicas
    assert driver is not None
    # what the stages were released (the version every stage computes on) and what they sent
    released: dict[int, Any] = {}
    slices: list[tuple[int, wire.Message]] = []
    release, take = driver.release, c.daemon.relay.on_part
    assert take is not None

    def spy_release() -> None:
        release()
        released[driver.step] = c.engine.store.snapshot()  # taken in the same engine turn

    driver.release = spy_release  # type: ignore[method-assign]
    params_sent: list[tuple[int, wire.Message]] = []  # the parameters each stage was sent
    send = driver._send

    def spy_send(wid: int, frame: bytes) -> None:
        msg = wire.decode(frame)
        if msg.type == "params":
            params_sent.append((wid, msg))
        send(wid, frame)

    driver._send = spy_send
    c.daemon.relay.on_part = lambda wid, msg: (slices.append((wid, msg)), take(wid, msg))[1]
    body = {"members": [w0, w1], "cuts": [0, 1, 2], "micro": 16, "micro_batches": 4}
    auth = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    async with aiohttp.ClientSession(headers=auth) as http:
        async with http.post(c.admin_url + "/v1/replicas", json={**body, "cuts": [0, 2]}) as r:
            assert r.status == 409 and "cuts" in (await r.json())["message"]
        async with http.post(c.admin_url + "/v1/replicas", json=body) as r:
            assert r.status == 200 and (await r.json())["members"] == [w0, w1]
        # counted from here: the members' data-parallel pushes before the replica formed are
        # theirs (under load a member may push several while the request is under way)
        a0, p1, s0 = (
            c.engine.members.stats[w0].applied,
            c.engine.members.stats[w1].pushes,
            driver.assembled,
        )

    def trained() -> bool:  # digits to the demo's target, with the replica's steps in it
        acc = c.engine.evaluations.evals[-1][2] if c.engine.evaluations.evals else 0.0
        return driver.assembled >= 10 and acc >= DemoOptions().target

    await c.wait_for(
        trained, 180, f"10 assembled replica steps and accuracy {DemoOptions().target}"
    )
    assert driver.aborted == 0, driver.dropped
    # staged, the two run replica steps only (one data-parallel push may have been under way)
    assert c.engine.members.stats[w0].applied - a0 - (driver.assembled - s0) in (0, 1)
    assert c.engine.members.stats[w1].pushes - p1 in (0, 1)

    # step 1's two slices: disjoint, covering, and the whole model's gradient on its samples
    first = {w: m for w, m in slices if m["step"] == 1}
    assert set(first) == {w0, w1}
    got = {w: codecs.decode_tree(m["tensors"]) for w, m in first.items()}
    assert all(p.startswith("b00/") for p in got[w0]) and all(p.startswith("b01/") for p in got[w1])
    assert set(got[w0]).isdisjoint(got[w1])
    assert set(got[w0]) | set(got[w1]) == set(c.engine.store.shapes)
    assert first[w0]["base"] == released[1].version
    setup = config_mod.worker_setup(c.daemon.cfg)["dataset"]
    data = load_dataset(setup["spec"], seed=setup["seed"], **setup["kwargs"])
    rows = (64 + np.arange(64)) % len(data.y_train)  # step 1 of 4 x 16 samples starts at 64
    params = {k: np.asarray(v) for k, v in released[1].tensors.items()}
    loss, ref = jax.value_and_grad(mlp_model(data.num_classes).loss)(
        params, data.x_train[rows], data.y_train[rows]
    )
    whole = {**got[w0], **got[w1]}
    for path, g in ref.items():
        np.testing.assert_allclose(whole[path], np.asarray(g), atol=2e-5, err_msg=path)
    assert first[w1]["loss"] == pytest.approx(float(loss), abs=1e-4)

    # each stage was sent only its own blocks' slice of the parameters, every step
    own = {w0: "b00/", w1: "b01/"}
    assert {w for w, _ in params_sent} == {w0, w1}
    for w, m in params_sent:
        assert m["full"] and all(p.startswith(own[w]) for p in codecs.decode_tree(m["tensors"]))

    procs[1].kill()  # stage 1 dies mid-run
    await c.wait_for(lambda: not driver.members, 60, "the replica to dissolve")
    assert driver.aborted == 1
    assembled, applied = driver.assembled, c.engine.members.stats[w0].applied
    # stage 0 goes back to data-parallel steps: its own pushes are applied again
    await c.wait_for(
        lambda: c.engine.members.stats[w0].applied >= applied + 5,
        90,
        "stage 0's data-parallel pushes",
    )
    assert driver.assembled == assembled  # the lost step was never applied, nor any part of it
    assert c.daemon.relay.routes == {}
    async with (
        aiohttp.ClientSession(headers=auth) as http,
        http.get(c.admin_url + "/metrics") as r,
    ):
        text = await r.text()
    assert f"hetd_replica_steps_assembled {float(assembled)}" in text
    assert "hetd_replica_steps_aborted 1.0" in text
    assert "hetd_relay_frames " in text and "hetd_relay_dropped " in text
    assert c.engine.applier.updates_applied == c.engine.store.version
