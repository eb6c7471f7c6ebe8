"""The ``dpmp`` policy on a real Engine and Store (a block-structured MLP's shapes) under a fake
clock, with a replica runner that forms and dissolves replicas in the engine as the daemon's
driver does: two capable workers and a memory-poor one; the controller pairs the poor worker with
a helper as a 2-stage replica, a round is one push of the replica and one of the data-parallel
worker, and losing the poor stage goes back to data parallel."""

from __future__ import annotations

import numpy as np
import optax
import pytest

from hetd.core import Engine, EngineConfig
from hetd.core.ingest import decode_hello
from hetd.core.store import Store
from hetd.protocol import wire
from hetd.protocol.messages import PushIn
from policies import make_policy
from policies.dpmp.policy import PROBE
from policies.types import ReplicaShape
from tests.conftest import FakeClock, FakePeer

# an MLP 64-64-64-64-10 as four blocks (what hetd.zoo.blocks names them)
SHAPES = {
    **{f"b{j:02d}/Dense_0/kernel": (64, 64) for j in range(3)},
    **{f"b{j:02d}/Dense_0/bias": (64,) for j in range(3)},
    "b03/Dense_0/kernel": (64, 10),
    "b03/Dense_0/bias": (10,),
}
POOR = 100_000  # bytes: cannot hold the model with its gradients, can hold half of it


def _dpmp_engine() -> tuple[Engine, FakeClock]:
    """A dpmp engine (period 1) on the block MLP's shapes, under a fake clock."""
    params = {k: np.zeros(s, np.float32) for k, s in SHAPES.items()}
    policy = make_policy("dpmp", {"period": 1, "keep": 1.0})
    clock = FakeClock()
    config = EngineConfig(batch_size=32, global_batch=256, profile_steps=0)
    return Engine(Store(params, optax.sgd(0.1)), policy, config, clock), clock


def _engine_with_a_replica_runner() -> tuple[Engine, FakeClock, list[tuple[ReplicaShape, ...]]]:
    """A dpmp engine whose regroups form and dissolve replicas as the daemon's driver does; the
    list records every regroup asked for."""
    engine, clock = _dpmp_engine()
    formed: list[tuple[ReplicaShape, ...]] = []

    def regroup(shapes: tuple[ReplicaShape, ...]) -> None:
        formed.append(shapes)
        for head in list(engine.pipelines.view):
            if not shapes or shapes[0].members != engine.pipelines.view[head]:
                engine.dissolve_replica(head, "regrouped")
        if shapes and shapes[0].members[0] not in engine.pipelines.view:
            engine.form_replica(shapes[0].members)

    engine.pipelines.regroup_to = regroup
    return engine, clock, formed


def test_dpmp_pairs_the_memory_poor_worker_and_runs_rounds_over_replicas() -> None:
    engine, clock, formed = _engine_with_a_replica_runner()
    assert len(engine.pipelines.blocks) == 4
    steps: list[int] = []
    engine.pipelines.run_step = steps.append
    ids = {}
    for name, mem in (("a", 8 << 30), ("b", 8 << 30), ("poor", POOR)):
        hello = wire.encode(
            "hello", 1, name=name, device={"free_memory": mem}, codecs=["none"], features=["stages"]
        )
        ids[name] = engine.join(decode_hello(wire.decode(hello)), FakePeer())
    pid = 0

    def push(wid: int, samples: int = 32) -> None:
        nonlocal pid
        pid += 1
        clock.t += 0.1
        grads = {k: np.full(s, 1e-3, np.float32) for k, s in SHAPES.items()}
        engine.push(
            PushIn(wid, pid, engine.store.version, "grad", grads, samples, 1, 0.1, None, None, 1)
        )

    # round 1 began with the first worker alone; its push ends it and the next is planned
    push(ids["a"])
    assert formed, "no regroup"
    (shape,) = formed[-1]
    assert ids["poor"] in shape.members and len(shape.members) == 2
    head = shape.members[0]
    other = next(w for w in (ids["a"], ids["b"]) if w not in shape.members)
    assert engine.pipelines.view == {head: shape.members}
    assert set(engine.members.facts) == {head, other}  # the poor worker's stage is not in the view
    state = engine.host.state
    # the replica's first step (its stages compile) runs outside the round: no round waits on it
    assert set(state.working) == {other} and state.warming == (head,)
    assert engine.members.plans[other].batch_size == 256  # the round's whole batch meanwhile
    version = engine.store.version
    push(head, shape.micro * shape.micro_batches)  # its first step: buffered, ends nothing
    assert engine.store.version == version
    push(other, engine.members.plans[other].batch_size)
    version += 1
    assert engine.store.version == version
    assert set(engine.host.state.working) == {head, other} and engine.host.state.warming == ()
    assert engine.members.plans[other].batch_size < 256  # the replica takes its share now
    for _ in range(3):  # rounds: one push of the replica, one of the data-parallel worker
        push(head, shape.micro * shape.micro_batches)
        assert engine.store.version == version  # the round waits for the other
        push(other, engine.members.plans[other].batch_size)
        version += 1
        assert engine.store.version == version
    assert steps == [head] * 4  # each round released the replica's next step once
    assert engine.host.policy.describe()["name"] == "dpmp"

    asked = len(formed)
    engine.leave(ids["poor"], "killed")  # the stage dies: data parallel again, no stall
    assert engine.pipelines.view == {}
    push(head)  # the replica's round ends without the replica's step; the next one is planned
    push(other)
    assert engine.store.version > version
    assert all(ids["poor"] not in s.members for shapes in formed[asked:] for s in shapes)
    assert engine.host.state.pipelines == ()
    assert set(engine.host.state.working) == {ids["a"], ids["b"]}


