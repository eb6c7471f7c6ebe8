"""Fault injection on a real daemon: errors name the frame they answer, a hot swap is all or
nothing, and a plug-in factory that raises stops ``hetd serve`` with one line and exit 2."""

from __future__ import annotations

from typing import Any

import aiohttp
import numpy as np
import pytest

from hetd.codecs import registry as codecs
from hetd.protocol import wire
from tests.conftest import SHARED_LOOP, Cluster
from tests.conftest import WORKER_AUTH as AUTH
from tests.conftest import raw_hello as hello
from tests.conftest import recv_type as recv


def push_fields(params: dict[str, np.ndarray], base: int, **overrides: Any) -> dict[str, Any]:
    tensors = codecs.encode_tree(params, codecs.get_codec("none"))
    fields = dict(base=base, kind="grad", tensors=tensors, samples=8, steps=1, compute_s=0.01)
    fields.update(overrides)
    return fields


# --- every error carries the id of the frame it answers ------------------------------------------


@pytest.mark.parametrize(
    ("raw", "code"),
    [
        ({"v": 1, "type": "push", "id": 41, "base": 0}, "malformed"),  # missing fields
        ({"v": 1, "type": "pull", "id": 42, "have": "x"}, "malformed"),  # a wrong type
        ({"v": 1, "type": "heartbeat", "id": 43, "colour": 1}, "malformed"),  # unknown field
        ({"v": 2, "type": "push", "id": 44}, "bad_version"),
        ({"v": 1, "type": "teleport", "id": 45}, "unknown_type"),
        ({"v": 1, "type": "hello", "id": 46, "name": "", "device": {}, "codecs": []}, "malformed"),
    ],
)
def test_a_refused_frame_names_its_request_id(raw: dict[str, Any], code: str) -> None:
    import msgpack

    with pytest.raises(wire.ProtocolError) as info:
        wire.decode(msgpack.packb(raw))
    assert (info.value.code, info.value.id) == (code, raw["id"])


def test_an_id_that_cannot_be_read_is_zero() -> None:
    import msgpack

    with pytest.raises(wire.ProtocolError) as info:
        wire.decode(msgpack.packb({"v": 1, "type": "push", "id": "seven"}))
    assert info.value.id == 0


@SHARED_LOOP
async def test_a_malformed_push_is_answered_with_its_own_id(raw_asp: Cluster) -> None:
    c = raw_asp
    async with aiohttp.ClientSession() as http:
        ws = await http.ws_connect(c.url + "/v1/ws", headers=AUTH)
        await ws.send_bytes(hello())
        await recv(ws, "welcome")
        params = codecs.decode_tree((await recv(ws, "params"))["tensors"])
        zeros = {k: np.zeros_like(v) for k, v in params.items()}
        version = c.engine.store.version
        cases: list[tuple[int, dict[str, Any]]] = [
            (11, {"samples": -5}),
            (12, {"steps": 0}),
            (13, {"kind": "hessian"}),
            (14, {"loss": float("nan")}),
        ]
        for request_id, bad in cases:
            await ws.send_bytes(
                wire.encode("push", request_id, **push_fields(zeros, version, **bad))
            )
            err = await recv(ws, "error")
            assert (err["code"], err.id) == ("malformed", request_id), err.body
        assert c.engine.store.version == version
        await ws.close()


# --- a plug-in factory that raises stops `hetd serve` with one line and exit 2 -------------------


def raising_model(num_classes: int) -> Any:
    """A model plug-in whose factory fails (what `--model pkg.mod:factory` may point at)."""
    raise TypeError("raising_model() got an unexpected keyword argument 'width'")


def raising_dataset(seed: int = 0) -> Any:
    """A data set plug-in whose factory fails."""
    raise RuntimeError("the data share is not mounted")


