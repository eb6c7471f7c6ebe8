"""Exactly-once pushes: the engine remembers the last request id it answered per worker, across
reconnects and checkpoints; a repeated or older id is acked ``duplicate`` and never applied. The
worker keeps its unanswered pushes and sends them again after a reconnect, so an update the daemon
did not see is not lost, and one it did see is not applied twice."""

from __future__ import annotations

from typing import Any

import aiohttp
import numpy as np
import optax
import pytest

from hetd.codecs import registry as codecs
from hetd.core import Engine, EngineConfig
from hetd.core.ingest import decode_hello
from hetd.core.store import Store
from hetd.protocol import wire
from hetd.protocol.messages import Ack, PushIn, Welcome
from hetd.server import checkpoint
from policies import make_policy
from tests.conftest import WORKER_AUTH as AUTH
from tests.conftest import FakeClock, FakePeer
from tests.conftest import raw_hello as hello
from tests.conftest import recv_type as recv

pytestmark = pytest.mark.slow  # a real daemon on loopback (and real worker processes)

SHAPES = {"dense/w": (3, 2), "dense/b": (2,)}


# --- the engine ------------------------------------------------------------------------------------


def make_engine(policy: str = "asp") -> Engine:
    params = {k: np.zeros(s, np.float32) for k, s in SHAPES.items()}
    return Engine(
        Store(params, optax.sgd(0.1)),
        make_policy(policy),
        EngineConfig(profile_steps=0),
        FakeClock(),
    )


def join(e: Engine, peer: FakePeer, resume: Welcome | None = None) -> Welcome:
    fields: dict[str, Any] = {"name": "w", "device": {}, "codecs": ["none"]}
    if resume is not None:
        fields["resume"] = {
            "worker_id": resume.worker_id,
            "secret": getattr(resume, "secret", None),
        }
    e.join(decode_hello(wire.decode(wire.encode("hello", 1, **fields))), peer)
    welcome = next(r for r in peer.replies if isinstance(r, Welcome))
    return welcome


def push(e: Engine, wid: int, request_id: int) -> PushIn:
    tensors = {k: np.full(s, 0.5, np.float32) for k, s in SHAPES.items()}
    p = PushIn(wid, request_id, e.store.version, "grad", tensors, 8, 1, 0.1, None, None, 100)
    e.push(p)
    return p


def acks(peer: FakePeer) -> list[tuple[int, str]]:
    return [(r.id, r.status) for r in peer.replies if isinstance(r, Ack)]


def test_the_same_push_three_times_then_after_a_resume_is_applied_once() -> None:
    e = make_engine()
    peer = FakePeer()
    w = join(e, peer)
    for _ in range(3):
        push(e, w.worker_id, 5)
    assert acks(peer) == [(5, "applied"), (5, "duplicate"), (5, "duplicate")]
    assert e.store.version == 1 and e.members.facts[w.worker_id].clock == 1
    st = e.members.stats[w.worker_id]
    assert (st.pushes, st.applied, st.duplicates) == (1, 1, 2)
    e.leave(w.worker_id, "connection lost")
    again = FakePeer()
    assert join(e, again, resume=w).worker_id == w.worker_id
    push(e, w.worker_id, 5)  # the 4th copy, after the reconnect
    push(e, w.worker_id, 4)  # an older id
    push(e, w.worker_id, 6)  # the next one
    assert acks(again) == [(5, "duplicate"), (4, "duplicate"), (6, "applied")]
    assert e.store.version == 2


def test_the_last_push_id_survives_a_checkpoint() -> None:
    e = make_engine("bsp")
    peer = FakePeer()
    w = join(e, peer)
    join(e, FakePeer())  # a second worker: the first one's push waits in the round's buffer
    push(e, w.worker_id, 9)
    assert acks(peer) == [(9, "buffered")]
    saved = checkpoint.decode(checkpoint.encode(checkpoint.engine_state(e)))
    fresh = make_engine("bsp")
    checkpoint.restore_engine(fresh, saved)
    again = FakePeer()
    assert join(fresh, again, resume=w).worker_id == w.worker_id
    push(fresh, w.worker_id, 9)
    assert acks(again) == [(9, "duplicate")]
    assert fresh.state().workers[w.worker_id].last_push == 9


def test_a_new_worker_starts_its_own_ids() -> None:
    e = make_engine()
    a, b = FakePeer(), FakePeer()
    wa, wb = join(e, a), join(e, b)
    push(e, wa.worker_id, 1)
    push(e, wb.worker_id, 1)  # ids are per worker
    assert acks(a) == [(1, "applied")] and acks(b) == [(1, "applied")]