def test_a_worker_that_runs_no_stages_is_never_put_in_a_replica() -> None:
    engine, clock = _dpmp_engine()
    formed: list[tuple[ReplicaShape, ...]] = []
    engine.pipelines.regroup_to = formed.append
    ids = {}
    for name, mem in (("a", 8 << 30), ("b", 8 << 30), ("poor", POOR)):
        # an older worker: its hello names no features
        hello = wire.encode("hello", 1, name=name, device={"free_memory": mem}, codecs=["none"])
        ids[name] = engine.join(decode_hello(wire.decode(hello)), FakePeer())
    grads = {k: np.full(s, 1e-3, np.float32) for k, s in SHAPES.items()}
    for pid in range(1, 4):
        for w in (ids["a"], ids["b"]):
            clock.t += 0.1
            base = engine.store.version
            engine.push(PushIn(w, pid, base, "grad", grads, 32, 1, 0.1, None, None, 1))
    assert all(s == () for s in formed)  # no replica asked for
    assert set(engine.host.state.working) == {ids["a"], ids["b"]}  # the poor one idles
    assert engine.store.version >= 2
    with pytest.raises(ValueError, match="stages"):
        engine.form_replica([ids["a"], ids["poor"]])


def test_a_replica_its_driver_gave_up_on_neither_stalls_the_round_nor_runs_as_dp() -> None:
    """The driver dissolves a replica on its own (a step timed out): the policy's round must not
    wait for the replica's push, nor release its members as data-parallel workers when they
    ask for parameters; the next round forms the replica again."""
    engine, clock, formed = _engine_with_a_replica_runner()
    engine.pipelines.run_step = lambda head: None
    ids, peers = {}, {}
    for name, mem in (("a", 8 << 30), ("b", 8 << 30), ("poor", POOR)):
        hello = wire.encode(
            "hello", 1, name=name, device={"free_memory": mem}, codecs=["none"], features=["stages"]
        )
        peer = FakePeer()
        ids[name] = engine.join(decode_hello(wire.decode(hello)), peer)
        peers[ids[name]] = peer
    grads = {k: np.full(s, 1e-3, np.float32) for k, s in SHAPES.items()}
    pid = 0

    def push(wid: int) -> None:
        nonlocal pid
        pid += 1
        clock.t += 0.1
        base = engine.store.version
        engine.push(PushIn(wid, pid, base, "grad", grads, 32, 1, 0.1, None, None, 1))

    push(ids["a"])  # round 1 ends; round 2 pairs the poor worker
    (shape,) = formed[-1]
    members = shape.members
    other = next(w for w in (ids["a"], ids["b"]) if w not in members)
    assert engine.pipelines.view == {members[0]: members}
    engine.dissolve_replica(members[0], "step 1 was not complete")  # the driver gave up
    sent = {w: len(peers[w].frames) for w in members}
    for w in members:  # the workers drop their slices and ask for parameters
        engine.pull(w, None)
    version = engine.store.version
    push(other)  # the round's only running participant: it ends the round
    assert engine.store.version == version + 1, "the round waits for a replica that is gone"
    assert {w: len(peers[w].frames) for w in members} == sent  # nobody ran as data parallel
    assert engine.pipelines.view == {members[0]: members}  # the next round formed it again
    state = engine.host.state  # ... on its first step, outside the round
    assert set(state.working) == {other} and state.warming == (members[0],)


