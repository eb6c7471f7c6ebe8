"""Two ``hetd pserver`` processes follow a real engine's decision log over the link; one is killed
(SIGKILL) mid-run and restarted on its directory; both end with the engine's store bit for bit.

The head is this test's process: a real engine (the bundled MLP, Adam, ``asp``, publishing in
batches so its store sums the steps queued between publishes, a checkpoint every few pushes)
writing its log, served by the daemon's :class:`~hetd.server.pserver_link.HeadLink` on loopback.
Two workers push real-shaped updates (one in int8); the test plays their part of the future
protocol: each push's parts go to the two pservers (``part``, answered ``held``) before the push
goes to the engine. Pserver 1 is killed after the second checkpoint with records and parts in
flight; the parts meant for it meanwhile wait, as a worker keeps what was not answered, and are
sent once it is back, with a few it had already reported held (answered as repeats). At the end
each pserver serves its slice at the engine's last position (``fetch``); joined, they are the
store's parameters, and the restarted pserver resumed from a saved slice, not from position 0.
The same release pulled as a worker pulls it (``workers.pulls``: named by the head's
``params_at``, each slice checked against its hash, the whole against the version's) is the
store's parameters too; a release the pservers no longer keep, or a hash that is not the
slice's, is refused.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from hetd.core.assemble import EngineSpec, Optimizers, assemble
from hetd.core.entries import EngineConfig
from hetd.core.ingest import decode_hello
from hetd.core.store import Int8
from hetd.protocol import frames, wire
from hetd.protocol.frames import ParamsAt
from hetd.protocol.messages import Ack, PushIn
from hetd.pserver import disk, link
from hetd.pserver.log import DecisionLog
from hetd.pserver.partition import join, partition, split
from hetd.server.pserver_link import HeadLink, LinkSetup
from hetd.server.pserver_pulls import Pointers
from tests.conftest import FakeClock, FakePeer
from tests.unit.test_pserver_engine import BLOCK, PARAMS
from workers.pulls import Puller, SliceMismatch

S = 2
PUSHES = 30
KILL_AT = 14  # pushes before pserver 1 is killed (two checkpoints behind it)
BACK_AT = 20  # pushes before it is started again


def _hello(name: str) -> Any:
    fields = {"name": name, "device": {"platform": "cpu"}, "codecs": ["none"]}
    return decode_hello(wire.decode(wire.encode("hello", 7, **fields)))


def _update(seed: int, int8: bool) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    out: dict[str, Any] = {}
    for k, v in PARAMS.items():
        g = (rng.standard_normal(v.shape) * 0.05).astype(np.float32)
        if int8:
            scale = np.float32(max(float(np.max(np.abs(g))), 1e-12) / 127)
            out[k] = Int8(np.clip(np.round(g / scale), -127, 127).astype(np.int8), scale)
        else:
            out[k] = g
    return out


async def _spawn(port: int, server: int, directory: Path) -> asyncio.subprocess.Process:
    (directory / "port").unlink(missing_ok=True)
    with open(directory.parent / f"pserver{server}.log", "ab") as err:
        return await _exec(port, server, directory, err)


async def _exec(port: int, server: int, directory: Path, err: Any) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "hetd",
        "pserver",
        "--head",
        f"127.0.0.1:{port}",
        "--slice",
        str(server),
        "--dir",
        str(directory),
        stdout=asyncio.subprocess.DEVNULL,
        stderr=err,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )


class Pusher:
    """A connection to one pserver's parts port."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def connect(self, proc: asyncio.subprocess.Process) -> None:
        path = self.directory / "port"
        for _ in range(1200):  # the process imports JAX first
            if path.exists():
                break
            assert proc.returncode is None, "the pserver exited"
            await asyncio.sleep(0.05)
        port = int(path.read_text())
        self.reader, self.writer = await asyncio.open_connection("127.0.0.1", port)

    async def ask(self, kind: str, **fields: Any) -> dict[str, Any]:
        assert self.reader is not None and self.writer is not None
        await link.send(self.writer, kind, **fields)
        reply = await asyncio.wait_for(link.recv(self.reader), 120)
        assert reply["t"] != "error", reply
        return reply

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None


