"""The daemon's ring as the store's frame sink (hetd.server.shm_hub): a snapshot's frame is packed
straight into a slot, byte for byte the frame packed on its own, and sent by reference without a
second copy; a slot is never rewritten while anything still references its frame; with every slot
busy the store packs fresh memory as before; nothing is left in /dev/shm."""

from __future__ import annotations

import gc
import os

import numpy as np

from hetd.core.store import Store, make_optimizer
from hetd.protocol import shm, wire
from hetd.protocol.params import full_frame
from hetd.server.shm_hub import ShmHub


def _store() -> Store:
    rng = np.random.default_rng(0)
    params = {"a": rng.standard_normal((64, 512), dtype=np.float32), "b": np.zeros(3, np.float32)}
    return Store(params, make_optimizer("sgd", 0.1))


def _step(store: Store) -> None:
    store.apply("grad", {k: np.ones(s, np.float32) for k, s in store.shapes.items()}, 1.0)


def _busy(hub: ShmHub) -> int:
    gc.collect()
    return sum(lease.root() is not None for lease in hub._leases.values())


def test_snapshots_are_packed_into_the_ring_and_sent_without_a_copy() -> None:
    hub = ShmHub(slots=3, ring_bytes=1)  # three slots (the least)
    store = _store()
    ring = hub.offer(4 * store.n_params + 4096)
    assert ring is not None and ring.slots == 3
    store.frame_sink = hub
    reader = shm.RingReader(ring.name)
    try:
        snap = store.snapshot()
        assert isinstance(snap.frame, memoryview) and hub.frames_packed == 1
        expected, _ = full_frame(snap.version, snap.tensors, snap.hash)
        assert bytes(snap.frame) == expected  # the frame a socket worker gets, as before
        for k, v in snap.tensors.items():
            assert not v.flags.writeable
            np.testing.assert_array_equal(v, np.asarray(store._params[k]))
        ref = wire.decode(hub.publish(snap.frame, holder=1) or b"")
        assert ref.type == "params_ref" and ref["version"] == snap.version
        assert reader.read(shm.ref_of(ref.body)) == expected
        assert hub.frames_written == 1  # referenced where it lies: nothing copied in

        # A slot whose frame is still referenced (here by one tensor view) is not rewritten.
        tensor = snap.tensors["a"]
        del snap
        _step(store)
        second = store.snapshot()
        assert isinstance(second.frame, memoryview) and _busy(hub) == 2
        _step(store)
        third = store.snapshot()  # slots: held by holder 1, the second's, this one's
        assert isinstance(third.frame, memoryview) and _busy(hub) == 3
        np.testing.assert_array_equal(tensor, _tensor_a(expected, tensor.shape))  # untouched

        # Every slot busy: the next snapshot is packed in fresh memory, and copied in when sent.
        _step(store)
        fourth = store.snapshot()
        assert isinstance(fourth.frame, bytes) and hub.frames_packed == 3
        assert hub.publish(fourth.frame, holder=2) is None  # no slot free for the copy either
        # Once the first frame's last view goes and its holder moves on, its slot is free again.
        assert hub.publish(third.frame, holder=1) is not None
        del tensor
        assert _busy(hub) == 2
        _step(store)
        fifth = store.snapshot()
        assert isinstance(fifth.frame, memoryview) and hub.frames_packed == 4
        kept = fifth.tensors["a"].copy()
        del second, third, fourth
    finally:
        reader.close()
        hub.close()  # a frame still referenced (the fifth): unlinked all the same ...
    assert not os.path.exists(ring.path)
    np.testing.assert_array_equal(fifth.tensors["a"], kept)  # ... and still mapped here


def _tensor_a(frame: bytes, shape: tuple[int, ...]) -> np.ndarray:
    """Tensor ``a`` read back from a frame packed on its own."""
    data = wire.decode(frame)["tensors"]["a"]["data"]
    return np.frombuffer(data, np.float32).reshape(shape)
