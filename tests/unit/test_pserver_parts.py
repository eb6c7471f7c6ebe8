"""The head decides a push only once every pserver holds its part (:mod:`hetd.server.pserver_parts`,
the ``have`` reports on the pservers' link), and drops, as a drop in the log, one whose parts do
not all come in time. The engine and the link are real ones on loopback; the pservers' side is
this test, speaking the link's frames."""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np
import optax
import pytest

from hetd.core.engine import Engine
from hetd.core.entries import EngineConfig
from hetd.core.ingest import decode_hello
from hetd.core.store import Store
from hetd.protocol import wire
from hetd.protocol.messages import Ack, PushIn
from hetd.pserver import link
from hetd.pserver.log import DecisionLog, DropEntry
from hetd.pserver.partition import partition
from hetd.server.pserver_link import HeadLink, LinkSetup
from hetd.server.pserver_parts import PartsWait
from policies import make_policy
from tests.conftest import FakeClock, FakePeer, until

PARAMS = {"a/w": np.ones((4, 3), np.float32), "b/w": np.zeros(5, np.float32)}
Streams = tuple[asyncio.StreamReader, asyncio.StreamWriter]


@pytest.fixture
async def head() -> AsyncIterator[tuple[HeadLink, Engine]]:
    engine = Engine(
        Store(PARAMS, optax.sgd(0.1)),
        make_policy("asp", {}),
        EngineConfig(guard_factor=0.0, welcome={"model": {}}),
        FakeClock(),
        decisions=DecisionLog(),
    )
    pmap = partition({k: v.shape for k, v in PARAMS.items()}, 2, block_bytes=0)
    hl = HeadLink(engine, LinkSetup(pmap, "sgd:lr=0.1", PARAMS, part_timeout_s=0.5))
    await hl.start("127.0.0.1", 0)
    running = asyncio.create_task(engine.run())
    yield hl, engine
    running.cancel()
    await hl.close()


async def _pserver(hl: HeadLink, server: int, port: int) -> Streams:
    reader, writer = await asyncio.open_connection("127.0.0.1", hl.port)
    await link.send(writer, "hello", server=server, position=0, epoch="", parts=["127.0.0.1", port])
    assert (await asyncio.wait_for(link.recv(reader), 10))["t"] == "welcome"
    return reader, writer


def _push(engine: Engine, wid: int, pid: int) -> PushIn:
    grad = {k: np.full(v.shape, 0.5, np.float32) for k, v in PARAMS.items()}
    return PushIn(wid, pid, engine.store.version, "grad", grad, 8, 1, 1.0, None, None, 1)


async def test_a_push_is_decided_once_every_pserver_holds_its_part_and_dropped_if_not(
    head: tuple[HeadLink, Engine],
) -> None:
    hl, engine = head
    log = engine.store.decisions
    assert isinstance(log, DecisionLog)
    fields = {"name": "w", "device": {"platform": "cpu"}, "codecs": ["none"]}
    peer = FakePeer()
    wid = engine.join(decode_hello(wire.decode(wire.encode("hello", 1, **fields))), peer)

    _, w0 = await _pserver(hl, 0, 7001)
    assert not hl.ready.is_set() and "pservers" not in engine.config.welcome
    _, w1 = await _pserver(hl, 1, 7002)
    assert hl.ready.is_set()  # the welcome now names both and the map
    assert engine.config.welcome["pservers"] == {
        "map": hl.setup.pmap.to_dict(),
        "addrs": [["127.0.0.1", 7001], ["127.0.0.1", 7002]],
    }

    await link.send(w1, "have", worker=wid, pid=1)  # a report may come before its push
    hl.parts.hold(_push(engine, wid, 1))
    await asyncio.sleep(0.1)
    assert engine.store.version == 0 and hl.parts.waiting() == 1  # pserver 0's part is not in
    await link.send(w0, "have", worker=wid, pid=1)
    await until(lambda: engine.store.version == 1, "push 1 applied")

    hl.parts.hold(_push(engine, wid, 2))  # only pserver 0 ever holds push 2's part
    hl.parts.hold(_push(engine, wid, 3))  # both hold 3's, which waits behind 2 (id order)
    for w in (w0, w1):
        await link.send(w, "have", worker=wid, pid=3)
    await link.send(w0, "have", worker=wid, pid=2)
    await asyncio.sleep(0.1)
    assert engine.store.version == 1 and hl.parts.waiting() == 2
    await until(lambda: engine.store.version == 2, "push 2 dropped past the timeout, 3 applied")
    acks = {r.id: r.status for r in peer.replies if isinstance(r, Ack)}
    assert acks == {1: "applied", 2: "dropped", 3: "applied"}
    assert hl.parts.lost == 1 and hl.parts.decided == 2 and hl.parts.waiting() == 0
    drops = [r.entry for r in log.since(0) if isinstance(r.entry, DropEntry)]
    assert [(d.worker, d.pid) for d in drops] == [(wid, 2)]  # a pserver frees its part

    hl.parts.hold(_push(engine, wid, 2))  # sent again: at once to the engine, a duplicate

    def answers() -> list[str]:
        return [r.status for r in peer.replies if isinstance(r, Ack)]

    await until(lambda: len(answers()) == 4, "push 2 answered again")
    assert answers()[-1] == "duplicate" and engine.store.version == 2
    for w in (w0, w1):
        w.close()


