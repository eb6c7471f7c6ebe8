"""The checkpoint file: written without copies of the state, and the same format as before (flax's
msgpack in a checksummed envelope) both ways."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tracemalloc
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np
import pytest
from flax import serialization

from hetd.server import checkpoint, ckpt_file


def state_of(n: int) -> dict[str, Any]:
    """A checkpoint-shaped tree with ``n`` float32 parameters and leaves of every kind."""
    rng = np.random.default_rng(0)
    return {
        "version": 5,
        "created_unix": 1.5,
        "params": {
            "dense/w": rng.standard_normal((n // 1000, 1000), dtype=np.float32),
            "dense/b": np.arange(7, dtype=np.float32),
        },
        "opt_state": [{"count": np.int32(3), "mu": np.zeros((2, 3), np.float64)}, {}],
        "policy": {
            "name": "asp",
            "state": None,
            "z": complex(1, 2),
            "half": jnp.ones(3, jnp.bfloat16),
        },
        "workers": {"1": {"name": "w", "active": True, "t": np.float32(0.25)}},
        "empty": np.zeros((0, 4), np.int8),
        "scalar": np.array(2.5, np.float32),
    }


def same(a: Any, b: Any) -> None:
    if isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b)
        for key in a:
            same(a[key], b[key])
    elif isinstance(a, list):
        assert isinstance(b, list) and len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            same(x, y)
    elif hasattr(a, "dtype"):
        assert np.asarray(b).dtype == np.asarray(a).dtype and np.shape(b) == np.shape(a)
        assert np.array_equal(np.asarray(a), np.asarray(b))
    else:
        assert a == b


def old_encode(state: dict[str, Any]) -> bytes:
    """The writer before the streaming one: the payload, then the envelope around a copy of it."""
    payload = serialization.msgpack_serialize(state)
    envelope = {
        "format": "hetd-checkpoint",
        "format_version": 1,
        "sha256": hashlib.sha256(payload).hexdigest(),
        "state": payload,
    }
    out: bytes = serialization.msgpack_serialize(envelope)
    return out


def peak_of(fn: Any) -> tuple[Any, int]:
    """``fn()`` and the peak of the Python allocations (numpy's too) it made."""
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        out = fn()
        return out, tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()


def test_a_checkpoint_is_written_and_read_without_copies_of_the_state(tmp_path: Path) -> None:
    state = state_of(2_000_000)  # 8 MB
    size = sum(np.asarray(v).nbytes for v in state["params"].values())
    checkpoint.write(tmp_path, state, keep=2)
    # the second write checks the first file (rotation) too
    info, peak = peak_of(lambda: checkpoint.write(tmp_path, state, keep=2))
    assert info.nbytes == Path(info.path).stat().st_size > size
    # the code before held the arrays' bytes, the payload and the envelope, and decoded the older
    # file whole to verify it: > 4x the state
    assert peak < 0.25 * size, f"peak {peak} bytes writing a {size}-byte state"
    loaded, peak = peak_of(lambda: ckpt_file.read(Path(info.path)))
    same(state, loaded)
    assert peak < 1.3 * size, f"peak {peak} bytes reading a {size}-byte state"  # before: > 2x


def test_the_file_is_flax_msgpack_in_the_envelope_both_ways(tmp_path: Path) -> None:
    state = state_of(3000)
    info = checkpoint.write(tmp_path, state, keep=2)
    data = Path(info.path).read_bytes()
    # read with nothing of ours, as the old reader did
    envelope = serialization.msgpack_restore(data)
    assert envelope["format"] == "hetd-checkpoint" and envelope["format_version"] == 1
    assert hashlib.sha256(envelope["state"]).hexdigest() == envelope["sha256"]
    same(state, serialization.msgpack_restore(envelope["state"]))
    # and the old writer's file (hash before the state) reads with ours
    old = tmp_path / "ckpt-00000009-v5.msgpack"
    old.write_bytes(old_encode(state))
    same(state, ckpt_file.read(old))
    same(state, checkpoint.decode(old.read_bytes()))
    ckpt_file.verify(old)
    same(checkpoint.decode(checkpoint.encode(state)), state)


def test_arrays_above_the_chunk_size_are_chunked_as_flax_does(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(ckpt_file, "_CHUNK_BYTES", 1000)  # flax's is 1 GiB
    state = state_of(3000)
    data = checkpoint.encode(state)
    payload = serialization.msgpack_restore(data)["state"]
    assert b"__msgpack_chunked_array__" in payload
    same(state, serialization.msgpack_restore(payload))
    same(state, checkpoint.decode(data))


def test_a_corrupt_or_foreign_file_is_refused_and_the_mapping_closes(tmp_path: Path) -> None:
    path = Path(checkpoint.write(tmp_path, state_of(3000), keep=2).path)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    for check in (ckpt_file.verify, ckpt_file.read):
        with pytest.raises(checkpoint.CheckpointError, match="checksum"):
            check(path)
    path.write_bytes(serialization.msgpack_serialize({"format": "other", "state": b"x"}))
    with pytest.raises(checkpoint.CheckpointError, match="format marker"):
        ckpt_file.read(path)
    path.write_bytes(b"")
    with pytest.raises(checkpoint.CheckpointError, match="empty"):
        ckpt_file.verify(path)
    path.write_bytes(bytes(data[:100]))
    with pytest.raises(checkpoint.CheckpointError):
        ckpt_file.read(path)


# A daemon's process: glibc with the allocator settings hetd.launch gives it, an engine with 64 MB
# of parameters, one checkpoint saved as the timer saves it (the capture taken, written, freed).
_SAVE_IN_A_DAEMONS_HEAP = """
import asyncio, sys, tempfile
import numpy as np, optax
from hetd.core import Engine, EngineConfig
from hetd.core.store import Store
from hetd.server.checkpoint import Checkpointer
from policies import make_policy
from tests.conftest import FakeClock

def rss():
    return next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmRSS"))

params = {"w": np.ones((4000, 4000), np.float32)}
engine = Engine(Store(params, optax.sgd(0.1)), make_policy("asp", {}), EngineConfig(), FakeClock())
del params
saver = Checkpointer(tempfile.mkdtemp(), keep=2)


async def main() -> None:
    task = asyncio.create_task(engine.run())
    await asyncio.sleep(0)
    engine.store.snapshot()  # the current version's frame, as a daemon that serves workers has
    before = rss()
    await saver.save(engine)
    print(rss() - before)
    task.cancel()

asyncio.run(main())
"""


@pytest.mark.slow  # a subprocess builds an engine and measures its RSS: `make test` runs it, `make test-fast` does not
def test_a_saved_checkpoint_leaves_the_daemons_resident_memory_as_it_was() -> None:
    from hetd.launch import MALLOC_ENV

    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, **MALLOC_ENV, "PYTHONPATH": str(root), "JAX_PLATFORMS": "cpu"}
    out = subprocess.run(
        [sys.executable, "-c", _SAVE_IN_A_DAEMONS_HEAP],
        env=env,
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    grown = int(out.stdout.split()[-1])
    # before: the capture (64 MB) and the writer's copies stayed in the heap, ~5x the state
    assert grown < 32e6, f"RSS grew {grown} bytes after a checkpoint of a 64 MB model"
