"""Wire protocol v1 and the none/bf16 codecs: what round-trips, and what a bad frame is told."""

from __future__ import annotations

from typing import Any

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hetd.codecs import registry as codecs
from hetd.codecs.registry import CodecError
from hetd.protocol import wire
from hetd.protocol.messages import Ack, Bye, PlanUpdate, ProfileRequest, Welcome
from hetd.protocol.wire import ProtocolError
from policies import Plan

# --- helpers -------------------------------------------------------------------------------------


def pack(obj: Any) -> bytes:
    """A raw msgpack frame, bypassing ``wire.encode`` so tests can send anything."""
    packed: bytes = msgpack.packb(obj, use_bin_type=True)
    return packed


def envelope(type_: Any, id_: Any = 7, **fields: Any) -> dict[str, Any]:
    return {"v": 1, "type": type_, "id": id_, **fields}


TENSOR = {"codec": "none", "dtype": "float32", "shape": [2], "data": b"\x00" * 8}
PLAN = {"batch_size": 32, "local_steps": 1, "codec": "none", "bits": 32, "topk": 1.0}

# Realistic fields for every message type; a new type in SCHEMA must be added here.
SAMPLES: dict[str, dict[str, Any]] = {
    "hello": {
        "token": "s3cret",
        "name": "gpu-box-1",
        "device": {"platform": "cuda", "kind": "RTX 3060", "memory": 12 * 2**30},
        "codecs": ["none", "bf16"],
        "resume": {"worker_id": 3, "version": 41},
    },
    "pull": {"have": 12},
    "push": {
        "base": 40,
        "kind": "grad",
        "tensors": {"dense/w": TENSOR, "dense/b": TENSOR},
        "samples": 32,
        "steps": 1,
        "compute_s": 0.125,
        "loss": 2.31,
        "free_mem": 2**31,
        "pull_s": 0.004,
        "sent_at": 1712345678.5,
    },
    "profile_result": {"result": {"step_s": [0.1, 0.11], "batch": 64}},
    "heartbeat": {},
    "bye": {"reason": "shutdown"},
    "shm_offer": {"segment": "hetd-dl-0000abcd0123456789ab"},
    "shm_ready": {"nonce": "ab" * 16, "segment": "hetd-up-0000abcd0123456789ab"},
    "params_at": {"version": 3, "position": 9, "slices": ["00ff00ff00ff00ff"], "hash": None},
    "params_ref": {
        "version": 3,
        "segment": "hetd-dl-0000abcd0123456789ab",
        "offset": 80,
        "length": 4096,
        "gen": 7,
    },
    "push_ref": {"segment": "hetd-up-0000abcd0123456789ab", "offset": 80, "length": 512, "gen": 1},
    "welcome": {
        "worker_id": 3,
        "model": {"name": "mlp", "shapes": {"dense/w": [784, 10]}},
        "dataset": {"name": "mnist5k"},
        "shard": {"index": 1, "of": 4},
        "plan": PLAN,
        "heartbeat_s": 2.0,
        "train": {"worker_lr": 0.05},
    },
    "params": {"version": 42, "full": False, "base": 40, "tensors": {"a": TENSOR}, "plan": PLAN},
    "ack": {"version": 42, "status": "buffered", "reason": None, "plan": PLAN},
    "plan": {"plan": PLAN},
    "shard": {"index": 1, "count": 3},
    "profile": {"spec": {"batches": [16, 32, 64], "steps": 3}},
    "error": {"code": "malformed", "message": "push: missing field 'base'"},
    "chunk": {"seq": 2, "last": False, "data": b"\x93\x01"},
    # pipeline replicas (hetd.protocol.pipeline; their own checks: tests/unit/test_wire_pipeline.py)
    "stage": {
        "replica": 1,
        "gen": 2,
        "stage": 0,
        "of": 2,
        "blocks": [0, 2],
        "micro": 16,
        "inflight": 2,
        "prev": None,
        "next": 5,
    },
    "step": {
        "replica": 1,
        "gen": 2,
        "step": 7,
        "base": 40,
        "micro_batches": 4,
        "micro": 16,
        "shard": 0,
        "offset": 128,
    },
    "abort": {"replica": 1, "gen": 2, "step": 7, "reason": "stage 1 left", "dissolve": True},
    "act": {"replica": 1, "gen": 2, "step": 7, "mb": 3, "tensor": TENSOR},
    "gact": {"replica": 1, "gen": 2, "step": 7, "mb": 3, "tensor": TENSOR},
}


