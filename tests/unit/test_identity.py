"""A worker's identity: ``welcome`` gives each worker a random secret; resuming its id (and its
clock, and its exactly-once push ids) needs that secret; without it a hello gets a new id. The
secrets survive a restart in the checkpoint."""

from __future__ import annotations

from typing import Any

import numpy as np
import optax

from hetd.core import Engine, EngineConfig
from hetd.core.ingest import decode_hello
from hetd.core.store import Store
from hetd.protocol import wire
from hetd.protocol.messages import JoinIn, PushIn, Welcome
from hetd.server import checkpoint
from policies import make_policy
from tests.conftest import FakeClock, FakePeer

SHAPES = {"dense/w": (3, 2), "dense/b": (2,)}


def make_engine() -> Engine:
    params = {k: np.zeros(s, np.float32) for k, s in SHAPES.items()}
    setup = {"model": {"spec": "mlp"}, "dataset": {"spec": "digits"}, "train": {}}
    return Engine(
        Store(params, optax.sgd(0.1)),
        make_policy("asp"),
        EngineConfig(profile_steps=0, welcome=setup),
        FakeClock(),
    )


def hello(resume: int | None = None, secret: Any = None) -> JoinIn:
    fields: dict[str, Any] = {"name": "w", "device": {}, "codecs": ["none"]}
    if resume is not None:
        fields["resume"] = {"worker_id": resume, "secret": secret}
    return decode_hello(wire.decode(wire.encode("hello", 1, **fields)))


def join(e: Engine, j: JoinIn) -> tuple[Welcome, FakePeer]:
    peer = FakePeer()
    e.join(j, peer)
    welcome = peer.replies[0]
    assert isinstance(welcome, Welcome)
    return welcome, peer


def grow_clock(e: Engine, wid: int, pushes: int) -> None:
    for i in range(pushes):
        tensors = {k: np.full(s, 0.1, np.float32) for k, s in SHAPES.items()}
        e.push(PushIn(wid, i + 1, e.store.version, "grad", tensors, 8, 1, 0.1, None, None, 1))


def test_each_welcome_carries_a_random_secret_on_the_wire() -> None:
    e = make_engine()
    a, _ = join(e, hello())
    b, _ = join(e, hello())
    assert a.secret and b.secret and a.secret != b.secret and len(a.secret) >= 32
    msg = wire.decode(a.encode())
    assert msg["secret"] == a.secret and msg["worker_id"] == a.worker_id


def test_resuming_a_departed_id_needs_its_secret() -> None:
    e = make_engine()
    w, _ = join(e, hello())
    grow_clock(e, w.worker_id, 4)
    e.leave(w.worker_id, "gone")
    for bad in (None, "", "guess", w.secret[:-1] + "x", 12345):
        thief, _ = join(e, hello(w.worker_id, bad))
        assert thief.worker_id != w.worker_id, bad  # a new worker, with a clock of its own
        assert e.members.facts[thief.worker_id].clock == 0 and thief.secret != w.secret
        e.leave(thief.worker_id, "done")
    assert w.worker_id in e.members.departed and e.members.departed[w.worker_id].clock == 4
    back, _ = join(e, hello(w.worker_id, w.secret))
    assert back.worker_id == w.worker_id and e.members.facts[w.worker_id].clock == 4
    assert back.secret == w.secret  # it keeps its secret


def test_an_active_id_is_taken_over_only_with_its_secret() -> None:
    """A worker reconnecting before the daemon saw its old connection die (a half-open socket)
    resumes with its secret: the old session leaves first. Without the secret: a new id."""
    e = make_engine()
    w, old_peer = join(e, hello())
    thief, _ = join(e, hello(w.worker_id, "guess"))
    assert thief.worker_id != w.worker_id and old_peer.closed is None
    back, new_peer = join(e, hello(w.worker_id, w.secret))
    assert back.worker_id == w.worker_id
    assert old_peer.closed is not None and new_peer.closed is None
    assert e.members.entries[w.worker_id].peer is new_peer
    # the old session's own leave, arriving late, does not end the new one
    e.leave(w.worker_id, "connection closed", peer=old_peer)
    assert w.worker_id in e.members.facts and new_peer.closed is None
    e.leave(w.worker_id, "connection closed", peer=new_peer)
    assert w.worker_id not in e.members.facts


def test_secrets_survive_a_checkpoint() -> None:
    e = make_engine()
    w, _ = join(e, hello())
    grow_clock(e, w.worker_id, 3)
    state = checkpoint.engine_state(e)
    assert state["workers"][str(w.worker_id)]["secret"] == w.secret
    fresh = make_engine()
    checkpoint.restore_engine(fresh, checkpoint.decode(checkpoint.encode(state)))
    thief, _ = join(fresh, hello(w.worker_id, None))
    assert thief.worker_id != w.worker_id
    back, _ = join(fresh, hello(w.worker_id, w.secret))
    assert back.worker_id == w.worker_id and fresh.members.facts[w.worker_id].clock == 3


def test_a_checkpoint_without_secrets_resumes_nobody() -> None:
    """Workers of a checkpoint written before secrets existed cannot prove who they are: they
    join as new workers (and get a secret)."""
    e = make_engine()
    w, _ = join(e, hello())
    state = checkpoint.engine_state(e)
    for saved in state["workers"].values():
        del saved["secret"]
    fresh = make_engine()
    checkpoint.restore_engine(fresh, state)
    again, _ = join(fresh, hello(w.worker_id, w.secret))
    assert again.worker_id != w.worker_id and again.secret
