"""The pure part of ``hetd bench --suite parity``: ranking, Kendall distance, the verdict."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import pytest

from hetd.bench.parity import Standing, compare, discordant_pairs, kendall_distance, ranks
from hetd.sim.scenario import load_scenario, replace

N = None  # never reached

# (sim standings, real standings, expected ranks sim, expected ranks real, Kendall distance)
# A standing is (median TTA s or None, median final accuracy).
CASES: list[tuple[str, dict[str, Standing], dict[str, Standing], str, str, int]] = [
    ("same order", {"a": (1, 0.9), "b": (2, 0.9), "c": (3, 0.9)},
     {"a": (1.5, 0.9), "b": (2.5, 0.9), "c": (9, 0.9)}, "abc", "abc", 0),
    ("one adjacent swap", {"a": (1, 0.9), "b": (2, 0.9), "c": (3, 0.9)},
     {"a": (1, 0.9), "b": (4, 0.9), "c": (3, 0.9)}, "abc", "acb", 1),
    ("two adjacent swaps", {"a": (1, 0.9), "b": (2, 0.9), "c": (3, 0.9), "d": (4, 0.9)},
     {"a": (2, 0.9), "b": (1, 0.9), "c": (4, 0.9), "d": (3, 0.9)}, "abcd", "badc", 2),
    ("first and last swapped", {"a": (1, 0.9), "b": (2, 0.9), "c": (3, 0.9)},
     {"a": (3, 0.9), "b": (2, 0.9), "c": (1, 0.9)}, "abc", "cba", 3),
    ("a tie is never discordant; ranks break it by accuracy",
     {"a": (2, 0.91), "b": (2, 0.95), "c": (3, 0.9)},
     {"a": (1, 0.9), "b": (2, 0.9), "c": (3, 0.9)}, "bac", "abc", 0),
    ("tie on accuracy too: the order given", {"a": (2, 0.9), "b": (2, 0.9)},
     {"a": (2, 0.9), "b": (2, 0.9)}, "ab", "ab", 0),
    ("never reached comes last, by final accuracy",
     {"a": (N, 0.85), "b": (5, 0.9), "c": (N, 0.88)},
     {"a": (N, 0.85), "b": (50, 0.9), "c": (N, 0.88)}, "bca", "bca", 0),
    ("never reached in real only: one swap",
     {"a": (1, 0.9), "b": (2, 0.9), "c": (3, 0.9)},
     {"a": (1, 0.9), "b": (N, 0.8), "c": (3, 0.9)}, "abc", "acb", 1),
    ("two never-reached swap on accuracy",
     {"a": (1, 0.9), "b": (N, 0.8), "c": (N, 0.7)},
     {"a": (1, 0.9), "b": (N, 0.7), "c": (N, 0.8)}, "abc", "acb", 1),
]  # fmt: skip


def order(r: dict[str, int]) -> str:
    return "".join(sorted(r, key=lambda p: r[p]))


@pytest.mark.parametrize(("sim", "real", "rank_sim", "rank_real", "dist"), [c[1:] for c in CASES])
def test_ranks_and_kendall_distance(
    sim: dict[str, Standing],
    real: dict[str, Standing],
    rank_sim: str,
    rank_real: str,
    dist: int,
) -> None:
    for standings, expected in ((sim, rank_sim), (real, rank_real)):
        r = ranks(standings)
        assert sorted(r.values()) == list(range(1, len(standings) + 1))  # a permutation
        assert order(r) == expected
    assert kendall_distance(sim, real) == kendall_distance(real, sim) == dist
    assert len(discordant_pairs(sim, real)) == dist


def test_discordant_pair_names_the_sim_winner_first() -> None:
    sim: dict[str, Standing] = {"bsp": (2, 0.9), "asp": (3, 0.9)}
    real: dict[str, Standing] = {"bsp": (4, 0.9), "asp": (3, 0.9)}
    assert discordant_pairs(sim, real) == [["bsp", "asp"]]


def doc(rows: Mapping[str, tuple[Sequence[float | None], float | None]]) -> dict[str, Any]:
    """A results.json document: policy -> (TTA per seed, median TTA as summarize gives it)."""
    runs = [
        {"policy": p, "seed": i, "lr": 0.1, "tta_s": t}
        for p, (ttas, _) in rows.items()
        for i, t in enumerate(ttas)
    ]
    bsp = rows["bsp"][1] if "bsp" in rows else None
    summary = [
        {
            "policy": p,
            "tta_median_s": med,
            "speedup_vs_bsp": bsp / med if bsp is not None and med else None,
            "final_accuracy_median": 0.9,
        }
        for p, (_, med) in rows.items()
    ]
    return {"runs": runs, "summary": summary}


@pytest.mark.parametrize(
    ("real_asp", "real_ssp", "agrees", "within"),
    [
        ((4.0, 5.0, 6.0), (6.0, 6.0, 7.0), True, True),  # same order, ratios <= 1.2
        ((5.5, 5.5, 5.5), (5.0, 5.0, 5.0), True, False),  # asp, ssp swap; asp x1.375
        ((9.0, 9.0, 9.0), (8.0, 8.0, 8.0), False, False),  # the order reversed: distance 3
    ],
)
def test_compare_ratio_speedup_and_verdict(
    real_asp: tuple[float, ...], real_ssp: tuple[float, ...], agrees: bool, within: bool
) -> None:
    sim = doc({"bsp": ([6.0, 6.0, 6.0], 6.0), "asp": ([4.0] * 3, 4.0), "ssp": ([5.0] * 3, 5.0)})
    real_rows = {
        "bsp": ([6.0, 6.5, 7.0], 6.5),
        "asp": (list(real_asp), sorted(real_asp)[1]),
        "ssp": (list(real_ssp), sorted(real_ssp)[1]),
    }
    sc = replace(load_scenario("S1"), budget_s=10.0)
    out = compare(sim, doc(real_rows), sc, 3)
    for p, x in out["policies"].items():
        assert x["ratio"] == pytest.approx(x["real"]["tta_median_s"] / x["sim"]["tta_median_s"])
        assert x["real"]["tta_s"] == real_rows[p][0]
    asp = out["policies"]["asp"]["real"]
    assert (asp["tta_min_s"], asp["tta_max_s"]) == (min(real_asp), max(real_asp))
    assert out["policies"]["asp"]["sim"]["speedup_vs_bsp"] == pytest.approx(1.5)
    v = out["verdict"]
    assert (v["ranking_agrees"], v["within_band"]) == (agrees, within)
    assert v["largest_ratio"]["ratio"] == max(x["ratio"] for x in out["policies"].values())
    assert (v["scenario"], v["budget_s"], v["seeds"]) == ("S1", 10.0, 3)
    assert ("agrees" if agrees else "disagrees") in v["sentence"]


def test_never_reached_in_one_mode_has_no_ratio_and_fails_the_band() -> None:
    sim = doc({"bsp": ([6.0], 6.0), "asp": ([4.0], 4.0)})
    real = doc({"bsp": ([6.0], 6.0), "asp": ([None], None)})
    out = compare(sim, real, load_scenario("S1"), 1)
    assert out["policies"]["asp"]["ratio"] is None
    assert out["policies"]["asp"]["real"]["tta_max_s"] is None
    assert out["policies"]["asp"]["rank"] == {"sim": 1, "real": 2}
    v = out["verdict"]
    assert v["reached_in_one_mode_only"] == ["asp"] and not v["within_band"]
    assert v["ranking_agrees"] and v["rank_distance"] == 1
    assert "one mode only: asp" in v["sentence"]


def test_the_evaluation_grid_reading_is_there_for_older_tables() -> None:
    from hetd.bench.parity import parity_markdown

    sim = doc({"bsp": ([6.0], 6.0), "asp": ([4.2], 4.2)})
    real = doc({"bsp": ([6.0], 6.0), "asp": ([3.6], 3.6)})
    curves = {"bsp": [[5.5, 0.8], [6.5, 0.95]], "asp": [[3.5, 0.85], [4.0, 0.91]]}
    for d in (sim, real):
        for r in d["runs"]:
            r["curve"] = curves[r["policy"]]
    out = compare(sim, real, load_scenario("S1"), 1)  # target 0.90
    asp = out["policies"]["asp"]
    assert asp["real"]["tta_grid_s"] == [4.0] and asp["real"]["tta_grid_median_s"] == 4.0
    assert out["policies"]["bsp"]["sim"]["tta_grid_median_s"] == 6.5
    assert "| 4.00 / 4.00 |" in parity_markdown({**out, "links": "emulated"})
    # no curves (documents from before they were kept): no grid reading, nothing invented
    bare = compare(doc({"bsp": ([6.0], 6.0)}), doc({"bsp": ([6.0], 6.0)}), load_scenario("S1"), 1)
    assert "tta_grid_s" not in bare["policies"]["bsp"]["sim"]