@pytest.mark.parametrize(
    ("option", "spec", "words"),
    [
        ("--model", f"{__name__}:raising_model", ["raising_model", "TypeError", "width"]),
        ("--dataset", f"{__name__}:raising_dataset", ["raising_dataset", "not mounted"]),
    ],
)
async def test_a_plug_in_factory_that_raises_exits_2_with_one_line(
    option: str, spec: str, words: list[str]
) -> None:
    import asyncio
    import os
    from pathlib import Path

    from hetd.local.procs import spawn_daemon

    root = Path(__file__).resolve().parents[2]
    args = ["--port", "0", "--admin-port", "-1", "--dataset", "digits", option, spec]
    env = {k: v for k, v in os.environ.items() if not k.startswith("HETD_")}
    env["HETD_WORKER_TOKEN"] = "worker-secret-for-tests"  # (none: start-up would stop on that)
    proc = await spawn_daemon(
        *args,
        cwd=root,
        env={**env, "JAX_PLATFORMS": "cpu"},
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    _, err = await asyncio.wait_for(proc.communicate(), 120)
    text = err.decode()
    assert proc.returncode == 2, text
    assert "Traceback" not in text, text
    # hetd serve logs its events at INFO (it listened before it built the model); the error
    # itself is one line of its own
    lines = [line for line in text.splitlines() if line.strip() and " INFO hetd." not in line]
    assert len(lines) == 1 and lines[0].startswith("hetd: "), text
    for word in words:
        assert word in lines[0], text


# --- the update guard: a poisoned push is refused, the model survives ----------------------------


@SHARED_LOOP
async def test_a_poisoned_push_is_refused_by_the_daemon(raw_asp: Cluster) -> None:
    from tests.conftest import ADMIN_TOKEN

    c = raw_asp
    assert c.engine.config.guard_factor == 100.0  # [train] guard_factor's default
    async with aiohttp.ClientSession() as http:
        ws = await http.ws_connect(c.url + "/v1/ws", headers=AUTH)
        await ws.send_bytes(hello())
        wid = (await recv(ws, "welcome"))["worker_id"]
        params = codecs.decode_tree((await recv(ws, "params"))["tensors"])
        rng = np.random.default_rng(0)
        for i in range(25):
            grads = {
                k: rng.standard_normal(v.shape).astype(np.float32) * 1e-3 for k, v in params.items()
            }
            fields = push_fields(grads, c.engine.store.version)
            await ws.send_bytes(wire.encode("push", 100 + i, **fields))
            assert (await recv(ws, "ack"))["status"] == "applied"
        version = c.engine.store.version
        before = {k: np.array(v) for k, v in c.engine.store.snapshot().tensors.items()}
        poison = {k: np.full(v.shape, 1e30, np.float32) for k, v in params.items()}
        await ws.send_bytes(wire.encode("push", 500, **push_fields(poison, version)))
        err = await recv(ws, "error")
        assert (err["code"], err.id) == ("out_of_range", 500), err.body
        assert c.engine.store.version == version
        for k, v in c.engine.store.snapshot().tensors.items():
            np.testing.assert_array_equal(v, before[k])
        async with http.get(
            c.admin_url + "/metrics", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}
        ) as resp:
            text = await resp.text()
        assert f'hetd_worker_updates_refused_total{{name="raw",worker="{wid}"}} 1.0' in text
        await ws.close()


# --- identity: resuming a worker's id needs the secret its welcome gave it ------------------------


@SHARED_LOOP
async def test_a_departed_id_is_not_taken_over_with_the_token_alone(raw_asp: Cluster) -> None:
    c = raw_asp
    async with aiohttp.ClientSession() as http:
        ws = await http.ws_connect(c.url + "/v1/ws", headers=AUTH)
        await ws.send_bytes(hello())
        welcome = await recv(ws, "welcome")
        wid, secret = welcome["worker_id"], welcome["secret"]
        assert isinstance(secret, str) and len(secret) >= 32
        # one push answered: a worker that leaves without one leaves nothing to resume
        params = codecs.decode_tree((await recv(ws, "params"))["tensors"])
        zeros = {k: np.zeros_like(v) for k, v in params.items()}
        await ws.send_bytes(wire.encode("push", 2, **push_fields(zeros, c.engine.store.version)))
        await recv(ws, "ack")
        await ws.close()
        await c.wait_for(lambda: wid in c.engine.members.departed, 10, "the worker to leave")
        for resume in ({"worker_id": wid}, {"worker_id": wid, "secret": "guess"}):
            thief = await http.ws_connect(c.url + "/v1/ws", headers=AUTH)
            await thief.send_bytes(
                wire.encode("hello", 1, name="thief", device={}, codecs=["none"], resume=resume)
            )
            other = await recv(thief, "welcome")
            assert other["worker_id"] != wid and other["secret"] != secret
            await thief.close()
        assert wid in c.engine.members.departed
        ws = await http.ws_connect(c.url + "/v1/ws", headers=AUTH)
        await ws.send_bytes(
            wire.encode(
                "hello",
                1,
                name="raw",
                device={},
                codecs=["none"],
                resume={"worker_id": wid, "secret": secret},
            )
        )
        assert (await recv(ws, "welcome"))["worker_id"] == wid
        await ws.close()


# --- a hot swap is all or nothing ------------------------------------------------------------------


