"""The typed :class:`Plan`: its wire form (the same keys as before it was typed), strict parsing,
merging a policy's field changes, and the helpers workers and the simulator read plans with."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from hetd.codecs import registry as codecs
from hetd.protocol.plan import codec_for, data_range, local_steps_for
from policies import Plan
from policies.types import CORE_PLAN_FIELDS, OPTIONAL_PLAN_FIELDS, PLAN_FIELDS

# The wire form of a default plan, as daemons before the typed Plan sent it.
LEGACY_DEFAULT = {
    "batch_size": 32,
    "local_steps": 1,
    "codec": "none",
    "bits": 32,
    "topk": 1.0,
    "lr_scale": 1.0,
    "stage": "main",
}


def test_a_default_plan_has_the_legacy_wire_form() -> None:
    assert Plan().to_wire() == LEGACY_DEFAULT
    assert set(CORE_PLAN_FIELDS) == set(LEGACY_DEFAULT)
    assert set(CORE_PLAN_FIELDS) | set(OPTIONAL_PLAN_FIELDS) == PLAN_FIELDS


def test_optional_fields_are_on_the_wire_only_when_set() -> None:
    p = Plan(data_share=0.25, data_offset=0.5, push_kind="delta", staleness_bound=3)
    assert p.to_wire() == {
        **LEGACY_DEFAULT,
        "data_share": 0.25,
        "data_offset": 0.5,
        "push_kind": "delta",
        "staleness_bound": 3,
    }
    # Unset again (a policy's None): off the wire, which a worker reads as the default.
    assert p.merge({"staleness_bound": None}).to_wire().get("staleness_bound", "absent") == "absent"


def test_every_optional_field_defaults_to_not_set() -> None:
    assert all(getattr(Plan(), name) is None for name in OPTIONAL_PLAN_FIELDS)


def test_from_wire_takes_defaults_for_absent_keys_and_ignores_unknown_ones() -> None:
    assert Plan.from_wire({}) == Plan()
    assert Plan.from_wire({"batch_size": 8, "colour": "red", "future": {"x": 1}}) == Plan(
        batch_size=8
    )


def test_from_wire_reads_what_older_daemons_sent() -> None:
    """ASHL's AHL plans carried ``staleness_bound: None``; ints came where floats belong."""
    legacy = {**LEGACY_DEFAULT, "lr_scale": 1, "topk": 1, "staleness_bound": None}
    p = Plan.from_wire(legacy)
    assert p == Plan() and isinstance(p.lr_scale, float) and isinstance(p.topk, float)


PLANS = st.builds(
    Plan,
    batch_size=st.integers(1, 4096),
    local_steps=st.integers(1, 100),
    codec=st.sampled_from(["none", "topk", "int8:stochastic=true", "bf16"]),
    bits=st.sampled_from([32, 16, 8, 4, 1]),
    topk=st.floats(0.01, 1.0),
    lr_scale=st.floats(0.0, 10.0),
    stage=st.sampled_from(["main", "AHL", "SHL", "ADSP", "profile"]),
    data_share=st.none() | st.floats(0.01, 1.0),
    data_offset=st.none() | st.floats(0.0, 0.99),
    local_time_s=st.none() | st.floats(0.0, 100.0),
    push_kind=st.none() | st.sampled_from(["grad", "delta"]),
    pipeline=st.none() | st.booleans(),
    commit_quota=st.none() | st.integers(1, 100),
    period_s=st.none() | st.floats(0.1, 600.0),
    staleness_bound=st.none() | st.integers(0, 10),
)


@given(PLANS)
def test_wire_round_trip(p: Plan) -> None:
    assert Plan.from_wire(p.to_wire()) == p


@pytest.mark.parametrize(
    ("wire", "words"),
    [
        ({"batch_size": "32"}, ["batch_size", "an int", "'32'"]),
        ({"batch_size": True}, ["batch_size", "an int"]),
        ({"batch_size": None}, ["batch_size"]),  # a core field is never unset
        ({"local_steps": 2.0}, ["local_steps", "an int"]),
        ({"topk": "0.1"}, ["topk", "number"]),
        ({"lr_scale": math.nan}, ["lr_scale", "finite"]),
        ({"codec": 8}, ["codec", "string"]),
        ({"data_share": [0.5]}, ["data_share", "or None"]),
        ({"pipeline": 1}, ["pipeline", "bool"]),
        ({"push_kind": "sideways"}, ["push_kind", "'grad' or 'delta'"]),
        ({"local_time_s": True}, ["local_time_s"]),
    ],
)
def test_from_wire_is_strict_about_types(wire: dict[str, Any], words: list[str]) -> None:
    with pytest.raises(ValueError) as info:
        Plan.from_wire(wire)
    for word in words:
        assert word in str(info.value)


def test_from_wire_needs_a_map() -> None:
    with pytest.raises(ValueError, match="map"):
        Plan.from_wire([("batch_size", 3)])  # type: ignore[arg-type]


def test_merge_changes_the_named_fields_only() -> None:
    p = Plan(batch_size=16, codec="bf16")
    q = p.merge({"local_steps": 4, "lr_scale": 1, "pipeline": True})
    assert q == dataclasses.replace(p, local_steps=4, lr_scale=1.0, pipeline=True)
    assert isinstance(q.lr_scale, float)
    assert p.merge({}) == p


def test_merge_refuses_unknown_fields_and_bad_values() -> None:
    with pytest.raises(ValueError, match="unknown plan field") as info:
        Plan().merge({"data_shares": 0.5})
    assert "data_share" in str(info.value).split(";")[1]  # the real names are listed
    with pytest.raises(ValueError, match="commit_quota"):
        Plan().merge({"commit_quota": 2.5})


# --- what workers and the simulator read off a plan ------------------------------------------------


@pytest.mark.parametrize(
    ("plan", "expected"),
    [
        (Plan(), None),
        (Plan(data_share=0.25), (0.0, 0.25)),
        (Plan(data_share=0.25, data_offset=0.5), (0.5, 0.25)),
        (Plan(data_share=1.0, data_offset=1.0), (0.0, 1.0)),  # an offset out of [0, 1): 0
        (Plan(data_share=0.0), None),  # a share out of (0, 1]: ignored
        (Plan(data_share=1.5, data_offset=0.5), None),
    ],
)
def test_data_range(plan: Plan, expected: tuple[float, float] | None) -> None:
    assert data_range(plan) == expected


def test_local_steps_for_reads_the_plan() -> None:
    assert local_steps_for(Plan(local_steps=3), 0.1) == 3
    assert local_steps_for(Plan(local_steps=3, local_time_s=1.0), 0.1) == 10


def test_codec_for_a_bare_topk_keeps_the_plans_fraction() -> None:
    x = {"w": np.arange(1, 11, dtype=np.float32)}
    kept = codecs.decode_tree(codecs.encode_tree(x, codec_for(Plan(codec="topk", topk=0.3))))
    assert np.count_nonzero(kept["w"]) == 3
    assert codec_for(Plan(codec="int8:stochastic=true")).name.startswith("int8")
    assert codec_for(Plan()).lossless