def valid_push(**changes: Any) -> dict[str, Any]:
    return envelope("push", **{**SAMPLES["push"], **changes})


# --- round trips ---------------------------------------------------------------------------------


def test_samples_cover_every_message_type() -> None:
    assert set(SAMPLES) == set(wire.SCHEMA)


@pytest.mark.parametrize("type_", sorted(SAMPLES))
def test_every_message_type_round_trips(type_: str) -> None:
    msg = wire.decode(wire.encode(type_, 99, **SAMPLES[type_]))
    assert (msg.type, msg.id, msg.body) == (type_, 99, SAMPLES[type_])


def test_optional_fields_may_be_left_out() -> None:
    msg = wire.decode(
        wire.encode("push", 1, base=0, kind="delta", tensors={}, samples=0, steps=5, compute_s=0)
    )
    assert msg["kind"] == "delta" and msg.get("loss") is None and msg.get("free_mem", -1) == -1


def test_encode_refuses_unknown_type() -> None:
    with pytest.raises(ProtocolError) as info:
        wire.encode("gossip", 1)
    assert info.value.code == "unknown_type"


def test_error_frame_decodes_to_error_message() -> None:
    msg = wire.decode(wire.error_frame("too_large", "frame of 9 bytes exceeds the 8 cap", id_=5))
    assert (msg.type, msg.id, msg["code"], msg["message"]) == (
        "error",
        5,
        "too_large",
        "frame of 9 bytes exceeds the 8 cap",
    )


def test_tensors_packed_from_memoryview_round_trip() -> None:
    rng = np.random.default_rng(0)
    model = {
        "dense/w": rng.standard_normal((5, 3)).astype(np.float32),
        "dense/b": rng.standard_normal(3).astype(np.float32),
    }
    tensors = codecs.encode_tree(model, codecs.get_codec("none"))
    assert all(isinstance(t["data"], memoryview) for t in tensors.values())
    frame = wire.encode("push", 1, **{**SAMPLES["push"], "tensors": tensors})
    msg = wire.decode(frame)
    out = codecs.decode_tree(msg["tensors"], {k: v.shape for k, v in model.items()})
    for path, x in model.items():
        np.testing.assert_array_equal(out[path], x)


def test_decode_accepts_memoryview_and_bytearray_frames() -> None:
    frame = wire.encode("pull", 3, have=2)
    assert wire.decode(memoryview(frame)).body == {"have": 2}
    assert wire.decode(bytearray(frame)).body == {"have": 2}


# --- malformed frames ----------------------------------------------------------------------------