async def test_a_hot_swap_is_all_or_nothing(cluster) -> None:  # type: ignore[no-untyped-def]
    """ashl with 3 real workers (one departed) in SHL; refused swaps (an unknown name, bad
    parameters, a policy whose first decision raises) change nothing; a swap to asp puts every
    plan back to its defaults."""
    from hetd.local.procs import stop_processes
    from policies import Plan
    from tests.conftest import ADMIN_TOKEN
    from tests.unit.test_swap import exploding  # registers test-explodes

    assert exploding
    c = await cluster("ashl", {"switch_loss": 10.0}, batch_size=16)
    for slowdown in (1, 1.5, 2):
        await c.spawn(slowdown, 0.01)
    await c.wait_for(
        lambda: c.engine.host.stage == "SHL" and len(c.engine.members.facts) == 3, 90, "SHL"
    )
    await stop_processes(c.procs[-1:])
    await c.wait_for(lambda: len(c.engine.members.departed) == 1, 30, "one worker to leave")
    admin = {"Authorization": f"Bearer {ADMIN_TOKEN}"}

    def snapshot() -> tuple[Any, ...]:
        e = c.engine
        return (e.host.policy.describe(), e.host.state, e.host.stage, dict(e.members.plans))

    def lineage(state: Any) -> tuple[Any, ...]:
        # The two workers still train, and every event (a push, a tick) gives ashl a new state
        # object: what a refused swap must keep is this state's line, its parameters, stage and
        # stage history (a new ashl state starts over in "profile"; another policy's is no
        # AshlState), not the object of the moment.
        return (type(state), state.cfg, state.stage, state.transitions, state.switch)

    async with aiohttp.ClientSession() as http:
        before = snapshot()
        assert any(p.codec == "topk" for p in before[3].values())
        for body in (
            {"name": "nope"},
            {"name": "asp", "params": {"weight": "x"}},
            {"name": "ssp", "params": {"stalenes": 2}},
            {"name": "test-explodes"},
        ):
            async with http.put(c.admin_url + "/v1/policy", json=body, headers=admin) as resp:
                reply = await resp.json()
                assert (resp.status, reply["error"]) == (400, "bad_policy"), reply
                assert reply["policy"] == before[0]
            after = snapshot()
            assert after[0] == before[0] and after[2] == before[2]
            assert lineage(after[1]) == lineage(before[1])
            # the plans may only have moved by ashl's own decisions (an lr schedule step)
            assert {w: p.codec for w, p in after[3].items()} == {
                w: p.codec for w, p in before[3].items()
            }
        async with http.put(
            c.admin_url + "/v1/policy", json={"name": "asp"}, headers=admin
        ) as resp:
            assert resp.status == 200, await resp.text()
        assert c.engine.host.policy.name == "asp" and c.engine.host.stage == "main"
        for wid, plan in c.engine.members.plans.items():
            codec = c.engine.members.facts[wid].codec
            assert plan == Plan(batch_size=16, codec=codec, stage="main"), (wid, plan)
        version = c.engine.store.version
        await c.wait_for(lambda: c.engine.store.version >= version + 10, 60, "asp to train on")


# --- a policy swap or patch is durable at once ------------------------------------------------------


async def test_a_policy_change_is_checkpointed_at_once(cluster, tmp_path) -> None:  # type: ignore[no-untyped-def]
    from hetd.server import checkpoint
    from hetd.server.daemon import Daemon
    from tests.conftest import ADMIN_TOKEN

    store = {"dir": str(tmp_path), "interval_s": 0.0}
    c = await cluster("ssp", {"staleness": 3}, store=store)
    admin = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    async with aiohttp.ClientSession() as http:
        async with http.put(
            c.admin_url + "/v1/policy", json={"name": "dssp", "params": {"s_lo": 2}}, headers=admin
        ) as resp:
            reply = await resp.json()
            assert resp.status == 200, reply
        found = checkpoint.load_newest(tmp_path)
        assert found is not None and reply["checkpoint"]["path"] == found[0].path
        assert found[1]["policy"]["name"] == "dssp"
        async with http.patch(
            c.admin_url + "/v1/policy", json={"params": {"r_max": 5}}, headers=admin
        ) as resp:
            assert resp.status == 200, await resp.text()
    # a crash now (no final checkpoint): the restarted daemon runs the operator's policy
    await c.daemon.stop(final_checkpoint=False)
    again = Daemon(c.daemon.cfg)
    try:
        await again.start()
        assert again.engine.host.policy.describe() == {
            "name": "dssp",
            "params": {"s_lo": 2, "r_max": 5, "weight": None},
        }
    finally:
        await again.stop(final_checkpoint=False)


# --- a swap away from pipelining never strands a worker ----------------------------------------------


async def test_swaps_between_hps_and_bsp_never_strand_a_worker(cluster) -> None:  # type: ignore[no-untyped-def]
    """hps pipelines: a worker computes on while its pushes wait, so it may hold two pushes
    unanswered where the daemon owes it one release. A swap to a policy without pipelining used
    to leave such a worker waiting for a release that never came, and with it every synchronous
    round (the real bench's restart found it: 5 of 12 runs stalled). Swap back and forth under
    three unequal real workers; training goes on after every swap."""
    from tests.conftest import ADMIN_TOKEN

    c = await cluster("hps", {}, batch_size=16)
    for slowdown in (1, 2, 4):
        await c.spawn(slowdown, 0.01)
    await c.wait_for(lambda: c.engine.store.version >= 10, 90, "hps to train")
    admin = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    async with aiohttp.ClientSession() as http:
        for name in ("bsp", "hps", "bsp", "hps", "lbbsp"):
            if name != "hps":  # leaving hps: some plan pipelines
                await c.wait_for(
                    lambda: any(p.pipeline for p in c.engine.members.plans.values()),
                    60,
                    "pipelined plans before the swap",
                )
            async with http.put(
                c.admin_url + "/v1/policy", json={"name": name}, headers=admin
            ) as resp:
                assert resp.status == 200, await resp.text()
            target = c.engine.store.version + 5
            await c.wait_for(
                lambda v=target: c.engine.store.version >= v,
                60,
                f"{name} to train on",
            )