def test_parts_wait_keeps_each_workers_order_and_forgets_reports_it_passed() -> None:
    now = [0.0]
    out: list[tuple[str, int, int]] = []
    wait = PartsWait(
        3,
        lambda p: out.append(("decided", p.worker, p.id)),
        lambda p: out.append(("lost", p.worker, p.id)),
        timeout_s=5.0,
        clock=lambda: now[0],
    )

    def push(worker: int, pid: int) -> PushIn:
        return PushIn(worker, pid, 0, "grad", {}, 1, 1, 1.0, None, None, 1)

    for pid in (1, 2):
        wait.hold(push(7, pid))
    wait.hold(push(8, 1))
    for server in range(3):
        wait.have(server, 7, 2)
        wait.have(server, 8, 1)
    assert out == [("decided", 8, 1)]  # 7's push 2 waits behind its push 1
    wait.have(0, 7, 1)
    wait.have(0, 7, 1)  # a report sent twice counts once
    wait.have(5, 7, 1)  # not a pserver of this map: ignored
    wait.have(1, 7, 1)
    assert out == [("decided", 8, 1)]
    now[0] = 5.0
    wait.expire()
    assert out == [("decided", 8, 1), ("lost", 7, 1), ("decided", 7, 2)]
    wait.have(2, 7, 1)  # a late report of a push passed by: forgotten
    wait.hold(push(7, 3))
    assert wait.waiting() == 1 and wait.lost == 1 and wait.decided == 2
    with pytest.raises(ValueError, match="at least one pserver"):
        PartsWait(0, print, print)


@pytest.mark.parametrize("codec", ["int8", "none", "topk:k=0.25"])
def test_a_workers_parts_are_the_daemons_reading_of_its_push_cut_by_the_map(codec: str) -> None:
    """What a worker sends each pserver is what the daemon reads from the same push frame
    (:func:`hetd.core.ingest.decode_push`, int8 kept as int8), cut by the map, bit for bit,
    row blocks included."""
    from hetd.codecs import registry as codecs
    from hetd.core.ingest import decode_push
    from hetd.protocol.frames import Push
    from hetd.pserver.partition import split
    from workers.parts import PartsSender

    rng = np.random.default_rng(3)
    shapes = {"a/w": (64, 16), "b/w": (16,), "c/s": ()}
    update = {k: rng.normal(size=s).astype(np.float32) for k, s in shapes.items()}
    pmap = partition(shapes, 2, block_bytes=1024)  # a/w in row blocks over both pservers
    assert any(not p.whole for p in pmap.parts)
    enc = codecs.from_spec(codec)
    tensors = {k: enc.encode(v, np.random.default_rng(0)) for k, v in update.items()}
    frame = Push(5, base=0, kind="grad", tensors=tensors, samples=8, steps=1, compute_s=0.1)
    data = frame.encode()

    sender = PartsSender({"map": pmap.to_dict(), "addrs": [["127.0.0.1", 1], ["127.0.0.1", 2]]})
    push, frames = sender.frames(9, data)
    head = decode_push(pmap.shapes, 9, wire.decode(data), len(data), fused=True)
    expected = split(pmap, head.tensors)
    assert push.id == 5 and len(frames) == 2
    for server, raw in enumerate(frames):
        msg = link.unpack(b"".join(raw)[4:])
        assert (msg["t"], msg["worker"], msg["pid"]) == ("part", 9, 5)
        got = link.decode_tensors(msg["tensors"], pmap.slice_shapes(server))
        assert set(got) == set(expected[server])
        for key, value in expected[server].items():
            if codec == "int8":  # the daemon's view: int8 values and their scale
                assert got[key].q.tobytes() == np.asarray(value.q).tobytes()  # type: ignore[union-attr]
                assert got[key].scale == value.scale  # type: ignore[union-attr]
            else:
                assert np.asarray(got[key]).tobytes() == np.asarray(value).tobytes()


