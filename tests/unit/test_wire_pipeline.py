"""The pipeline-replica messages (stage, step, abort, act, gact, and push's replica fields): what
protocol v1 accepts, and the ``malformed`` error every inconsistent frame gets."""

from __future__ import annotations

from typing import Any

import msgpack
import pytest

from hetd.protocol import wire
from hetd.protocol.wire import ProtocolError
from tests.unit.test_wire import SAMPLES, TENSOR, envelope


def decode(type_: str, **changes: Any) -> wire.Message:
    """Decode a sample message of ``type_`` with ``changes`` (None values drop the field)."""
    body = {**SAMPLES[type_], **changes}
    body = {k: v for k, v in body.items() if v is not None or k in ("prev", "next")}
    return wire.decode(msgpack.packb(envelope(type_, **body), use_bin_type=True))


def refused(type_: str, words: str, **changes: Any) -> None:
    with pytest.raises(ProtocolError) as exc:
        decode(type_, **changes)
    assert exc.value.code == "malformed" and exc.value.id == 7
    assert words in exc.value.message, exc.value.message


def test_a_last_stage_and_a_middle_stage_are_accepted() -> None:
    last = decode("stage", stage=1, of=2, blocks=[2, 4], prev=3, next=None)
    middle = decode("stage", stage=1, of=3, blocks=[1, 2], prev=3, next=4)
    assert (last["prev"], last["next"], middle["blocks"]) == (3, None, [1, 2])


@pytest.mark.parametrize(
    ("changes", "words"),
    [
        ({"stage": 2, "of": 2}, "0 <= stage < of"),
        ({"of": 0, "stage": 0}, "0 <= stage < of"),
        ({"of": 65, "stage": 0}, "of <= 64"),
        ({"blocks": [2, 2]}, "blocks must be [lo, hi)"),
        ({"blocks": [0]}, "blocks must be [lo, hi)"),
        ({"blocks": [0, "2"]}, "blocks must be [lo, hi)"),
        ({"blocks": [-1, 2]}, "blocks must be [lo, hi)"),
        ({"blocks": [True, 2]}, "blocks must be [lo, hi)"),
        ({"micro": 0}, "micro must be in"),
        ({"inflight": 0}, "inflight must be in"),
        ({"inflight": 1 << 20}, "inflight must be in"),
        ({"prev": 3}, "prev is None exactly for stage 0"),
        ({"next": None}, "next is None exactly for the last stage"),
        ({"replica": -1}, "replica must be in [0, 2^63)"),
        ({"next": -4}, "next must be in [0, 2^63)"),
    ],
)
def test_inconsistent_stage_assignments_are_refused(changes: dict[str, Any], words: str) -> None:
    refused("stage", words, **changes)


def test_a_stage_without_its_neighbour_fields_is_refused() -> None:
    body = {k: v for k, v in SAMPLES["stage"].items() if k != "prev"}
    with pytest.raises(ProtocolError, match="missing field 'prev'"):
        wire.decode(msgpack.packb(envelope("stage", **body), use_bin_type=True))


@pytest.mark.parametrize(
    ("type_", "changes", "words"),
    [
        ("step", {"micro_batches": 0}, "micro_batches must be in"),
        ("step", {"micro": 1 << 17}, "micro must be in"),
        ("step", {"base": -1}, "base must be in"),
        ("step", {"offset": -5}, "offset must be in"),
        ("abort", {"step": -1}, "step must be in"),
        ("act", {"mb": -1}, "mb must be in"),
        ("gact", {"mb": 1 << 16}, "mb must be in"),
        ("act", {"gen": -2}, "gen must be in"),
        ("act", {"tensor": {**TENSOR, "dtype": "float64"}}, "dtype 'float32'"),
        ("act", {"tensor": {"dtype": "float32", "shape": [2]}}, "codec name"),
        ("gact", {"tensor": {**TENSOR, "shape": [2, -1]}}, "tensor shape"),
        ("gact", {"tensor": {**TENSOR, "shape": [1] * 9}}, "at most 8"),
        ("act", {"tensor": {**TENSOR, "shape": "2"}}, "tensor shape"),
        ("act", {"tensor": {**TENSOR, **{f"x{i}": 0 for i in range(20)}}}, "small map"),
    ],
)
def test_bad_steps_aborts_and_relayed_headers_are_refused(
    type_: str, changes: dict[str, Any], words: str
) -> None:
    refused(type_, words, **changes)


def test_relayed_tensor_bytes_are_not_interpreted_by_the_wire() -> None:
    # the receiving worker decodes the tensor; the wire checks its header only
    msg = decode("act", tensor={**TENSOR, "data": b"\x01" * 3})
    assert msg["tensor"]["data"] == b"\x01" * 3


def test_push_replica_fields_come_all_together_or_not_at_all() -> None:
    both = {"replica": 1, "gen": 0, "step": 3, "stage": 1}
    assert decode("push", **both)["stage"] == 1
    assert decode("push").get("stage") is None  # v1 pushes are unchanged
    refused("push", "come together", replica=1, gen=0, step=3)
    refused("push", "stage must be below 64", **{**both, "stage": 64})
    refused("push", "step must be in", **{**both, "step": -1})
    with pytest.raises(ProtocolError, match="must be int/NoneType"):
        decode("push", **{**both, "gen": "0"})


def test_bool_is_not_an_id() -> None:
    with pytest.raises(ProtocolError, match="must be int"):
        decode("abort", replica=True)