MALFORMED: list[tuple[str, bytes, str]] = [
    ("not msgpack", b"\xc1\xc1\xc1", "malformed"),
    ("truncated map", pack(envelope("heartbeat"))[:-1], "malformed"),
    ("trailing bytes", pack(envelope("heartbeat")) + b"\x00", "malformed"),
    ("empty frame", b"", "malformed"),
    ("list instead of map", pack([1, "heartbeat", 7]), "malformed"),
    ("bare int", pack(1), "malformed"),
    ("int map keys", pack({1: 1, "type": "heartbeat", "id": 7}), "malformed"),
    ("no version", pack({"type": "heartbeat", "id": 7}), "bad_version"),
    ("version 2", pack({**envelope("heartbeat"), "v": 2}), "bad_version"),
    ("version as string", pack({**envelope("heartbeat"), "v": "1"}), "bad_version"),
    ("unknown type", pack(envelope("gossip")), "unknown_type"),
    ("missing type", pack({"v": 1, "id": 7}), "unknown_type"),
    ("type not a string", pack(envelope(3)), "unknown_type"),
    ("missing id", pack({"v": 1, "type": "heartbeat"}), "malformed"),
    ("bool id", pack(envelope("heartbeat", id_=True)), "malformed"),
    ("string id", pack(envelope("heartbeat", id_="7")), "malformed"),
    ("float id", pack(envelope("heartbeat", id_=7.0)), "malformed"),
    ("missing required field", pack(envelope("hello", device={}, codecs=["none"])), "malformed"),
    (
        "push missing base",
        pack({k: v for k, v in valid_push().items() if k != "base"}),
        "malformed",
    ),
    ("wrong field type", pack(envelope("hello", name=5, device={}, codecs=[])), "malformed"),
    ("bool where int expected", pack(valid_push(samples=True)), "malformed"),
    ("bool where number expected", pack(valid_push(compute_s=False)), "malformed"),
    ("float where int expected", pack(valid_push(base=1.0)), "malformed"),
    (
        "int where bool expected",
        pack(envelope("params", version=1, full=1, tensors={})),
        "malformed",
    ),
    ("None for required field", pack(valid_push(tensors=None)), "malformed"),
    ("list where map expected", pack(valid_push(tensors=[])), "malformed"),
    ("unknown extra field", pack(envelope("heartbeat", colour="red")), "malformed"),
    ("push bad kind", pack(valid_push(kind="weights")), "malformed"),
    ("push negative samples", pack(valid_push(samples=-1)), "malformed"),
    ("push zero steps", pack(valid_push(steps=0)), "malformed"),
    ("push negative compute_s", pack(valid_push(compute_s=-0.5)), "malformed"),
    ("hello empty name", pack(envelope("hello", name="", device={}, codecs=[])), "malformed"),
    (
        "hello bytes in device",
        pack(envelope("hello", name="a", device={"kind": b"\x00"}, codecs=[])),
        "malformed",
    ),
    (
        "hello nested device",
        pack(envelope("hello", name="a", device={"kind": {"x": 1}}, codecs=[])),
        "malformed",
    ),
    (
        "hello codec not a name",
        pack(envelope("hello", name="a", device={}, codecs=[8])),
        "malformed",
    ),
    ("ext type field", pack(envelope("bye", reason=msgpack.ExtType(1, b"abc"))), "malformed"),
    ("timestamp ext", pack(envelope("bye", reason=msgpack.Timestamp(1, 0))), "malformed"),
    (
        "ext nested in a map",
        pack(envelope("profile_result", result={"x": msgpack.ExtType(9, b"\x01\x02")})),
        "malformed",
    ),
]


@pytest.mark.parametrize(
    ("frame", "code"), [m[1:] for m in MALFORMED], ids=[m[0] for m in MALFORMED]
)
def test_malformed_frame_gets_protocol_error_with_code(frame: bytes, code: str) -> None:
    with pytest.raises(ProtocolError) as info:
        wire.decode(frame)
    assert info.value.code == code
    assert info.value.message  # a human-readable reason goes back to the worker


def test_error_names_the_missing_field() -> None:
    with pytest.raises(ProtocolError, match="'name'"):
        wire.decode(pack(envelope("hello", device={}, codecs=["none"])))


def test_error_names_the_unknown_field() -> None:
    with pytest.raises(ProtocolError, match="colour"):
        wire.decode(pack(envelope("heartbeat", colour="red")))


def test_unknown_type_error_lists_known_types() -> None:
    with pytest.raises(ProtocolError, match="push") as info:
        wire.decode(pack(envelope("gossip")))
    assert "heartbeat" in info.value.message


