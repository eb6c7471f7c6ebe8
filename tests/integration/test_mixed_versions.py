"""Workers and daemons of different releases work together: the daemon sends the optional
``hash`` field only to workers whose hello names it, and a worker whose hello ``features`` an
older daemon refuses says hello again without them."""

from __future__ import annotations

import asyncio
import contextlib

import aiohttp
import pytest

from hetd.local.procs import stop_processes
from hetd.protocol import wire
from hetd.protocol.frames import as_params
from hetd.protocol.params import apply_params, hash_matches
from hetd.server.daemon import Daemon
from tests.conftest import (
    SHARED_LOOP,
    WORKER_AUTH,
    Cluster,
    make_config,
    recv_type,
    start_worker,
)

pytestmark = pytest.mark.slow


def _hello(features: list[str] | None) -> bytes:
    extra = {} if features is None else {"features": features}
    return wire.encode("hello", 1, name="raw", device={"platform": "cpu"}, codecs=["none"], **extra)


@SHARED_LOOP
async def test_only_workers_that_name_the_hash_get_it(raw_asp: Cluster) -> None:
    c = raw_asp
    async with aiohttp.ClientSession() as http:
        old = await http.ws_connect(c.url + "/v1/ws", headers=WORKER_AUTH)
        new = await http.ws_connect(c.url + "/v1/ws", headers=WORKER_AUTH)
        await old.send_bytes(_hello(None))  # a worker from before the field
        await new.send_bytes(_hello(["hash", "a-feature-from-the-future"]))
        plain = await recv_type(old, "params")
        hashed = await recv_type(new, "params")
        assert plain["full"] and hashed["full"]
        # What an older worker's strict decoder would refuse is not in its frame ...
        assert "hash" not in plain.body
        # ... and the worker that asked gets the version's hash of the same parameters.
        assert hashed["version"] == plain["version"]
        held = apply_params(None, hashed)
        assert held is not None and hash_matches(held, as_params(hashed)) is True
        await old.close()
        await new.close()


async def test_a_new_worker_trains_with_a_daemon_that_refuses_hello_features(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # This daemon decodes hello as a daemon from before the field did: "features" is unknown.
    monkeypatch.delitem(wire.SCHEMA["hello"], "features")
    daemon = Daemon(make_config("asp"))
    procs: list[asyncio.subprocess.Process] = []
    try:
        port = await daemon.start()
        proc = await start_worker(port, 2)
        procs.append(proc)
        assert proc.stderr is not None
        log = (await asyncio.wait_for(proc.stderr.read(), 180)).decode(errors="replace")
        assert await asyncio.wait_for(proc.wait(), 60) == 0, log[-2000:]
        assert "takes no hello features" in log, log  # refused once, then said hello plainly
        assert "joined as worker 1" in log, log  # the refused hello joined nobody
        assert daemon.engine.store.version >= 1  # and its pushes were applied
    finally:
        await stop_processes(procs)
        with contextlib.suppress(Exception):
            await daemon.stop()
