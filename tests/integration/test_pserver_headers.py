"""A head that holds no parameters (``[pservers] headers = true``): two local pservers hold them,
two real ``hetd-worker`` processes send the head each push's header and the pservers its parts,
and pull every release from the pservers. The head decides from the headers and the pservers'
reports (each part's squared norm and bytes), evaluates and exports from parameters it pulls,
refuses a push whose part holds NaN, and a checkpoint of it names the pservers' slices; a second
daemon resumes from it, its pservers going back to that checkpoint. An older worker is refused at
its hello, and a push that carries its tensors is refused as malformed."""

from __future__ import annotations

import asyncio
import math
import re
from pathlib import Path

import aiohttp
import numpy as np
import pytest

from hetd import config as config_mod
from hetd.core.ledger import LedgerStore, NoParameters
from hetd.protocol import wire
from hetd.pserver import disk
from hetd.pserver.partition import join
from hetd.server import checkpoint
from hetd.server.daemon import Daemon
from tests.conftest import WORKER_AUTH, make_config, recv_type, spawn_worker, until
from tests.integration.test_pserver_train import _stop

WAIT = 240.0  # s: generous, every process imports JAX on a shared 2-core machine
STEPS = 8  # pushes per worker


def _headers(state: Path) -> config_mod.Config:
    cfg = make_config("asp", optimizer="momentum", lr=0.05, codec="int8", guard_factor=0.0)
    cfg = config_mod.replace(cfg, "server", admin_port=-1, stop_timeout_s=60.0)
    cfg = config_mod.replace(cfg, "store", dir=str(state / "state"), interval_s=0.0)
    return config_mod.replace(
        cfg, "pservers", log=True, servers=2, port=0, backend="local", headers=True
    )


async def _worker(port: int, steps: int, *extra: str) -> asyncio.subprocess.Process:
    return await spawn_worker(
        f"ws://127.0.0.1:{port}", *("--steps", str(steps), "--max-retries", "3", "-v"), *extra
    )


async def _finished(worker: asyncio.subprocess.Process) -> str:
    await asyncio.wait_for(worker.wait(), WAIT)
    assert worker.stderr is not None
    text = (await worker.stderr.read()).decode()
    assert worker.returncode == 0, text[-2000:]
    return text


def _pulled(text: str) -> int:
    found = re.search(r"releases pulled from the pservers: (\d+)", text)
    assert found is not None, text[-2000:]
    return int(found.group(1))


@pytest.mark.slow
async def test_a_head_of_headers_trains_evaluates_exports_and_resumes(tmp_path: Path) -> None:
    daemon = Daemon(_headers(tmp_path))
    port = await daemon.start()
    workers: list[asyncio.subprocess.Process] = []
    try:
        link = daemon.pservers
        engine = daemon.engine
        assert link is not None and isinstance(engine.store, LedgerStore)
        with pytest.raises(NoParameters):
            engine.store.snapshot()
        await until(link.ready.is_set, "both pservers said where they take parts")
        assert daemon.engine.config.welcome["pservers"]["headers"] is True
        await _refusals(port)
        # the same-host worker asks for shared memory: a head of headers offers none, and every
        # release of both is pulled from the pservers
        workers = [await _worker(port, STEPS), await _worker(port, STEPS, "--no-shm")]
        texts = [await _finished(w) for w in workers]
        for text in texts:
            assert _pulled(text) >= STEPS // 2, text[-2000:]
            assert "shared memory on" not in text
        assert link.parts.decided == 2 * STEPS and link.parts.lost == 0
        assert engine.store.version == 2 * STEPS
        assert daemon.describe()["decisions"]["head"] == "headers"
        # the head read headers only: its bytes in are the parts' (one byte a parameter, int8),
        # as the pservers reported them, with the headers' own few bytes
        n = engine.store.n_params
        assert 2 * STEPS * n <= engine.meters.bytes_in < 2 * STEPS * (n + 4096)
        # evaluations of parameters pulled from the pservers (every 0.5 s of the run)
        await until(lambda: len(engine.evaluations.evals) >= 1, "an evaluation")
        loss = engine.evaluations.evals[-1][1]
        assert math.isfinite(loss)

        await daemon.checkpoint()
        position = engine.store.decisions.position  # type: ignore[union-attr]
        await until(lambda: link.durable == [position] * 2, "both saved the checkpoint")
        dirs = [tmp_path / "state" / "pservers" / f"slice{s}" for s in range(2)]
        saved = [disk.load(disk.listing(d)[0]).slice for d in dirs]
        joined = join(link.setup.pmap, [s.params for s in saved])
        # an export pulls the version from the pservers: their saved slices, bit for bit
        reply = await daemon.export("model")
        assert reply["version"] == 2 * STEPS
        exported = exported_params(reply)
        assert sorted(exported) == sorted(joined)
        assert all(exported[k].tobytes() == joined[k].tobytes() for k in joined)
        # the checkpoint names the pservers' slices and holds no parameters of its own
        files = sorted((tmp_path / "state").glob("ckpt-*.msgpack"))
        assert files
        state = checkpoint.decode(files[-1].read_bytes())
        assert state["params"] == {} and state["version"] == 2 * STEPS
    finally:
        await _stop(daemon, workers)

    # a second life resumes from that checkpoint: the version, and pservers that load their
    # slices saved there; training goes on
    again = Daemon(_headers(tmp_path))
    port = await again.start()
    workers = []
    try:
        link = again.pservers
        assert link is not None and again.engine.store.version == 2 * STEPS
        await until(link.ready.is_set, "both pservers came back")
        workers = [await _worker(port, 3, "--no-shm")]
        await _finished(workers[0])
        assert again.engine.store.version == 2 * STEPS + 3 and link.parts.lost == 0
        await again.checkpoint()
        position = again.engine.store.decisions.position  # type: ignore[union-attr]
        await until(lambda: link.durable == [position] * 2, "both saved the checkpoint")
        dirs = [tmp_path / "state" / "pservers" / f"slice{s}" for s in range(2)]
        saved = [disk.load(disk.listing(d)[0]).slice for d in dirs]
        assert [s.version for s in saved] == [2 * STEPS + 3] * 2
        moved = join(link.setup.pmap, [s.params for s in saved])
        assert any(moved[k].tobytes() != joined[k].tobytes() for k in joined)
    finally:
        await _stop(again, workers)