@pytest.mark.parametrize("version", [True, 1.0], ids=["bool", "float"])
def test_version_must_be_the_int_1(version: Any) -> None:
    """BUG (wire.validate): ``version != 1`` lets ``True`` and ``1.0`` through."""
    with pytest.raises(ProtocolError) as info:
        wire.decode(pack({**envelope("heartbeat"), "v": version}))
    assert info.value.code == "bad_version"


@pytest.mark.parametrize("value", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_push_compute_s_must_be_finite(value: float) -> None:
    """BUG (wire.validate): ``compute_s < 0`` is False for NaN, so NaN timings reach the policy."""
    with pytest.raises(ProtocolError) as info:
        wire.decode(pack(valid_push(compute_s=value)))
    assert info.value.code == "malformed"


def test_zero_length_ext_nested_is_rejected() -> None:
    """BUG (wire.decode): ``max_ext_len=0`` still admits an ext of length 0."""
    frame = pack(envelope("hello", name="a", device={"x": msgpack.ExtType(5, b"")}, codecs=[]))
    with pytest.raises(ProtocolError) as info:
        wire.decode(frame)
    assert info.value.code == "malformed"


def test_unknown_fields_with_str_and_bytes_keys_give_protocol_error() -> None:
    """BUG (wire.validate): ``sorted`` of mixed str/bytes unknown keys raises TypeError."""
    frame = pack({**envelope("heartbeat"), b"raw": 1, "text": 2})
    with pytest.raises(ProtocolError) as info:
        wire.decode(frame)
    assert info.value.code == "malformed"


def test_oversize_frame_is_refused_before_unpacking() -> None:
    frame = wire.encode(
        "push", 1, **{**SAMPLES["push"], "tensors": {"a": {**TENSOR, "data": bytes(4096)}}}
    )
    assert wire.decode(frame, max_size=len(frame)).type == "push"  # exactly at the cap is fine
    with pytest.raises(ProtocolError) as info:
        wire.decode(frame, max_size=len(frame) - 1)
    assert info.value.code == "too_large"


@settings(max_examples=300, deadline=None, database=None)
@given(st.binary(max_size=256))
def test_random_bytes_only_ever_raise_protocol_error(frame: bytes) -> None:
    try:
        msg = wire.decode(frame)
    except ProtocolError as exc:
        assert exc.code in ("malformed", "bad_version", "unknown_type", "too_large")
    else:
        assert msg.type in wire.SCHEMA


_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), 2**64 - 1),
    st.floats(),
    st.text(max_size=8),
    st.binary(max_size=8),
)


def _nest(inner: st.SearchStrategy[object]) -> st.SearchStrategy[object]:
    return st.one_of(
        inner, st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=4), inner, max_size=3)
    )


# Containers two deep, spelled out: st.recursive's check that `extend` uses its argument raises a
# HypothesisDeprecationWarning on some draws (seen once in a full run; warnings fail the suite).
_values = _nest(_nest(_scalars))
_keys = st.one_of(
    st.sampled_from(["v", "type", "id", "base", "kind", "samples", "steps"]),
    st.text(max_size=6),
    st.binary(max_size=4),
)


@settings(max_examples=300, deadline=None, database=None)
@given(st.sampled_from(sorted(wire.SCHEMA)), st.dictionaries(_keys, _values, max_size=6))
def test_random_maps_near_a_valid_envelope_only_raise_protocol_error(
    type_: str, extra: dict[Any, Any]
) -> None:
    raw = {**envelope(type_, **SAMPLES[type_]), **extra}
    try:
        msg = wire.decode(pack(raw))
    except ProtocolError as exc:
        assert exc.code in ("malformed", "bad_version", "unknown_type")
    else:  # whatever got through is exactly what the schema allows
        assert set(msg.body) <= set(wire.SCHEMA[msg.type])


# --- codecs: none and bf16 -----------------------------------------------------------------------


