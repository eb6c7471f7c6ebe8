"""A user's Task cuts its data again at every join and leave: one shard per worker that takes
``shard`` messages, in slot order, each told only when its part changed; a worker from before the
message keeps what its welcome said. The bundled models keep their shards fixed at the join."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import optax

from hetd.core import Engine, EngineConfig
from hetd.core.store import Store
from hetd.protocol.messages import JoinIn, ShardUpdate, Welcome
from policies import make_policy
from tests.conftest import FakeClock, FakePeer


def _engine(recut: bool) -> Engine:
    params = {"w": np.zeros((3,), np.float32)}
    config = EngineConfig(batch_size=8, profile_steps=0, recut_shards=recut)
    return Engine(Store(params, optax.sgd(1.0)), make_policy("asp"), config, FakeClock())


def _join(engine: Engine, name: str, reshard: bool = True) -> tuple[int, FakePeer]:
    peer = FakePeer()
    features = frozenset({"reshard"}) if reshard else frozenset()
    hello = JoinIn(id=1, name=name, device={}, codecs=("none",), features=features)
    return engine.join(hello, peer), peer


def _shards(peer: FakePeer) -> list[tuple[int, int]]:
    out: list[Any] = []
    for r in peer.replies:
        if isinstance(r, Welcome):
            out.append((r.shard, r.shards))
        elif isinstance(r, ShardUpdate):
            out.append((r.index, r.count))
    return out


def test_joins_and_leaves_cut_the_data_again() -> None:
    e = _engine(recut=True)
    _, pa = _join(e, "a")
    assert _shards(pa) == [(0, 1)]  # alone: the whole data set
    b, pb = _join(e, "b")
    assert _shards(pa) == [(0, 1), (0, 2)] and _shards(pb) == [(1, 2)]
    c, pc = _join(e, "c")
    assert _shards(pc) == [(2, 3)] and _shards(pb)[-1] == (1, 3)
    e.leave(b, "bye")  # the others close the gap: every example is some worker's again
    assert _shards(pa)[-1] == (0, 2) and _shards(pc)[-1] == (1, 2)
    before = len(pa.replies)
    e.leave(c, "bye")
    assert _shards(pa)[-1] == (0, 1) and len(pa.replies) == before + 1


def test_a_worker_without_the_feature_keeps_its_welcome_shard() -> None:
    e = _engine(recut=True)
    _, old = _join(e, "old", reshard=False)
    _, new = _join(e, "new")
    assert not [r for r in old.replies if isinstance(r, ShardUpdate)]
    assert _shards(new) == [(0, 1)]


def test_the_bundled_models_keep_fixed_shards() -> None:
    e = _engine(recut=False)
    _, pa = _join(e, "a")
    _, pb = _join(e, "b")
    assert _shards(pa) == [(0, 4)] and _shards(pb) == [(1, 4)]


def test_a_worker_reads_its_new_shard_from_the_next_step() -> None:
    import jax

    from hetd.protocol.plan import Plan
    from hetd.zoo.task import Bound, Shard, Task
    from workers.loop import Trainer

    seen: list[Shard] = []

    def data(shard: Shard) -> Any:
        seen.append(shard)
        while True:
            yield {"x": np.ones((4, 3), np.float32)}

    task = Task(
        lambda k: {"w": jax.numpy.zeros(3)},
        lambda p, b, k: jax.numpy.mean(b["x"] @ p["w"]),
        data,
        name="t",
    )
    bound = Bound(task)
    welcome = {
        "model": {"spec": "t.py:task", "task": {"spec": "t.py:task", **bound.describe()}},
        "dataset": {"spec": "task", "kwargs": {}, "seed": 0},
        "train": {"seed": 0, "micro_batch": 4, "inner_optimizer": "sgd:lr=0.1"},
        "shard": {"index": 0, "count": 1},
    }
    trainer = Trainer(welcome, jax.devices()[0], None, bound)
    params = {"w": np.zeros(3, np.float32)}
    trainer.step(params, Plan(batch_size=4))
    trainer.reshard(1, 2)
    trainer.step(params, Plan(batch_size=4))
    assert dataclasses.astuple(seen[-1])[:2] == (1, 2)
