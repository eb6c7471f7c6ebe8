"""Pservers for a head that sees only the pushes' headers (its welcome says ``headers: true``).

Two real pservers (:class:`hetd.server.pserver_proc.Pserver`, their parts ports on loopback)
follow a head played by this test over the real link: it welcomes them, sends the records it is
handed and keeps every frame they report. Pushes' parts (float32, int8, one with a NaN, one whose
squares overflow float32) are sent to both as a worker sends them.

* Each ``have`` carries the part's sum of squares (what the daemon's update guard measured from
  the whole push, squared: :func:`hetd.core.ingest.update_norm` of the same tensors) and its
  value bytes; a part that is not finite is held all the same (its ``sq`` is not finite: the
  head refuses the push and logs a drop, which frees it). A pserver restarted on its directory
  reports every part again, read back from its parts file, with the same measures.
* A ``pull``'s ``slice`` carries its tensors' hash; :class:`hetd.protocol.pulls.ReleasePuller`
  checks each slice against it when the release names no slice hashes, joins the release (the
  head's store's parameters bit for bit), and refuses a slice whose hash is not its tensors'
  (a pserver played by the test), or one that carries none when none is named.
* Without ``headers`` a ``have`` and a ``slice`` are what they were: no measure, no hash.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from hetd.core.assemble import Optimizers
from hetd.core.ingest import update_norm
from hetd.core.store import Int8, Store, make_optimizer
from hetd.protocol import pslink
from hetd.protocol.params import param_hash
from hetd.protocol.pulls import ReleasePuller, SliceMismatch
from hetd.protocol.sockframes import FrameServer
from hetd.pserver import link
from hetd.pserver.log import DecisionLog, Record, to_dict
from hetd.pserver.partition import PartitionMap, partition, split
from hetd.server.pserver_proc import Pserver

SHAPES = {"emb": (40, 3), "w": (3, 2), "b": (2,), "t": ()}
PARAMS = {
    k: np.linspace(-1, 1, int(np.prod(s)), dtype=np.float32).reshape(s) for k, s in SHAPES.items()
}
PMAP = partition(SHAPES, 2, block_bytes=200)  # emb (480 bytes) in blocks over both
SPECS = Optimizers("sgd", 0.1).specs()
WAIT_S = 60


def _update(seed: int, int8: bool = False) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    out: dict[str, Any] = {}
    for k, s in SHAPES.items():
        g = rng.standard_normal(s).astype(np.float32)
        if int8:
            scale = np.float32(max(float(np.max(np.abs(g))), 1e-12) / 127)
            out[k] = Int8(np.clip(np.round(g / scale), -127, 127).astype(np.int8), scale)
        else:
            out[k] = g
    return out


def _with(update: dict[str, Any], value: float) -> dict[str, Any]:
    """``update`` with one value of ``emb`` (which both pservers hold rows of) set to ``value``."""
    emb = update["emb"].copy()
    emb[0, 0] = value
    return {**update, "emb": emb}


# (worker, pid) -> the whole push; each pserver is sent its part
PUSHES = {
    (0, 1): _update(1),
    (1, 1): _update(2, int8=True),
    (0, 2): _with(_update(3), float("nan")),  # a part holding a NaN: held, and not finite
    (0, 3): {k: np.full(s, 3e38, np.float32) for k, s in SHAPES.items()},  # squares overflow
}


def _expected(server: int, key: tuple[int, int]) -> tuple[float, int]:
    """A part's sum of squares as the daemon measured a whole push, and its value bytes."""
    part = split(PMAP, PUSHES[key])[server]
    nbytes = sum(t.q.size if isinstance(t, Int8) else 4 * np.size(t) for t in part.values())
    return update_norm(part) ** 2, nbytes


def _same(a: float, b: float) -> bool:
    return a == b or (math.isnan(a) and math.isnan(b))


class Head:
    """The head's side of the link: a welcome (``headers`` as given; None: the field absent),
    the records it is handed, and each pserver's reports, in order."""

    def __init__(self, pmap: PartitionMap, headers: bool | None) -> None:
        self.pmap = pmap
        self.headers = headers
        self.records: list[Record] = []
        self.reports: list[asyncio.Queue[dict[str, Any]]] = [
            asyncio.Queue() for _ in range(pmap.servers)
        ]
        self.writers: dict[int, asyncio.StreamWriter] = {}
        self._server: asyncio.Server | None = None

    async def start(self) -> tuple[str, int]:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return "127.0.0.1", self._server.sockets[0].getsockname()[1]

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            hello = await link.recv(reader)
            server, position = hello["server"], hello["position"]
            welcome: dict[str, Any] = {
                "map": self.pmap.to_dict(),
                "optimizer": SPECS[0],
                "outer": SPECS[2],
                "combine": True,
                "step_each": False,
                "epoch": "life1",
                "start": 0,
                "base": link.encode_tensors(split(self.pmap, PARAMS)[server])
                if position == 0
                else None,
            }
            if self.headers is not None:
                welcome["headers"] = self.headers
            await link.send(writer, "welcome", **welcome)
            items = [to_dict(r) for r in self.records if r.position > position]
            if items:
                await link.send(writer, "records", items=items)
            self.writers[server] = writer
            while True:
                self.reports[server].put_nowait(await link.recv(reader))
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def send(self, records: list[Record]) -> None:
        self.records += records
        for writer in list(self.writers.values()):
            with contextlib.suppress(ConnectionError):
                await link.send(writer, "records", items=[to_dict(r) for r in records])

    async def report(self, server: int, kind: str) -> dict[str, Any]:
        """The next frame of ``kind`` pserver ``server`` reported."""
        while True:
            msg = await asyncio.wait_for(self.reports[server].get(), WAIT_S)
            if msg["t"] == kind:
                return msg

    def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for writer in self.writers.values():
            writer.close()