# --- a real daemon ---------------------------------------------------------------------------------


async def test_a_repeated_push_frame_is_applied_once_across_a_reconnect(cluster) -> None:  # type: ignore[no-untyped-def]
    c = await cluster("asp")
    async with aiohttp.ClientSession() as http:
        ws = await http.ws_connect(c.url + "/v1/ws", headers=AUTH)
        await ws.send_bytes(hello())
        welcome = await recv(ws, "welcome")
        wid = welcome["worker_id"]
        params = codecs.decode_tree((await recv(ws, "params"))["tensors"])
        grads = {k: np.full(v.shape, 1e-3, np.float32) for k, v in params.items()}
        tensors = codecs.encode_tree(grads, codecs.get_codec("none"))
        version = c.engine.store.version
        frame = wire.encode(
            "push",
            5,
            base=version,
            kind="grad",
            tensors=tensors,
            samples=8,
            steps=1,
            compute_s=0.01,
        )
        for _ in range(3):
            await ws.send_bytes(frame)
        statuses = [(await recv(ws, "ack"))["status"] for _ in range(3)]
        assert statuses == ["applied", "duplicate", "duplicate"]
        assert c.engine.store.version == version + 1
        await ws.close()
        await c.wait_for(lambda: wid not in c.engine.members.facts, 10, "the session to end")

        ws = await http.ws_connect(c.url + "/v1/ws", headers=AUTH)
        await ws.send_bytes(hello({"worker_id": wid, "secret": welcome.get("secret")}))
        assert (await recv(ws, "welcome"))["worker_id"] == wid
        await ws.send_bytes(frame)
        ack = await recv(ws, "ack")
        assert (ack.id, ack["status"]) == (5, "duplicate")
        assert c.engine.store.version == version + 1
        assert c.engine.members.stats[wid].duplicates == 1  # counters restart with the session
        await ws.close()


async def test_a_real_worker_sends_unanswered_pushes_again_and_none_is_applied_twice(  # type: ignore[no-untyped-def]
    cluster, monkeypatch
) -> None:
    """Fault injection on a real worker process: (1) a push is applied but its ack is lost with
    the connection; (2) a push is lost with the connection before the engine sees it. The worker
    reconnects as itself and sends both again: the first is acked duplicate, the second applied."""
    from hetd.server import sessions

    c = await cluster("asp")
    answered: dict[int, list[str]] = {}  # push id -> the ack statuses the engine sent, in order
    lose_ack: set[int] = set()  # pushes whose ack is lost with the connection
    real_send = sessions.Outbox.send

    def send(self: sessions.Outbox, reply: Any) -> None:
        if isinstance(reply, Ack):
            answered.setdefault(reply.id, []).append(reply.status)
            if reply.id in lose_ack:
                lose_ack.discard(reply.id)
                self.close("injected: the connection drops before the ack")
                return
        real_send(self, reply)

    monkeypatch.setattr(sessions.Outbox, "send", send)
    await c.spawn(1.0, 0.01, "--max-retries", "20")
    await c.wait_for(lambda: c.engine.store.version >= 5, 60, "5 updates")
    (wid,) = c.engine.members.facts
    first = max(answered) + 2  # a push still to come
    lose_ack.add(first)
    await c.wait_for(lambda: answered.get(first) == ["applied", "duplicate"], 60, "the resend")
    assert wid in c.engine.members.facts  # the same worker, resumed

    lost: list[int] = []
    real_push = c.engine.push

    def push(p: PushIn) -> None:
        if not lost and p.id > max(answered):
            lost.append(p.id)  # the engine never sees it: the connection drops with it
            peer = c.engine.members.entries[p.worker].peer
            assert peer is not None
            peer.close("injected: the connection drops with a push")
            return
        real_push(p)

    monkeypatch.setattr(c.engine, "push", push)
    await c.wait_for(lambda: bool(lost) and answered.get(lost[0]) == ["applied"], 60, "push again")
    version = c.engine.store.version
    await c.wait_for(lambda: c.engine.store.version >= version + 5, 60, "5 more updates")
    assert set(c.engine.members.facts) == {wid}
    assert all(p.returncode is None for p in c.procs)
    # every push id was answered once (a duplicate aside) and ids only grew, across reconnects
    for pid, statuses in answered.items():
        assert [s for s in statuses if s != "duplicate"] == ["applied"], (pid, statuses)
    assert sorted(answered) == list(answered)
    assert c.engine.applier.updates_applied == c.engine.store.version == len(answered)
