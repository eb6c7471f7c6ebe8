"""The parameter hash of a published version: stable for the same snapshot, different for any
changed tensor, carried by full ``params`` frames only and checked by the worker's rules."""

from __future__ import annotations

import numpy as np
import optax

from hetd.core.downlink import Downlink
from hetd.core.store import Store
from hetd.protocol import wire
from hetd.protocol.frames import as_params
from hetd.protocol.params import apply_params, hash_matches, param_hash


def _params() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {
        "Dense_0/kernel": rng.standard_normal((4, 3)).astype(np.float32),
        "Dense_0/bias": rng.standard_normal(3).astype(np.float32),
    }


def test_hash_is_stable_for_the_same_snapshot() -> None:
    store = Store(_params(), optax.sgd(0.1))
    snap = store.snapshot()
    assert snap.hash is not None and len(snap.hash) == 16
    assert snap.hash == param_hash(snap.tensors)
    assert store.snapshot().hash == snap.hash  # one snapshot per version
    again = Store(_params(), optax.sgd(0.1)).snapshot()
    assert again.hash == snap.hash  # the same values hash the same in another store
    # path order does not matter; the float32 values do
    reordered = dict(reversed(list(snap.tensors.items())))
    assert param_hash(reordered) == snap.hash


def test_hash_differs_for_a_changed_tensor() -> None:
    params = _params()
    base = param_hash(params)
    for path in params:
        changed = {k: v.copy() for k, v in params.items()}
        changed[path].flat[0] = np.nextafter(changed[path].flat[0], np.float32(np.inf))
        assert param_hash(changed) != base, path
    renamed = {("x/" + k): v for k, v in params.items()}
    assert param_hash(renamed) != base
    reshaped = dict(params, **{"Dense_0/kernel": params["Dense_0/kernel"].reshape(3, 4)})
    assert param_hash(reshaped) != base


def test_new_version_has_a_new_hash() -> None:
    store = Store(_params(), optax.sgd(0.1))
    first = store.snapshot()
    grads = {k: np.ones_like(v) for k, v in _params().items()}
    store.apply("grad", grads, 1.0)
    second = store.snapshot()
    assert second.version == first.version + 1
    assert second.hash != first.hash == param_hash(_params())


def test_full_frames_carry_the_hash_and_deltas_do_not() -> None:
    store = Store(_params(), optax.sgd(0.1))
    downlink = Downlink()
    snap = store.snapshot()
    out = downlink.frames("none", None, snap)
    msg = as_params(wire.decode(out.frames[0]))
    assert msg.full and msg.hash == snap.hash
    held = apply_params(None, msg)
    assert held is not None and hash_matches(held, msg) is True
    # a lossy codec: the first release is full (hashed), the next a delta (not checked)
    full = downlink.frames("int8", None, snap)
    fmsg = as_params(wire.decode(full.frames[0]))
    assert fmsg.full and fmsg.hash == snap.hash
    store.apply("grad", {k: np.ones_like(v) for k, v in _params().items()}, 1.0)
    delta = downlink.frames("int8", full.version, store.snapshot(), full.ref)
    dmsg = as_params(wire.decode(delta.frames[0]))
    assert not dmsg.full and dmsg.hash is None
    dheld = apply_params(apply_params(None, fmsg), dmsg)
    assert dheld is not None and hash_matches(dheld, dmsg) is None


def test_a_tampered_full_frame_is_detected() -> None:
    snap = Store(_params(), optax.sgd(0.1)).snapshot()
    msg = wire.decode(Downlink().frames("none", None, snap).frames[0])
    body = dict(msg.body)
    path = "Dense_0/bias"
    tensor = dict(body["tensors"][path])
    data = bytearray(tensor["data"])
    data[0] ^= 1
    tensor["data"] = bytes(data)
    body["tensors"] = dict(body["tensors"], **{path: tensor})
    tampered = as_params(wire.decode(wire.encode("params", 0, **body)))
    held = apply_params(None, tampered)
    assert held is not None and hash_matches(held, tampered) is False


def test_old_frames_without_a_hash_still_decode() -> None:
    frame = wire.encode("params", 0, version=1, full=True, tensors={})
    msg = as_params(wire.decode(frame))
    held = apply_params(None, msg)
    assert held is not None and hash_matches(held, msg) is None


def test_a_downlink_without_hashes_sends_frames_as_before() -> None:
    """The simulator turns hashes off (EngineConfig.param_hashes), so its byte counts and golden
    runs do not change; a daemon's downlink carries them by default."""
    snap = Store(_params(), optax.sgd(0.1)).snapshot()
    plain = wire.decode(Downlink(hashes=False).frames("none", None, snap).frames[0])
    assert plain.get("hash") is None
    hashed = Downlink().frames("none", None, snap).frames[0]
    assert wire.decode(hashed)["hash"] == snap.hash