class Running:
    """One real pserver on this loop: its link to the head followed, its parts port served."""

    def __init__(self, head: tuple[str, int], server: int, directory: Path) -> None:
        self.ps = Pserver(head, server, directory, sync=True)
        self.site: FrameServer | None = None
        self.task: asyncio.Task[None] | None = None

    async def start(self) -> Running:
        self.site = await FrameServer.start(self.ps.serve_pushers, "127.0.0.1", 0)
        self.ps.parts = ("127.0.0.1", self.site.port)
        self.task = asyncio.create_task(self.ps.follow())
        return self

    @property
    def port(self) -> int:
        assert self.site is not None
        return self.site.port

    async def part(self, key: tuple[int, int]) -> dict[str, Any]:
        """Push ``key``'s part sent as a worker sends it; the answer."""
        raw = link.encode_tensors(split(PMAP, PUSHES[key])[self.ps.server])
        return await self.ask("part", worker=key[0], pid=key[1], tensors=raw)

    async def ask(self, kind: str, **fields: Any) -> dict[str, Any]:
        reader, writer = await asyncio.open_connection("127.0.0.1", self.port)
        try:
            await link.send(writer, kind, **fields)
            return await asyncio.wait_for(link.recv(reader), WAIT_S)
        finally:
            writer.close()

    async def stop(self) -> None:
        if self.task is not None:
            self.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.task
        if self.site is not None:
            self.site.close()
        if self.ps.node is not None:
            self.ps.node.close()


async def _answer_pulls(part: Mapping[str, np.ndarray], hash_: str | None) -> asyncio.Server:
    """A pserver played by the test: each ``pull`` answered with ``part`` and ``hash_``."""

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                ask = await link.recv(reader)
                for seg in pslink.slice_frame(ask["position"], ask["version"], part, hash_):
                    writer.write(seg)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    return await asyncio.start_server(serve, "127.0.0.1", 0)