def roundtrip(name: str, x: np.ndarray) -> np.ndarray:
    """Encode with a codec, carry it through a wire frame, decode it."""
    tensors = codecs.encode_tree({"t": x}, codecs.get_codec(name))
    frame = wire.encode("params", 1, version=1, full=True, tensors=tensors)
    return codecs.decode_tree(wire.decode(frame)["tensors"], {"t": x.shape})["t"]


def test_codec_none_is_bit_exact() -> None:
    x = np.random.default_rng(1).standard_normal((7, 5)).astype(np.float32)
    x[0, :4] = np.array([np.inf, -np.inf, -0.0, 1e-45], np.float32)  # specials and a subnormal
    out = roundtrip("none", x)
    assert out.dtype == np.float32 and out.shape == x.shape
    np.testing.assert_array_equal(out.view(np.uint32), x.view(np.uint32))


def test_codec_bf16_relative_error_is_at_most_2_to_minus_8() -> None:
    rng = np.random.default_rng(2)
    x = (rng.standard_normal(10_000) * 10.0 ** rng.uniform(-30, 30, 10_000)).astype(np.float32)
    out = roundtrip("bf16", x)
    rel = np.abs(out.astype(np.float64) - x) / np.abs(x.astype(np.float64))
    assert rel.max() <= 2.0**-8
    assert rel.max() > 2.0**-12  # it really did drop 16 bits


def test_codec_bf16_halves_the_bytes_and_keeps_specials() -> None:
    x = np.array([np.nan, -np.nan, np.inf, -np.inf, 0.0, -0.0, 1.0], np.float32)
    wire_t = codecs.get_codec("bf16").encode(x, None)
    assert len(wire_t["data"]) == 2 * x.size
    out = roundtrip("bf16", x)
    assert np.isnan(out[:2]).all()
    np.testing.assert_array_equal(out[2:], x[2:])
    assert np.signbit(out[5])


def test_get_codec_unknown_name_lists_known_names() -> None:
    with pytest.raises(CodecError, match="nope") as info:
        codecs.get_codec("nope")
    assert "none" in str(info.value) and "bf16" in str(info.value)


def test_codecs_ratio_matches_encoded_size() -> None:
    x = np.ones((8, 8), np.float32)
    for name in ("none", "bf16"):
        codec = codecs.get_codec(name)
        assert len(codec.encode(x, None)["data"]) == pytest.approx(codec.ratio * x.nbytes)


SHAPES = {"layer/w": (3, 2), "layer/b": (2,)}


def good_tree() -> dict[str, dict[str, Any]]:
    tree = codecs.encode_tree(
        {k: np.zeros(s, np.float32) for k, s in SHAPES.items()}, codecs.get_codec("none")
    )
    return {k: {**t, "data": bytes(t["data"])} for k, t in tree.items()}


def _without(tree: dict[str, Any], path: str) -> dict[str, Any]:
    return {k: v for k, v in tree.items() if k != path}


def _set(tree: dict[str, Any], path: str, **changes: Any) -> dict[str, Any]:
    return {**tree, path: {**tree[path], **changes}}


# (label, how to break a good tree, words the message must hold: the path and the reason)
BAD_TREES = [
    ("missing path", lambda t: _without(t, "layer/w"), ["layer/w", "missing"]),
    ("extra path", lambda t: {**t, "layer/extra": t["layer/b"]}, ["layer/extra", "unknown"]),
    ("wrong shape", lambda t: _set(t, "layer/w", shape=[2, 3]), ["layer/w", "shape"]),
    ("wrong byte length", lambda t: _set(t, "layer/w", data=bytes(20)), ["layer/w", "bytes"]),
    ("bf16 byte length", lambda t: _set(t, "layer/b", codec="bf16"), ["layer/b", "bytes"]),
    ("unknown codec", lambda t: _set(t, "layer/b", codec="zstd"), ["layer/b", "zstd"]),
    ("float64 dtype", lambda t: _set(t, "layer/w", dtype="float64"), ["layer/w", "float64"]),
    ("int8 dtype", lambda t: _set(t, "layer/b", dtype="int8"), ["layer/b", "int8"]),
    ("negative dim", lambda t: _set(t, "layer/b", shape=[-2]), ["layer/b", "shape"]),
    ("bool dim", lambda t: _set(t, "layer/b", shape=[True, 2]), ["layer/b", "shape"]),
    ("data not bytes", lambda t: _set(t, "layer/b", data="00000000"), ["layer/b", "data"]),
    ("tensor not a map", lambda t: {**t, "layer/b": [0.0, 0.0]}, ["layer/b", "map"]),
]