def test_on_a_model_that_is_not_block_structured_shares_follow_measured_speed() -> None:
    """Every worker fits such a model, so dpmp plans data parallelism over them all, with the
    global batch shared so that they finish together (as lbbsp's shares), not split equally."""
    shapes = {"dense0/kernel": (64, 64), "dense0/bias": (64,), "dense1/kernel": (64, 10)}
    params = {k: np.zeros(s, np.float32) for k, s in shapes.items()}
    clock = FakeClock()
    config = EngineConfig(batch_size=32, global_batch=256, profile_steps=0)
    engine = Engine(Store(params, optax.sgd(0.1)), make_policy("dpmp"), config, clock)
    assert engine.pipelines.blocks == ()
    sample_s = {"fast": 1e-4, "mid": 2e-4, "slow": 4e-4}  # seconds per sample
    ids = {}
    for name in sample_s:
        hello = wire.encode("hello", 1, name=name, device={}, codecs=["none"], features=[])
        ids[name] = engine.join(decode_hello(wire.decode(hello)), FakePeer())
    pid = 0
    for _ in range(4):  # rounds: every worker pushes its share once
        for name, wid in ids.items():
            pid += 1
            clock.t += 0.01
            b = engine.members.plans[wid].batch_size
            grads = {k: np.full(s, 1e-3, np.float32) for k, s in shapes.items()}
            base = engine.store.version
            engine.push(
                PushIn(wid, pid, base, "grad", grads, b, 1, b * sample_s[name], None, None, 1)
            )
    batch = {name: engine.members.plans[wid].batch_size for name, wid in ids.items()}
    assert sum(batch.values()) == 256
    assert batch["fast"] > batch["mid"] > batch["slow"], batch
    finish = [batch[n] * sample_s[n] for n in batch]
    assert max(finish) / min(finish) < 1.3, batch  # they finish (about) together


def test_a_worker_planned_out_while_slow_keeps_a_probe_share_and_gets_work_back() -> None:
    """A transient straggler: planned out while it is very slow, it must still push (a few
    samples) so that its speed is measured again, and get a full share once it is fast."""
    shapes = {"dense0/kernel": (64, 64), "dense0/bias": (64,)}
    params = {k: np.zeros(s, np.float32) for k, s in shapes.items()}
    clock = FakeClock()
    config = EngineConfig(batch_size=32, global_batch=256, profile_steps=0)
    engine = Engine(Store(params, optax.sgd(0.1)), make_policy("dpmp"), config, clock)
    ids = {}
    for name in ("a", "b", "straggler"):
        hello = wire.encode("hello", 1, name=name, device={}, codecs=["none"], features=[])
        ids[name] = engine.join(decode_hello(wire.decode(hello)), FakePeer())
    pid = 0
    shares: list[int] = []

    def round_(sample_s: dict[str, float]) -> None:
        nonlocal pid
        for name, wid in ids.items():
            if wid not in engine.host.state.working:
                continue
            pid += 1
            clock.t += 0.01
            b = engine.members.plans[wid].batch_size
            grads = {k: np.full(s, 1e-3, np.float32) for k, s in shapes.items()}
            base = engine.store.version
            engine.push(
                PushIn(wid, pid, base, "grad", grads, b, 1, b * sample_s[name], None, None, 1)
            )
        shares.append(engine.members.plans[ids["straggler"]].batch_size)

    for _ in range(4):  # 100x slower than the others: no share worth its time
        round_({"a": 1e-4, "b": 1e-4, "straggler": 1e-2})
    assert ids["straggler"] in engine.host.state.working  # still pushing: a probe share
    assert 0 < shares[-1] <= PROBE
    for _ in range(10):  # as fast as the others again (its measured speed is smoothed)
        round_({"a": 1e-4, "b": 1e-4, "straggler": 1e-4})
    assert shares[-1] > 64, shares  # about a third of 256 again


def test_shares_follow_measured_pushes_over_the_profile_taken_at_the_join() -> None:
    """A worker profiled fast that turns slow (a transient straggler, a shared box) gets less
    work: the plan reads its pushes, not the one-off profile."""
    shapes = {"dense0/kernel": (64, 64), "dense0/bias": (64,)}
    params = {k: np.zeros(s, np.float32) for k, s in shapes.items()}
    clock = FakeClock()
    config = EngineConfig(batch_size=32, global_batch=256, profile_steps=0)
    engine = Engine(Store(params, optax.sgd(0.1)), make_policy("dpmp"), config, clock)
    ids = {}
    for name in ("a", "b"):
        hello = wire.encode("hello", 1, name=name, device={}, codecs=["none"], features=[])
        ids[name] = engine.join(decode_hello(wire.decode(hello)), FakePeer())
        engine.profile_result(ids[name], {"sample_s": 1e-4})  # both profiled alike
    pid = 0
    for _ in range(8):  # but b computes 4x slower than its profile said
        for name, wid in ids.items():
            pid += 1
            clock.t += 0.01
            b = engine.members.plans[wid].batch_size
            s = 1e-4 if name == "a" else 4e-4
            grads = {k: np.full(v, 1e-3, np.float32) for k, v in shapes.items()}
            base = engine.store.version
            engine.push(PushIn(wid, pid, base, "grad", grads, b, 1, b * s, None, None, 1))
    share = {name: engine.members.plans[wid].batch_size for name, wid in ids.items()}
    assert share["a"] >= 3 * share["b"], share  # 4:1 by speed, within the split's rounding