@pytest.mark.slow  # a daemon that probes its optimizer for the cut (seconds on a shared machine)
async def test_the_daemon_welcomes_workers_once_its_pservers_said_where_they_take_parts(
    tmp_path: Path,
) -> None:
    """A real daemon with two pservers (the test speaks for them): a worker that does not name the
    ``pservers`` feature (an older hetd-worker, whose pushes would never have parts) is refused
    with the reason; one that does is welcomed once both pservers said hello, with the map and
    their addresses."""
    import aiohttp

    from hetd import config as config_mod
    from hetd.server.daemon import Daemon
    from tests.conftest import WORKER_AUTH, make_config, recv_type

    cfg = make_config("asp", optimizer="momentum", lr=0.05)
    cfg = config_mod.replace(cfg, "server", admin_port=-1)
    cfg = config_mod.replace(cfg, "store", dir=str(tmp_path / "state"), interval_s=0.0)
    cfg = config_mod.replace(cfg, "pservers", log=True, servers=2, port=0)
    daemon = Daemon(cfg)
    port = await daemon.start()
    url = f"ws://127.0.0.1:{port}/v1/ws"
    fields = {"name": "raw", "device": {"platform": "cpu"}, "codecs": ["none"]}
    try:
        hl = daemon.pservers
        assert hl is not None
        async with aiohttp.ClientSession() as http:
            old = await http.ws_connect(url, headers=WORKER_AUTH)
            await old.send_bytes(wire.encode("hello", 1, **fields))
            refusal = await recv_type(old, "error")
            assert refusal["code"] == "unsupported" and "pservers" in refusal["message"]
            await old.close()

            ws = await http.ws_connect(url, headers=WORKER_AUTH, max_msg_size=0)
            await ws.send_bytes(wire.encode("hello", 1, features=["pservers"], **fields))
            with pytest.raises(TimeoutError):  # no welcome before the pservers are known
                await ws.receive(timeout=0.5)
            pservers = [await _pserver(hl, s, 7100 + s) for s in range(2)]
            welcome = await recv_type(ws, "welcome")
            assert welcome["pservers"] == {
                "map": hl.setup.pmap.to_dict(),
                "addrs": [["127.0.0.1", 7100], ["127.0.0.1", 7101]],
            }
            await ws.close()
            for _, writer in pservers:
                writer.close()
    finally:
        await daemon.stop(final_checkpoint=False)


def test_hetd_status_shows_the_pushes_held_for_their_parts() -> None:
    from hetd.cli.admin_text import status_text
    from tests.unit.test_admin_text import status

    body = status("asp")
    body["decisions"] = {
        "position": 12,
        "version": 10,
        "first": 1,
        "saved": [0, 0],
        "connected": [0, 1],
        "parts": {"decided": 10, "dropped": 1, "waiting": 2},
    }
    rows = {
        k.strip(): v.strip()
        for k, v in (line.split("  ", 1) for line in status_text(body).splitlines() if "  " in line)
    }
    assert rows["pushes' parts"] == "10 decided with every part, 1 dropped without, 2 waiting"


# --- a head that takes push headers only ([pservers] headers) ----------------------------------


def _header(worker: int, pid: int, transfer_s: float | None = 0.25) -> PushIn:
    """A push as :func:`hetd.core.ingest.decode_header` gives it: no tensors, no norm, the
    header frame's 300 bytes."""
    return PushIn(worker, pid, 0, "grad", {}, 8, 1, 1.0, None, None, 300, transfer_s=transfer_s)