@pytest.mark.slow
async def test_two_pserver_processes_one_killed_and_restarted_end_with_the_store(
    tmp_path: Path,
) -> None:
    optimizers = Optimizers("adam", 1e-3)
    spec = EngineSpec(
        PARAMS,
        "asp",
        optimizers=optimizers,
        settings=EngineConfig(max_staleness=1000, guard_factor=0.0),
    )
    log = DecisionLog()
    engine = assemble(spec).engine(FakeClock(), None, decisions=log)
    engine.defer_publishing()  # the daemon's mode: steps between publishes are summed
    pmap = partition({k: v.shape for k, v in PARAMS.items()}, S, block_bytes=BLOCK)
    head = HeadLink(engine, LinkSetup(pmap, optimizers.specs()[0], PARAMS))
    port = await head.start("127.0.0.1", 0)
    dirs = [tmp_path / f"slice{s}" for s in range(S)]
    for d in dirs:
        d.mkdir()
    procs = [await _spawn(port, s, dirs[s]) for s in range(S)]
    pushers = [Pusher(d) for d in dirs]
    try:
        for s in range(S):
            await pushers[s].connect(procs[s])
        peers = [FakePeer(), FakePeer()]
        wids = [engine.join(_hello(f"w{i}"), p) for i, p in enumerate(peers)]
        first_release: tuple[int, int] | None = None  # (version, position) of the first publish
        waiting: list[tuple[int, int, Any]] = []  # parts for pserver 1 while it is down
        sent1: list[tuple[int, int, Any]] = []  # every part pserver 1 was sent
        for n in range(PUSHES):
            i = n % 2
            wid, pid = wids[i], n // 2 + 1
            update = _update(n, int8=i == 1)
            parts = split(pmap, update)
            for s in range(S):
                raw = link.encode_tensors(parts[s])
                if s == 1:
                    sent1.append((wid, pid, raw))
                if s == 1 and KILL_AT <= n < BACK_AT:
                    waiting.append((wid, pid, raw))
                    continue
                reply = await pushers[s].ask("part", worker=wid, pid=pid, tensors=raw)
                assert reply["t"] == "held" and reply["new"] is True
            engine.push(
                PushIn(wid, pid, engine.store.version, "grad", update, 32, 1, 1.0, None, None, 1)
            )
            assert isinstance(peers[i].replies[-1], Ack)
            if n % 3 == 2:
                engine.publish_batch()
                if first_release is None:
                    first_release = (engine.store.version, log.position)
            if n % 5 == 4:
                engine.state()  # a checkpoint entry: each pserver saves its slice there
            if n == KILL_AT - 1:
                await asyncio.sleep(0.5)  # records on their way, some carried out
                procs[1].send_signal(signal.SIGKILL)
                await procs[1].wait()
                pushers[1].close()
            if n == BACK_AT - 1:
                saved = disk.listing(dirs[1])
                assert saved, "pserver 1 saved no slice before it was killed"
                procs[1] = await _spawn(port, 1, dirs[1])
                pushers[1] = Pusher(dirs[1])
                await pushers[1].connect(procs[1])
                for wid_, pid_, raw in sent1[KILL_AT - 4 : KILL_AT] + waiting:
                    reply = await pushers[1].ask("part", worker=wid_, pid=pid_, tensors=raw)
                    assert reply["t"] == "held"
                assert (
                    [  # the ones it had reported held come back from its parts file
                        await pushers[1].ask("part", worker=w, pid=p, tensors=r)
                        for w, p, r in sent1[KILL_AT - 2 : KILL_AT]
                    ][-1]["new"]
                    is False
                )
            await asyncio.sleep(0)
        engine.publish_batch()
        end = dict(engine.store.snapshot().tensors)  # a step entry: where a release reads
        got = []
        for s in range(S):
            reply = await pushers[s].ask("fetch", position=log.position)
            assert reply["position"] == log.position and reply["version"] == engine.store.version
            got.append(link.decode_tensors(reply["tensors"], pmap.slice_shapes(s)))
        joined = join(pmap, got)
        assert all(joined[k].tobytes() == end[k].tobytes() for k in end)
        assert sum(int(np.sum(end[k] != PARAMS[k])) for k in end) > 0
        assert min(head.durable) >= 10  # both reported saved slices past the first checkpoints

        named = frames.decode(Pointers(pmap, log)(engine.store))
        assert isinstance(named, ParamsAt) and named.position == log.position
        addrs = [["127.0.0.1", int((d / "port").read_text())] for d in dirs]
        puller = Puller({"map": pmap.to_dict(), "addrs": addrs})
        try:
            pulled = await puller.fetch(named)
            assert pulled is not None
            held, size = pulled
            assert held.version == engine.store.version and size > 4 * sum(
                v.size for v in end.values()
            )
            assert all(held.tensors[k].tobytes() == end[k].tobytes() for k in end)
            assert first_release is not None  # many versions back: no longer kept, asked again
            assert await puller.fetch(ParamsAt(*first_release, named.slices)) is None
            assert (
                await puller.fetch(ParamsAt(named.version - 1, named.position, named.slices))
                is None
            )
            assert puller.gone == 2
            wrong = ParamsAt(named.version, named.position, (named.slices[1], named.slices[0]))
            with pytest.raises(SliceMismatch, match="pserver 0's slice"):
                await puller.fetch(wrong)
        finally:
            puller.close()
        assert all(p.returncode is None for p in procs)  # none gave up
    finally:
        for pusher in pushers:
            pusher.close()
        for proc in procs:
            if proc.returncode is None:
                proc.send_signal(signal.SIGKILL)
                await proc.wait()
        await head.close()


