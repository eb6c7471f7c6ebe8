"""Checkpoints: the engine's state survives save -> load; bad files are skipped, never loaded."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any, NamedTuple

import jax
import numpy as np
import optax
import pytest

from hetd import config
from hetd.core import Engine, EngineConfig
from hetd.core.ingest import decode_hello
from hetd.core.saved import SavedWorker
from hetd.core.store import Aggregator, Store
from hetd.protocol import wire
from hetd.protocol.messages import JoinIn
from hetd.server import checkpoint
from hetd.server.checkpoint import Checkpointer, CheckpointError
from policies import ClusterView, Policy, make_policy, policy_names, register
from tests.conftest import FakeClock, FakePeer


def make_engine(optimizer: str = "adam", shape: tuple[int, ...] = (3, 2)) -> Engine:
    params = {"dense/w": np.ones(shape, np.float32), "dense/b": np.zeros(shape[-1], np.float32)}
    tx = {"adam": optax.adam(0.1), "sgd": optax.sgd(0.1)}[optimizer]
    return Engine(
        Store(params, tx), make_policy("ssp", {"staleness": 3}), EngineConfig(), FakeClock()
    )


def grads(engine: Engine, value: float) -> dict[str, np.ndarray]:
    return {k: np.full(s, value, np.float32) for k, s in engine.store.shapes.items()}


def hello(resume: int | None, name: str = "w") -> JoinIn:
    """A hello; a resuming one shows the secret :func:`know` gave that worker."""
    fields: dict[str, Any] = {"name": name, "device": {"platform": "cpu"}, "codecs": ["none"]}
    if resume is not None:
        fields["resume"] = {"worker_id": resume, "secret": f"secret-{resume}"}
    return decode_hello(wire.decode(wire.encode("hello", 1, **fields)))


def know(e: Engine, workers: dict[int, tuple[str, int]], next_id: int, **changes: Any) -> None:
    """Give ``e`` departed workers (id -> name, clock), the next id and other state ``changes``,
    through its own state and restore."""
    saved = {
        wid: SavedWorker(name, clock, secret=f"secret-{wid}")
        for wid, (name, clock) in workers.items()
    }
    e.restore(dataclasses.replace(e.state(), workers=saved, next_id=next_id, **changes))


def trained_engine() -> Engine:
    """An engine with history: updates, workers active and departed, a half-full buffer, a
    swapped policy and another stage."""
    e = make_engine()
    for i in range(5):
        e.store.apply("grad", grads(e, 0.1 * (i + 1)), 0.5)
    agg = Aggregator()
    agg.add("grad", grads(e, 2.0), 0.25)
    know(
        e,
        {1: ("fast", 12), 2: ("slow", 7)},
        next_id=3,
        updates_applied=5,
        buffers={4: agg.state()},
        policy="ssp",
        policy_params={"staleness": 5},
        policy_state=None,
        stage="shl",
    )
    assert e.join(hello(1, "fast"), FakePeer()) == 1  # the fast one is back: active again, clock 12
    assert e.members.facts[1].clock == 12 and set(e.members.departed) == {2}
    return e


def leaves(tree: Any) -> list[np.ndarray]:
    return [np.asarray(x) for x in jax.tree.leaves(tree)]


def test_engine_state_round_trips_through_the_file_format() -> None:
    e = trained_engine()
    data = checkpoint.encode(checkpoint.engine_state(e))
    fresh = make_engine()
    checkpoint.restore_engine(fresh, checkpoint.decode(data))

    p1, o1, v1 = e.store.state()
    p2, o2, v2 = fresh.store.state()
    assert v2 == v1 == 5
    assert p1.keys() == p2.keys()
    for k in p1:
        np.testing.assert_array_equal(p1[k], p2[k])
    assert type(o2) is type(o1)
    for a, b in zip(leaves(o1), leaves(o2), strict=True):
        np.testing.assert_array_equal(a, b)
    assert fresh.host.policy.describe() == {
        "name": "ssp",
        "params": {"staleness": 5, "weight": None, "patience": 10.0},
    }
    assert fresh.host.stage == "shl" and fresh.applier.updates_applied == 5
    # Both the active and the departed worker can resume, with their clocks; new ids come after.
    assert {w: (f.name, f.clock) for w, f in fresh.members.departed.items()} == {
        1: ("fast", 12),
        2: ("slow", 7),
    }
    assert not fresh.members.facts and fresh.state().next_id == 3
    assert fresh.applier.buffered() == 1
    ((kind, sums),) = fresh.applier.buffers[4].take(normalize=True)
    assert kind == "grad"
    np.testing.assert_allclose(sums["dense/w"], 2.0)
    # The restored optimizer keeps working (its state is live jax arrays again).
    fresh.store.apply("grad", grads(fresh, 0.1), 1.0)
    assert fresh.store.version == 6


def test_the_payload_is_plain_flax_msgpack() -> None:
    from flax import serialization

    e = trained_engine()
    envelope = serialization.msgpack_restore(checkpoint.encode(checkpoint.engine_state(e)))
    assert envelope["format"] == "hetd-checkpoint" and envelope["format_version"] == 1
    state = serialization.msgpack_restore(envelope["state"])
    assert state["version"] == 5 and state["policy"]["name"] == "ssp"
    assert set(state["params"]) == {"dense/w", "dense/b"}


def write_n(directory: Path, n: int, keep: int = 10) -> list[checkpoint.CheckpointInfo]:
    e = make_engine()
    infos = []
    for _ in range(n):
        e.store.apply("grad", grads(e, 0.1), 1.0)
        infos.append(checkpoint.write(directory, checkpoint.engine_state(e), keep))
    return infos


def test_write_is_atomic_and_keeps_the_newest(tmp_path: Path) -> None:
    infos = write_n(tmp_path / "state", 5, keep=3)
    names = sorted(p.name for p in (tmp_path / "state").iterdir())
    assert names == [Path(i.path).name for i in infos[-3:]]  # no temp files, oldest deleted
    assert [i.version for i in infos] == [1, 2, 3, 4, 5]
    found = checkpoint.load_newest(tmp_path / "state")
    assert found is not None and found[0].version == 5 and found[0].seq == 5


@pytest.mark.parametrize("damage", ["truncate", "flip", "empty", "garbage"])
def test_a_corrupt_newest_checkpoint_is_skipped_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, damage: str
) -> None:
    infos = write_n(tmp_path, 3)
    newest = Path(infos[-1].path)
    data = newest.read_bytes()
    if damage == "truncate":
        newest.write_bytes(data[: len(data) // 2])
    elif damage == "flip":
        mid = len(data) // 2
        newest.write_bytes(data[:mid] + bytes([data[mid] ^ 0xFF]) + data[mid + 1 :])
    elif damage == "empty":
        newest.write_bytes(b"")
    else:
        newest.write_bytes(b"not a checkpoint at all")
    with caplog.at_level(logging.WARNING, "hetd.server.checkpoint"):
        found = checkpoint.load_newest(tmp_path)
    assert found is not None and found[0].version == infos[-2].version
    assert f"skipping checkpoint {newest}" in caplog.text


def test_no_valid_checkpoint_means_a_fresh_start_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    (tmp_path / "ckpt-00000001-v3.msgpack").write_bytes(b"\x00" * 10)
    (tmp_path / ".ckpt-00000002-v4.msgpack.tmp").write_bytes(b"half written")
    (tmp_path / "notes.txt").write_text("not ours")
    with caplog.at_level(logging.WARNING, "hetd.server.checkpoint"):
        assert checkpoint.load_newest(tmp_path) is None
        assert checkpoint.load_newest(tmp_path / "absent") is None
    assert "starting fresh" in caplog.text
    assert not (tmp_path / ".ckpt-00000002-v4.msgpack.tmp").exists()  # leftover removed
    assert (tmp_path / "notes.txt").exists()  # not ours: untouched
    e = make_engine()
    assert Checkpointer(tmp_path, 3).restore(e) is None and e.store.version == 0


def test_a_checkpoint_of_another_model_stops_start_up(tmp_path: Path) -> None:
    write_n(tmp_path, 1)
    with pytest.raises(CheckpointError, match=r"does not fit.*--state-dir"):
        Checkpointer(tmp_path, 3).restore(make_engine(shape=(4, 2)))
    with pytest.raises(CheckpointError, match="does not fit"):
        Checkpointer(tmp_path, 3).restore(make_engine(optimizer="sgd"))


def test_an_unknown_saved_policy_keeps_the_configured_one(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    e = trained_engine()
    state = checkpoint.engine_state(e)
    state["policy"] = {"name": "gone-plugin", "params": {}, "state": None}
    fresh = make_engine()
    with caplog.at_level(logging.WARNING, "hetd.server.checkpoint"):
        checkpoint.restore_engine(fresh, state)
    assert fresh.store.version == 5 and fresh.host.policy.name == "ssp"
    assert "gone-plugin" in caplog.text


def test_a_returning_worker_gets_its_clock_back_never_below_the_slowest() -> None:
    e = make_engine()
    know(e, {4: ("w", 9), 5: ("v", 2)}, next_id=6)
    assert e.join(hello(4), FakePeer()) == 4
    assert e.members.facts[4].clock == 9  # alone: exactly its saved clock
    assert e.join(hello(5), FakePeer()) == 5
    assert (
        e.members.facts[5].clock == 9
    )  # behind the active minimum: starts there, holds nobody back
    new = e.join(hello(None), FakePeer())
    assert new == 6 and e.members.facts[new].clock == 9  # a new worker: the engine's own rule
    assert e.join(hello(77), FakePeer()) == 7  # an unknown id is a new worker


def test_checkpoint_config_is_validated() -> None:
    with pytest.raises(config.ConfigError, match=r"\[store\] keep"):
        config.replace(config.Config(), "store", keep=0)
    with pytest.raises(config.ConfigError, match=r"\[store\] interval_s"):
        config.replace(config.Config(), "store", interval_s=-1.0)
    with pytest.raises(config.ConfigError, match=r"\[server\] admin_port"):
        config.replace(config.Config(), "server", admin_port=-2)
    cfg = config.replace(config.Config(), "server", admin_port=-1)
    assert dataclasses.asdict(cfg.store) == {
        "dir": "",
        "interval_s": 60.0,
        "keep": 3,
        "export_dir": "",
    }


class Counts(NamedTuple):
    """A policy state flax can serialise: a NamedTuple of arrays and numbers."""

    seen: np.ndarray
    rounds: int


def _counting() -> Policy:
    def init(view: ClusterView) -> Counts:
        return Counts(np.zeros(3, np.int64), 0)

    def update(event: Any, state: Counts, view: ClusterView) -> tuple[list[Any], Counts]:
        return [], state

    return Policy("test-counting", init, update, {})


if "test-counting" not in policy_names():
    register("test-counting")(_counting)


def test_a_serialisable_policy_state_is_restored() -> None:
    e = make_engine()
    e.host.policy = make_policy("test-counting")
    e.host.state = Counts(np.array([4, 5, 6]), 7)
    fresh = make_engine()
    checkpoint.restore_engine(
        fresh, checkpoint.decode(checkpoint.encode(checkpoint.engine_state(e)))
    )
    assert fresh.host.policy.name == "test-counting"
    assert isinstance(fresh.host.state, Counts) and fresh.host.state.rounds == 7
    np.testing.assert_array_equal(fresh.host.state.seen, [4, 5, 6])