def _headers_wait(servers: int) -> tuple[PartsWait, list[PushIn], list[PushIn], list[float]]:
    now = [10.0]
    decided: list[PushIn] = []
    lost: list[PushIn] = []
    wait = PartsWait(
        servers, decided.append, lost.append, timeout_s=30.0, clock=lambda: now[0], headers=True
    )
    return wait, decided, lost, now


def test_a_headers_push_goes_on_once_every_part_is_reported_with_their_norm_and_bytes() -> None:
    wait, decided, lost, now = _headers_wait(3)
    wait.hold(_header(4, 1))
    wait.have(0, 4, 1, sq=4.0, nbytes=1000)
    now[0] = 11.5
    wait.have(1, 4, 1, sq=9.0, nbytes=2000)
    assert decided == [] and wait.waiting() == 1  # pserver 2 has not said
    now[0] = 12.0
    wait.have(2, 4, 1, sq=12.0, nbytes=500)
    assert len(decided) == 1 and lost == [] and wait.waiting() == 0
    p = decided[0]
    assert (p.worker, p.id, p.tensors) == (4, 1, {})
    assert p.norm == pytest.approx(5.0)  # sqrt(4 + 9 + 12)
    assert p.nbytes == 300 + 1000 + 2000 + 500  # the header's and the parts'
    assert p.transfer_s == pytest.approx(0.25 + 2.0)  # up to its last part's report

    # reports before the push (the parts travel beside it): it goes on at once, no wait added
    for server in range(3):
        wait.have(server, 4, 2, sq=1.0, nbytes=10)
    now[0] = 13.0
    wait.hold(_header(4, 2, transfer_s=0.5))
    assert len(decided) == 2
    assert decided[1].norm == pytest.approx(math.sqrt(3.0)) and decided[1].nbytes == 330
    assert decided[1].transfer_s == pytest.approx(0.5)

    wait.hold(_header(4, 3, transfer_s=None))  # the worker's clock not trusted: none to add to
    now[0] = 14.0
    for server in range(3):
        wait.have(server, 4, 3, sq=0.0, nbytes=0)
    assert len(decided) == 3 and decided[2].transfer_s is None and decided[2].norm == 0.0
    assert wait.decided == 3 and wait.lost == 0


def test_a_part_reported_twice_by_one_pserver_counts_once() -> None:
    """A pserver that reconnects reports each part it holds again: neither its count towards
    every pserver's nor its square and bytes are taken twice."""
    wait, decided, _, _ = _headers_wait(2)
    wait.hold(_header(1, 1))
    wait.have(0, 1, 1, sq=16.0, nbytes=100)
    wait.have(0, 1, 1, sq=16.0, nbytes=100)  # again, after a reconnect
    assert decided == []  # pserver 1's is still missing
    wait.have(1, 1, 1, sq=9.0, nbytes=50)
    assert len(decided) == 1
    assert decided[0].norm == pytest.approx(5.0) and decided[0].nbytes == 300 + 150


@pytest.mark.parametrize(
    "reports",
    [
        [(1.0, 10), (math.nan, 10)],  # a part holds NaN
        [(math.inf, 10), (1.0, 10)],  # a part holds Inf, or its squares overflow
        [(math.inf, 10), (math.nan, 10)],
        [(1.0, 10), (None, None)],  # a pserver that did not say
    ],
)
def test_a_part_not_finite_or_not_measured_gives_the_push_a_nan_norm(
    reports: list[tuple[float | None, int | None]],
) -> None:
    wait, decided, _, _ = _headers_wait(2)
    wait.hold(_header(3, 1))
    for server, (sq, nbytes) in enumerate(reports):
        wait.have(server, 3, 1, sq=sq, nbytes=nbytes)
    assert len(decided) == 1
    norm = decided[0].norm
    assert norm is not None and math.isnan(norm)
    assert decided[0].nbytes == 300 + sum(b or 0 for _, b in reports)


def test_without_headers_a_push_goes_on_as_it_came() -> None:
    decided: list[PushIn] = []
    wait = PartsWait(2, decided.append, print, clock=lambda: 5.0)
    grad = {k: np.full(v.shape, 0.5, np.float32) for k, v in PARAMS.items()}
    push = PushIn(1, 1, 0, "grad", grad, 8, 1, 1.0, None, None, 900, transfer_s=0.1, norm=2.0)
    wait.hold(push)
    wait.have(0, 1, 1, sq=100.0, nbytes=7)  # (measures a pserver sends regardless: unused)
    wait.have(1, 1, 1)
    assert len(decided) == 1 and decided[0] is push