async def _refusals(port: int) -> None:
    """An older worker (its hello names pservers and pulls, not headers) is refused at its hello,
    saying why; a worker that names it and sends a push with its tensors gets that push refused
    as malformed, and its session goes on."""
    url = f"ws://127.0.0.1:{port}/v1/ws"

    def hello(features: list[str]) -> bytes:
        return wire.encode(
            "hello", 1, name="raw", device={"platform": "cpu"}, codecs=["none"], features=features
        )

    async with aiohttp.ClientSession() as http:
        old = await http.ws_connect(url, headers=WORKER_AUTH)
        await old.send_bytes(hello(["hash", "pservers", "pulls"]))
        refused = await recv_type(old, "error")
        assert refused["code"] == "unsupported" and "headers = true" in refused["message"]
        await old.close()
        new = await http.ws_connect(url, headers=WORKER_AUTH)
        await new.send_bytes(hello(list(wire.WORKER_FEATURES)))
        await recv_type(new, "welcome")
        whole = {"w": {"codec": "none", "dtype": "float32", "shape": [1], "data": b"\0" * 4}}
        push = wire.encode(
            "push", 7, base=0, kind="grad", tensors=whole, samples=1, steps=1, compute_s=0.1
        )
        await new.send_bytes(push)
        err = await recv_type(new, "error")
        assert err["code"] == "malformed" and "headers only" in err["message"] and err.id == 7
        await new.send_bytes(wire.encode("heartbeat", 8))  # the session goes on
        await new.send_bytes(wire.encode("bye", 9, reason="test done"))
        await new.close()


def exported_params(reply: dict[str, object]) -> dict[str, np.ndarray]:
    """The parameters an export wrote (its params.msgpack), by flat path."""
    from flax import serialization, traverse_util

    blob = Path(str(reply["params_msgpack"])).read_bytes()
    nested = serialization.msgpack_restore(blob)
    return {k: np.asarray(v) for k, v in traverse_util.flatten_dict(nested, sep="/").items()}


@pytest.mark.slow
async def test_a_part_holding_nan_is_refused_from_the_pservers_report(tmp_path: Path) -> None:
    """The head never sees the tensors: a worker whose pushes carry NaN (emulated) has them
    refused on its pservers' reports, each logged as a drop that frees its parts, while the
    other worker's pushes train on."""
    daemon = Daemon(_headers(tmp_path))
    port = await daemon.start()
    workers: list[asyncio.subprocess.Process] = []
    try:
        link = daemon.pservers
        assert link is not None
        await until(link.ready.is_set, "both pservers said where they take parts")
        workers = [
            await _worker(port, STEPS, "--no-shm", "--emulate-bad-pushes", "1.0"),
            await _worker(port, STEPS, "--no-shm"),
        ]
        bad, good = workers
        await _finished(good)
        await asyncio.wait_for(bad.wait(), WAIT)
        assert bad.stderr is not None
        text = (await bad.stderr.read()).decode()
        # each of its pushes refused (the worker gives up after five in a row, as it does on
        # a daemon that reads the tensors itself)
        assert bad.returncode == 2 and "refused 5 pushes in a row" in text, text[-2000:]
        assert text.count("the update holds NaN or Inf") >= 5
        # every push was decided with both parts in; only the clean worker's were applied
        assert link.parts.decided == STEPS + 5 and link.parts.lost == 0
        assert link.parts.waiting() == 0 and daemon.engine.store.version == STEPS
    finally:
        await _stop(daemon, workers)