@pytest.mark.parametrize(
    ("mutate", "words"), [b[1:] for b in BAD_TREES], ids=[b[0] for b in BAD_TREES]
)
def test_decode_tree_rejects_bad_tensor_naming_it(mutate: Any, words: list[str]) -> None:
    codecs.decode_tree(good_tree(), SHAPES)  # the unbroken tree is fine
    with pytest.raises(CodecError) as info:
        codecs.decode_tree(mutate(good_tree()), SHAPES)
    for word in words:
        assert word in str(info.value)


def test_decode_tree_rejects_a_non_map() -> None:
    with pytest.raises(CodecError, match="map"):
        codecs.decode_tree([1, 2], SHAPES)


# --- the engine's typed replies -------------------------------------------------------------------


def test_typed_replies_encode_exactly_the_v1_frames() -> None:
    """Each reply of :mod:`hetd.protocol.messages` is the frame the engine wrote by hand before,
    byte for byte, and ``message()`` is what decoding that frame gives."""
    plan = Plan(batch_size=16, codec="int8", stage="shl", lr_scale=0.5)
    setup = {"model": {"spec": "mlp"}, "dataset": {"spec": "digits"}, "train": {"seed": 0}}
    cases = [
        (
            Welcome(3, 2, plan, 0.5, 1, 4, setup),
            wire.encode(
                "welcome",
                3,
                worker_id=2,
                plan=plan.to_wire(),
                heartbeat_s=0.5,
                shard={"index": 1, "count": 4},
                **setup,
            ),
        ),
        (
            Ack(9, 12, "dropped", "too stale"),
            wire.encode("ack", 9, version=12, status="dropped", reason="too stale"),
        ),
        (Ack(9, 12, "applied"), wire.encode("ack", 9, version=12, status="applied", reason=None)),
        (PlanUpdate(plan), wire.encode("plan", 0, plan=plan.to_wire())),
        (
            ProfileRequest(3, 32),
            wire.encode("profile", 0, spec={"steps": 3, "batch_size": 32}),
        ),
        (Bye("daemon stopping"), wire.encode("bye", 0, reason="daemon stopping")),
    ]
    for reply, frame in cases:
        assert reply.encode() == frame, reply
        assert reply.message() == wire.decode(frame), reply


def test_pack_parts_is_encode_byte_for_byte_without_copying_big_buffers() -> None:
    """Zero-copy frames stay protocol v1: the segments join to exactly what ``encode`` packs (v1
    readers decode them unchanged), and a big tensor's buffer is handed over, not copied."""
    rng = np.random.default_rng(0)
    tensors = {
        "a": rng.standard_normal(70_000).astype(np.float32),  # bin32 header
        "b": rng.standard_normal(3).astype(np.float32),  # small: packed inline
        "c": rng.standard_normal((4, 4096)).astype(np.float32),  # exactly 64 KiB: bin16 header
    }
    enc = codecs.encode_tree(tensors, codecs.none_codec())
    fields = {"version": 7, "full": True, "tensors": enc, "hash": "0123456789abcdef"}
    parts = wire.pack_parts("params", 0, **fields)
    assert parts.join() == wire.encode("params", 0, **fields)
    assert parts.nbytes == len(parts.join())
    big = [s for s in parts.segments if isinstance(s, memoryview)]
    assert [s.obj for s in big] == [enc["a"]["data"].obj, enc["c"]["data"].obj]
    frame = parts.join()
    for off, name in zip(parts.offsets, ("a", "c"), strict=True):
        assert frame[off : off + tensors[name].nbytes] == tensors[name].tobytes()
    msg = wire.decode(frame)
    assert msg["version"] == 7 and msg["hash"] == "0123456789abcdef"


