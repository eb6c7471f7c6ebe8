"""The pservers' targets as the system bench judges them from its rows."""

from __future__ import annotations

from typing import Any

from hetd.bench.system_pservers import Variant, variants
from hetd.bench.system_targets import judge, targets_md


def _row(params: int, servers: int, backend: str, ups: float, **kw: Any) -> dict[str, Any]:
    row = {
        "params": params,
        "codec": "int8",
        "workers": 4,
        "transport": "ws",
        "pservers": servers,
        "pserver_backend": backend,
        "updates_per_s": ups,
    }
    return row | kw


def test_scaling_is_s2_over_s1_of_the_same_cell_against_1_4() -> None:
    rows = [
        _row(31_999_010, 1, "none", 10.0),
        _row(31_999_010, 2, "local", 14.0),  # 1.4x: met
        _row(99_999_010, 1, "none", 3.0),
        _row(99_999_010, 2, "local", 3.3),  # 1.1x: not met
        _row(199_010, 1, "none", 100.0),
        _row(199_010, 2, "local", 200.0),  # met, but not a size the target names
        _row(31_999_010, 2, "local", 99.0, workers=1),  # another cell: no S = 1 beside it
    ]
    verdicts = judge(rows)
    assert [(v["params"], v["ratio"], v["met"], v["target_size"]) for v in verdicts] == [
        (31_999_010, 1.4, True, True),
        (99_999_010, 1.1, False, True),
        (199_010, 2.0, True, False),
    ]
    text = "\n".join(targets_md(verdicts))
    assert "31,999,010 int8 x4 ws: 14.00 / 10.00 = 1.40x (target >= 1.4x): met" in text
    assert "1.10x (target >= 1.4x): NOT met" in text
    assert "199,010 int8 x4 ws (not a size the target names)" in text


def test_backends_need_both_updates_and_push_latency_within_5_percent() -> None:
    def cell(ray_ups: float, ray_p50: float, params: int) -> list[dict[str, Any]]:
        return [
            _row(params, 2, "local", 10.0, push_p50_ms=100.0, codec="none", workers=1),
            _row(params, 2, "ray", ray_ups, push_p50_ms=ray_p50, codec="none", workers=1),
        ]

    rows = cell(10.4, 96.0, 1) + cell(10.4, 94.0, 2) + cell(9.4, 100.0, 3)
    verdicts = judge(rows)
    assert all(v["what"] == "backends" for v in verdicts)  # (no S = 1 rows: no scaling)
    assert [(v["ratio"], v["latency_ratio"], v["met"]) for v in verdicts] == [
        (1.04, 0.96, True),
        (1.04, 0.94, False),
        (0.94, 1.0, False),
    ]


def test_no_pservers_axis_no_verdicts_and_the_variants_of_an_axis() -> None:
    assert judge([_row(31_999_010, 1, "none", 10.0)]) == []
    assert targets_md([]) == []
    assert variants((1, 2, 4), ("local", "ray")) == [
        Variant(1, "none"),
        Variant(2, "local"),
        Variant(2, "ray"),
        Variant(4, "local"),
        Variant(4, "ray"),
    ]
    assert variants((2, 1, 2), ("local",)) == [Variant(2, "local"), Variant(1, "none")]


def test_a_head_of_headers_is_a_variant_of_its_own_judged_beside_the_others() -> None:
    assert variants((1, 2), ("local", "ray"), ("whole", "headers")) == [
        Variant(1, "none"),
        Variant(2, "local"),
        Variant(2, "local", True),
        Variant(2, "ray"),
        Variant(2, "ray", True),
    ]
    assert Variant(2, "local", True).label() == "2 local headers"
    rows = [
        _row(31_999_010, 1, "none", 3.0),
        _row(31_999_010, 2, "local", 4.5, push_p50_ms=400.0),
        _row(31_999_010, 2, "local", 7.2, push_p50_ms=250.0, pserver_headers=True),
        _row(31_999_010, 2, "ray", 7.0, push_p50_ms=255.0, pserver_headers=True),
    ]
    verdicts = judge(rows)
    scaling = {v["backend"]: (v["ratio"], v["met"]) for v in verdicts if v["what"] == "scaling"}
    assert scaling == {
        "local": (1.5, True),
        "local+headers": (2.4, True),
        "ray+headers": (2.333, True),
    }
    # ray is compared with local of the same head only: here, headers
    (backends,) = [v for v in verdicts if v["what"] == "backends"]
    assert backends["headers"] is True and backends["ratio"] == 0.972
    text = "\n".join(targets_md(verdicts))
    assert "S = 2 (local+headers) / S = 1 updates/s" in text
    assert "ray / local at S = 2, headers," in text