async def test_with_headers_a_pserver_measures_each_part_it_holds_and_hashes_each_release(
    tmp_path: Path,
) -> None:
    head = Head(PMAP, headers=True)
    addr = await head.start()
    dirs = [tmp_path / f"slice{s}" for s in range(2)]
    pservers = [await Running(addr, s, dirs[s]).start() for s in range(2)]
    try:
        for key in PUSHES:
            for s, running in enumerate(pservers):
                reply = await running.part(key)
                assert reply["t"] == "held" and reply["new"] is True, reply
                have = await head.report(s, "have")
                assert (have["worker"], have["pid"]) == key
                sq, nbytes = _expected(s, key)
                assert _same(have["sq"], sq) and have["bytes"] == nbytes, (key, s, have)
        for s in range(2):
            part = split(PMAP, PUSHES[(1, 1)])[s]  # int8: its values squared times scale²
            by_hand = sum(
                float(np.sum(np.square(t.q.astype(np.float64)))) * float(t.scale) ** 2
                for t in part.values()
            )
            assert _expected(s, (1, 1))[0] == pytest.approx(by_hand, rel=1e-5)
            assert math.isinf(_expected(s, (0, 3))[0])
        assert math.isnan(_expected(0, (0, 2))[0])  # (the NaN is in slice 0's rows)
        again = await pservers[0].part((0, 1))  # a repeat: held, reported with the same measure
        assert again["new"] is False
        have = await head.report(0, "have")
        assert have["sq"] == _expected(0, (0, 1))[0] and have["bytes"] == _expected(0, (0, 1))[1]

        # restarted on their directories: every part read back and reported, measured the same
        for running in pservers:
            await running.stop()
        pservers = [await Running(addr, s, dirs[s]).start() for s in range(2)]
        for s in range(2):
            reported = {}
            for _ in PUSHES:
                have = await head.report(s, "have")
                reported[(have["worker"], have["pid"])] = (have["sq"], have["bytes"])
            assert sorted(reported) == sorted(PUSHES)
            for key, (sq, nbytes) in reported.items():
                want = _expected(s, key)
                assert _same(sq, want[0]) and nbytes == want[1], (key, s)

        # the head refuses the pushes that are not finite (drops): they are freed
        log = DecisionLog()
        await head.send(
            [
                log.apply(0, 1, "grad", 1.0),
                log.step(),
                log.apply(1, 1, "grad", 1.0),
                log.step(),
                log.drop(0, 2),
                log.drop(0, 3),
            ]
        )
        store = Store(PARAMS, make_optimizer(SPECS[0]))
        store.apply("grad", PUSHES[(0, 1)], 1.0)
        store.snapshot()
        store.apply("grad", PUSHES[(1, 1)], 1.0)
        end = store.snapshot()
        slices = [{k: np.asarray(v) for k, v in t.items()} for t in split(PMAP, end.tensors)]

        for s, running in enumerate(pservers):  # the raw answer: the hash of what it sent
            reply = await running.ask("pull", position=log.position, version=end.version)
            assert reply["t"] == "slice" and reply["hash"] == param_hash(slices[s])
            assert param_hash(pslink.read_slice(reply, PMAP.slice_shapes(s))) == reply["hash"]
            node = running.ps.node
            assert node is not None and node.slice.holding() == []  # drops freed theirs

        addrs = [["127.0.0.1", running.port] for running in pservers]
        puller = ReleasePuller({"map": PMAP.to_dict(), "addrs": addrs})
        try:
            for named in ((), tuple(param_hash(t) for t in slices)):  # the answer's, or named
                got = await puller.fetch(end.version, log.position, named, end.hash)
                assert got is not None
                tensors, size = got
                assert sorted(tensors) == sorted(SHAPES)
                assert all(tensors[k].tobytes() == end.tensors[k].tobytes() for k in SHAPES)
                assert size > 4 * sum(int(np.prod(s)) for s in SHAPES.values())
            wrong = (param_hash(slices[1]), param_hash(slices[0]))  # a named hash wins
            with pytest.raises(SliceMismatch, match="pserver 0's slice"):
                await puller.fetch(end.version, log.position, wrong, None)
            assert await puller.fetch(end.version - 1, log.position, (), None) is None  # gone
        finally:
            puller.close()

        # pserver 1 played by the test: its answer's hash right, wrong, or missing
        for hash_, ok in ((param_hash(slices[1]), True), ("0" * 16, False), (None, False)):
            fake = await _answer_pulls(slices[1], hash_)
            port = fake.sockets[0].getsockname()[1]
            mixed = [addrs[0], ["127.0.0.1", port]]
            puller = ReleasePuller({"map": PMAP.to_dict(), "addrs": mixed})
            try:
                if ok:
                    assert await puller.fetch(end.version, log.position, (), None) is not None
                else:
                    with pytest.raises(SliceMismatch, match="pserver 1's slice"):
                        await puller.fetch(end.version, log.position, (), None)
            finally:
                puller.close()
                fake.close()
    finally:
        for running in pservers:
            await running.stop()
        head.close()


@pytest.mark.parametrize("headers", [None, False])
async def test_without_headers_a_have_and_a_slice_are_what_they_were(
    tmp_path: Path, headers: bool | None
) -> None:
    head = Head(PMAP, headers=headers)
    addr = await head.start()
    pservers = [await Running(addr, s, tmp_path / f"slice{s}").start() for s in range(2)]
    try:
        for s, running in enumerate(pservers):
            reply = await running.part((0, 1))
            assert reply["t"] == "held" and reply["new"] is True
            assert await head.report(s, "have") == {"t": "have", "worker": 0, "pid": 1}
            node = running.ps.node
            assert node is not None and not node.setup.headers
        log = DecisionLog()
        await head.send([log.apply(0, 1, "grad", 1.0), log.step()])
        answers = []
        for s, running in enumerate(pservers):
            reply = await running.ask("pull", position=log.position, version=1)
            assert reply["t"] == "slice" and "hash" not in reply
            answers.append(pslink.read_slice(reply, PMAP.slice_shapes(s)))
        addrs = [["127.0.0.1", running.port] for running in pservers]
        puller = ReleasePuller({"map": PMAP.to_dict(), "addrs": addrs})
        try:  # named hashes (today's daemon) are checked; none named, none carried: refused
            named = tuple(param_hash(a) for a in answers)
            assert await puller.fetch(1, log.position, named, None) is not None
            with pytest.raises(SliceMismatch, match="carries no hash"):
                await puller.fetch(1, log.position, (), None)
        finally:
            puller.close()
    finally:
        for running in pservers:
            await running.stop()
        head.close()


def test_a_slice_frame_carries_a_hash_only_when_given() -> None:
    part = {k: np.asarray(v) for k, v in split(PMAP, PARAMS)[0].items()}
    plain = b"".join(bytes(s) for s in pslink.slice_frame(5, 2, part))
    named = b"".join(bytes(s) for s in pslink.slice_frame(5, 2, part, "ab" * 8))
    assert plain == pslink.pack(
        "slice",
        position=5,
        version=2,
        tensors={k: pslink.tensor_entry(v) for k, v in part.items()},
    )
    assert "hash" not in pslink.unpack(plain[4:])
    assert pslink.unpack(named[4:])["hash"] == "ab" * 8
