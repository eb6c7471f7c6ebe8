"""Every protocol message typed: what one side encodes from a record reads back on the other as
the same record (:func:`hetd.protocol.frames.decode`), the big binary fields are handed on as the
decoder made them (no copy), and a message that is not what the caller expects is refused."""

from __future__ import annotations

import numpy as np
import pytest

from hetd.codecs import registry as codecs
from hetd.protocol import frames, shm, wire
from hetd.protocol.aligned import ALIGN, decode_aligned
from hetd.protocol.frames import (
    Abort,
    Act,
    Chunk,
    Gact,
    Heartbeat,
    Hello,
    Params,
    ParamsAt,
    ParamsRef,
    ProfileResult,
    Pull,
    Push,
    PushRef,
    ShmOffer,
    ShmReady,
    StageOrder,
    StepOrder,
)
from policies.types import Plan

REF = shm.Ref("hetd-dl-0123456789ab", 80, 4096, 3)
TENSOR = codecs.get_codec("none").encode(np.arange(6, dtype=np.float32).reshape(2, 3), None)


def test_every_message_reads_back_as_the_record_that_encoded_it() -> None:
    sent = [
        Params(3, True, {"w": TENSOR}, hash="00ff00ff00ff00ff"),
        Params(4, False, {}, base=3, plan=Plan(batch_size=16)),
        ParamsRef(5, REF),
        ParamsAt(6, 41, ("00ff00ff00ff00ff", "0f0f0f0f0f0f0f0f"), "ffff0000ffff0000"),
        ParamsAt(6, 41, ("00ff00ff00ff00ff",)),
        ShmOffer("hetd-dl-0123456789ab"),
        StageOrder(2, 1, 0, 2, (0, 3), 8, 2, None, 11),
        StepOrder(2, 1, 9, 4, 3, 8, 0, 5),
        Abort(2, 1, 9),
        Abort(2, 1, 9, "a stage left", dissolve=True),
        Act(2, 1, 9, 0, TENSOR),
        Gact(2, 1, 9, 1, TENSOR),
        Hello(1, "w0", {"platform": "cpu"}, ("none", "int8"), ("hash", "stages")),
        Hello(1, "w0", {}, ("none",), (), resume={"worker_id": 3, "secret": "s"}, token="t"),
        Push(7, 3, "grad", {"w": TENSOR}, 32, 1, 0.5, loss=2.5, sent_at=1e9, idle_s=0.1),
        Push(8, 4, "grad", {}, 24, 1, 0.2, replica=2, gen=1, step=9, stage=1),
        PushRef(9, REF),
        ShmReady("ab" * 16, "hetd-up-0123456789ab"),
        Pull(None),
        Pull(12),
        ProfileResult({"sample_s": 0.001, "push_s": 0.01}),
        Heartbeat(),
        Chunk(0, False, b"piece"),
    ]
    for record in sent:
        assert frames.decode(record.encode()) == record, record.type
    assert {type(r).type for r in sent} | {"welcome", "ack", "error", "plan", "shard"} >= set(
        wire.SCHEMA
    ) - {"profile", "bye"}  # (those two are engine replies: test_protocol_replies)


def test_a_push_keeps_loss_and_free_mem_and_leaves_other_unset_fields_out() -> None:
    body = wire.decode(Push(7, 3, "delta", {}, 32, 4, 0.5).encode()).body
    # every worker has always sent these two (the simulator's push sizes count them) ...
    assert body["loss"] is None and body["free_mem"] is None
    # ... and nothing unset besides: a push sent again goes without its first send's stamp
    assert not {"sent_at", "idle_s", "pull_s", "replica", "stage"} & set(body)


def test_reading_a_params_frame_copies_none_of_its_tensors() -> None:
    big = np.random.default_rng(0).standard_normal(64 * 1024).astype(np.float32)  # 256 KiB
    frame = wire.encode(
        "params",
        0,
        version=1,
        full=True,
        tensors=codecs.encode_tree({"w": big}, codecs.none_codec()),
    )
    decoded = decode_aligned(frame)
    typed = frames.as_params(decoded)
    data = typed.tensors["w"]["data"]
    # the very object the aligned decoder made: a read-only view of its aligned buffer
    assert data is decoded.body["tensors"]["w"]["data"]
    assert isinstance(data, memoryview) and data.readonly
    assert np.frombuffer(data, np.uint8).ctypes.data % ALIGN == 0
    np.testing.assert_array_equal(np.frombuffer(data, np.float32), big)


def test_a_message_of_another_type_is_refused_where_params_are_expected() -> None:
    with pytest.raises(wire.ProtocolError, match="params message was expected, not pull"):
        frames.as_params(wire.decode(Pull(None).encode()))
    with pytest.raises(wire.ProtocolError, match="unknown fields"):
        frames.decode(wire.encode("pull", 0, have=None, extra=1))


def test_a_nested_field_missing_or_of_the_wrong_kind_is_a_protocol_error() -> None:
    """What the wire's schema checks only at the top (a map's keys inside) is checked when the
    message is read: a malformed one raises ProtocolError, never a KeyError or TypeError."""
    top = {"model": {}, "dataset": {}, "train": {}, "plan": {}, "heartbeat_s": 1.0}
    for shard in ({}, {"index": "x", "count": 1}):
        msg = wire.decode(wire.encode("welcome", 3, worker_id=1, shard=shard, **top))
        with pytest.raises(wire.ProtocolError) as err:
            frames.read(msg)
        assert err.value.code == "malformed"


def test_a_params_at_whose_slice_hashes_are_not_strings_is_malformed() -> None:
    for slices in ([1, 2], [None], [b"00ff"]):
        msg = wire.decode(wire.encode("params_at", 0, version=3, position=9, slices=slices))
        with pytest.raises(wire.ProtocolError) as err:
            frames.read(msg)
        assert err.value.code == "malformed"
    with pytest.raises(wire.ProtocolError):  # every field checked at the top, as for params
        frames.decode(wire.encode("params_at", 0, version=3, slices=[]))
