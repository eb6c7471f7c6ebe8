"""Checkpoint rotation keeps the newest *valid* files: corrupt newest files never push the good
ones out."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import optax

from hetd.core import Engine, EngineConfig
from hetd.core.store import Store
from hetd.server import checkpoint
from policies import make_policy
from tests.conftest import FakeClock


def make_engine() -> Engine:
    params = {"dense/w": np.ones((3, 2), np.float32), "dense/b": np.zeros(2, np.float32)}
    return Engine(Store(params, optax.sgd(0.1)), make_policy("asp"), EngineConfig(), FakeClock())


def step(e: Engine) -> None:
    e.store.apply("grad", {k: np.full(s, 0.1, np.float32) for k, s in e.store.shapes.items()}, 1)


def damage(path: Path, how: str) -> None:
    data = path.read_bytes()
    if how == "truncate":
        path.write_bytes(data[: len(data) // 2])
    else:
        mid = len(data) // 2
        path.write_bytes(data[:mid] + bytes([data[mid] ^ 0x01]) + data[mid + 1 :])


def test_rotation_keeps_the_newest_valid_checkpoints(tmp_path: Path) -> None:
    e = make_engine()
    infos = []
    for _ in range(5):
        step(e)
        infos.append(checkpoint.write(tmp_path, checkpoint.engine_state(e), keep=10))
    damage(Path(infos[3].path), "truncate")  # the two newest files are corrupt
    damage(Path(infos[4].path), "flip")
    step(e)
    newest = checkpoint.write(tmp_path, checkpoint.engine_state(e), keep=3)
    left = sorted(p.name for p in tmp_path.iterdir())
    # the new one and the two newest valid ones; the corrupt ones are gone, the oldest too
    assert left == sorted(Path(i.path).name for i in (infos[1], infos[2], newest)), left
    for name in left:
        checkpoint.decode((tmp_path / name).read_bytes())  # every file kept is valid
    found = checkpoint.load_newest(tmp_path)
    assert found is not None and found[0].version == newest.version


def test_rotation_with_only_corrupt_older_files_keeps_the_new_one(tmp_path: Path) -> None:
    e = make_engine()
    infos = []
    for _ in range(3):
        step(e)
        infos.append(checkpoint.write(tmp_path, checkpoint.engine_state(e), keep=10))
    for info in infos:
        damage(Path(info.path), "flip")
    step(e)
    newest = checkpoint.write(tmp_path, checkpoint.engine_state(e), keep=2)
    assert [p.name for p in tmp_path.iterdir()] == [Path(newest.path).name]


def test_rotation_of_valid_files_keeps_the_newest_k(tmp_path: Path) -> None:
    e = make_engine()
    infos = []
    for _ in range(6):
        step(e)
        infos.append(checkpoint.write(tmp_path, checkpoint.engine_state(e), keep=3))
    assert sorted(p.name for p in tmp_path.iterdir()) == [Path(i.path).name for i in infos[-3:]]


def test_the_newest_checkpoint_is_the_highest_version_not_the_last_write(tmp_path: Path) -> None:
    """Issue 30: a second daemon resumed version 5 from a shared directory while the first trained
    on to 7; the second's last checkpoint (version 5) was then the latest write, and a restart
    resumed it. By the rule, the highest version is the newest, whatever the order of writes."""
    ahead, behind = make_engine(), make_engine()
    for _ in range(5):
        step(ahead)
        step(behind)
    first = checkpoint.write(tmp_path, checkpoint.engine_state(ahead), keep=10)
    step(ahead)
    step(ahead)
    trained = checkpoint.write(tmp_path, checkpoint.engine_state(ahead), keep=10)
    stale = checkpoint.write(tmp_path, checkpoint.engine_state(behind), keep=10)  # written last
    assert (first.version, trained.version, stale.version) == (5, 7, 5)
    assert stale.seq == 3  # the sequence still counts every write

    found = checkpoint.load_newest(tmp_path)
    assert found is not None and found[0].path == trained.path and found[0].version == 7
    # Of one version, the later write wins.
    assert [Path(p).name for _, p in checkpoint.list_checkpoints(tmp_path)] == [
        Path(i.path).name for i in (trained, stale, first)
    ]
    # The next write numbers itself after every file, and rotation ranks by the same rule.
    step(ahead)
    newest = checkpoint.write(tmp_path, checkpoint.engine_state(ahead), keep=2)
    assert newest.seq == 4
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        Path(i.path).name for i in (trained, newest)
    )