def test_a_head_on_headers_refuses_a_push_whose_part_is_not_finite_with_its_guard_off() -> None:
    """The engine of a head without parameters (guard off) behind the wait: a push whose part
    reported a NaN square is refused and logged as a drop (its pservers free their parts); the
    next one, finite, is applied."""
    from hetd.core.assemble import EngineSpec, assemble
    from hetd.core.ledger import LedgerStore
    from hetd.protocol.messages import ErrorReply
    from hetd.pserver.log import ApplyEntry, StepEntry
    from hetd.server.pserver_pulls import Pointers

    spec = EngineSpec(
        PARAMS, "asp", settings=EngineConfig(guard_factor=0.0), store_type=LedgerStore
    )
    log = DecisionLog()
    engine = assemble(spec).engine(FakeClock(), decisions=log)
    assert not engine.intake.guard.on
    pmap = partition({k: v.shape for k, v in PARAMS.items()}, 2, block_bytes=0)
    engine.publisher.pointer = Pointers(pmap, log, hashes=False)  # every release a pull
    fields = {"name": "w", "device": {"platform": "cpu"}, "codecs": ["none"]}
    hello = wire.encode("hello", 1, features=["pulls", "pservers", "headers"], **fields)
    peer = FakePeer()
    wid = engine.join(decode_hello(wire.decode(hello)), peer)
    wait = PartsWait(2, engine.push, engine.push, clock=lambda: 0.0, headers=True)
    wait.hold(_header(wid, 1))
    wait.have(0, wid, 1, sq=1.0, nbytes=10)
    wait.have(1, wid, 1, sq=math.nan, nbytes=10)
    reply = peer.replies[-1]
    assert isinstance(reply, ErrorReply) and reply.id == 1 and reply.code == "out_of_range"
    assert "NaN" in reply.text and engine.store.version == 0
    wait.hold(_header(wid, 2))
    wait.have(0, wid, 2, sq=1.0, nbytes=10)
    wait.have(1, wid, 2, sq=3.0, nbytes=10)
    assert isinstance(peer.replies[-1], Ack) and peer.replies[-1].status == "applied"
    engine.store.flush()
    entries = [r.entry for r in log.since(0)]
    assert entries == [DropEntry(wid, 1), ApplyEntry(wid, 2, "grad", 1.0), StepEntry(False)]
    assert engine.store.version == log.version == 1


def _push_frame(tensors: dict[str, object]) -> bytes:
    from hetd.protocol.frames import Push

    frame = Push(6, base=3, kind="grad", tensors=tensors, samples=8, steps=1, compute_s=0.5)
    return frame.encode()


def test_a_push_header_is_a_push_without_tensors_or_norm() -> None:
    from hetd.core.ingest import decode_header

    data = _push_frame({})
    p = decode_header(2, wire.decode(data), len(data))
    assert (p.worker, p.id, p.base, p.kind, p.samples, p.steps) == (2, 6, 3, "grad", 8, 1)
    assert p.tensors == {} and p.norm is None and p.nbytes == len(data)


def test_a_push_header_that_carries_tensors_is_refused() -> None:
    from hetd.codecs import registry as codecs
    from hetd.core.ingest import decode_header

    t = codecs.from_spec("none").encode(np.zeros(5, np.float32), np.random.default_rng(0))
    data = _push_frame({"b/w": t})
    with pytest.raises(wire.ProtocolError, match="push headers only") as err:
        decode_header(2, wire.decode(data), len(data))
    assert err.value.code == "malformed"


def test_hetd_status_says_when_the_head_takes_headers_only() -> None:
    from hetd.cli.admin_text import status_text
    from tests.unit.test_admin_text import status

    body = status("asp")
    body["decisions"] = {"position": 3, "version": 3, "first": 1, "head": "headers"}
    assert "takes push headers only; the pservers hold the parameters" in status_text(body)
    body["decisions"]["head"] = "whole"
    assert "takes push headers only" not in status_text(body)