@pytest.mark.slow
async def test_the_daemon_serves_its_log_to_pserver_processes_and_forgets_what_they_saved(
    tmp_path: Path,
) -> None:
    """``hetd serve`` with ``[pservers] servers = 2``: the link listens, two ``hetd pserver``
    processes start from the initial tensors it sends, save their slices at the daemon's
    checkpoint entry and say so; the next checkpoint lets the log forget up to there."""
    from hetd import config as config_mod
    from hetd.server.daemon import Daemon
    from tests.conftest import make_config

    cfg = make_config("asp", optimizer="adam", lr=0.01)
    cfg = config_mod.replace(cfg, "server", admin_port=-1)
    cfg = config_mod.replace(cfg, "store", dir=str(tmp_path / "state"), interval_s=0.0)
    cfg = config_mod.replace(cfg, "pservers", log=True, servers=2, port=0)
    daemon = Daemon(cfg)
    await daemon.start()
    procs = []
    pushers: list[Pusher] = []
    try:
        link_ = daemon.pservers
        assert link_ is not None and link_.setup.pmap.servers == 2
        dirs = [tmp_path / f"slice{s}" for s in range(2)]
        for s, d in enumerate(dirs):
            d.mkdir()
            procs.append(await _spawn(link_.port, s, d))
        for s in range(2):
            pushers.append(Pusher(dirs[s]))
            await pushers[s].connect(procs[s])  # listening: its welcome came
        first = await daemon.checkpoint()
        position = daemon.engine.store.decisions.position  # type: ignore[union-attr]
        for _ in range(1200):
            if link_.durable == [position, position]:
                break
            await asyncio.sleep(0.05)
        described = daemon.describe()["decisions"]
        assert described["saved"] == [position] * 2 and described["connected"] == [0, 1]
        assert all(len(disk.listing(d)) == 1 for d in dirs)
        await daemon.checkpoint()
        first_held = daemon.describe()["decisions"]["first"]
        assert position + 1 <= first_held <= min(link_.durable) + 1  # forgotten what they saved
        assert first.version == 0 and all(p.returncode is None for p in procs)
    finally:
        for pusher in pushers:
            pusher.close()
        for proc in procs:
            proc.send_signal(signal.SIGKILL)
            await proc.wait()
        await daemon.stop(final_checkpoint=False)