def test_full_frame_shares_its_memory_with_the_snapshot_and_takes_a_hash_later() -> None:
    from hetd.protocol.frames import as_params
    from hetd.protocol.params import apply_params, full_frame, param_hash, with_hash

    rng = np.random.default_rng(1)
    tensors = {"w": rng.standard_normal((300, 100)).astype(np.float32), "b": np.ones(5, np.float32)}
    frame, views = full_frame(3, tensors, None)
    assert np.shares_memory(np.frombuffer(frame, np.uint8), views["w"])
    assert not views["w"].flags.writeable and not views["b"].flags.writeable
    h = param_hash(tensors)
    hashed = with_hash(frame, h)
    assert hashed == full_frame(3, tensors, h)[0]
    codec = {"codec": "none", "dtype": "float32"}
    enc = {k: {**codec, "shape": list(v.shape), "data": v.tobytes()} for k, v in tensors.items()}
    assert hashed == wire.encode("params", 0, version=3, full=True, tensors=enc, hash=h)
    held = apply_params(None, as_params(wire.decode(hashed)))
    assert held is not None and held.version == 3
    np.testing.assert_array_equal(held.tensors["w"], tensors["w"])
    with pytest.raises(ValueError):
        with_hash(b"\x90", h)


def test_chunks_carry_a_frame_over_the_cap_and_join_back() -> None:
    """A frame over the cap goes as chunk frames of at most ``cap`` bytes each; the reassembler
    gives back the very frame; one that fits goes as it is."""
    tensors = {"w": {**TENSOR, "shape": [5000], "data": bytes(range(256)) * 78 + b"\x00" * 32}}
    frame = wire.encode("params", 0, version=3, full=True, tensors=tensors)
    assert list(wire.chunks(frame, len(frame))) == [frame]
    pieces = list(wire.chunks(frame, 1024))
    assert len(pieces) > 1 and all(len(p) <= 1024 for p in pieces)
    parts = wire.Reassembler(len(frame))
    got = [parts.feed(wire.decode(p, 1024)) for p in pieces]
    assert got[:-1] == [None] * (len(pieces) - 1) and got[-1] == frame
    assert parts.pending == 0
    assert wire.decode(frame)["tensors"] == tensors
    with pytest.raises(ValueError):
        list(wire.chunks(frame, wire.CHUNK_OVERHEAD))


def test_reassembler_refuses_disorder_and_oversize_then_recovers_at_seq_0() -> None:
    frame = wire.encode("bye", 0, reason="x" * 3000)
    pieces = [wire.decode(p) for p in wire.chunks(frame, 1000)]
    parts = wire.Reassembler(len(frame))
    parts.feed(pieces[0])
    with pytest.raises(ProtocolError) as exc:
        parts.feed(pieces[2])  # 1 was lost
    assert exc.value.code == "malformed" and "out of order" in exc.value.message
    assert parts.feed(pieces[3]) is None  # the rest of that message is ignored, quietly
    assert [parts.feed(p) for p in pieces][-1] == frame  # a new seq 0 starts over
    small = wire.Reassembler(len(frame) - 1)
    with pytest.raises(ProtocolError) as exc:
        for p in pieces:
            small.feed(p)
    assert exc.value.code == "too_large" and small.pending == 0
    with pytest.raises(ProtocolError):
        wire.decode(wire.encode("chunk", 0, seq=-1, last=True, data=b""))
