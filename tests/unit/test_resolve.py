"""``resolve``: the rules that turn one event's decisions into what the engine carries out, as a
table (decisions in -> plans, scale, actions out), plus the errors it raises on policy bugs."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest

from policies import (
    Apply,
    Buffer,
    Decision,
    Drop,
    Flush,
    Release,
    Resolved,
    RestartOptimizer,
    Scale,
    SetPlan,
    SetStage,
    resolve,
)

# (label, decisions, plans, scale, actions)
ROWS: list[tuple[str, Sequence[Decision], tuple[Any, ...], float, tuple[Any, ...]]] = [
    ("empty input", [], (), 1.0, ()),
    ("one apply", [Apply(0.5)], (), 1.0, (Apply(0.5),)),
    (
        "scale factors multiply, wherever they come",
        [Scale(0.5), Apply(1.0), Scale(0.25), Scale(2.0)],
        (),
        0.25,
        (Apply(1.0),),
    ),
    ("scales alone: no push decision", [Scale(3.0), Scale(0.5)], (), 1.5, ()),
    (
        "the first push decision wins; later ones are ignored",
        [Buffer(32.0, group=4), Apply(1.0), Drop("late"), Buffer(1.0)],
        (),
        1.0,
        (Buffer(32.0, group=4),),
    ),
    (
        "a first drop wins over a later apply",
        [Drop("too stale"), Apply(1.0)],
        (),
        1.0,
        (Drop("too stale"),),
    ),
    (
        "plans come before releases, in their own order",
        [Release(1), SetPlan(1, {"batch_size": 48}), SetStage("SHL"), Release(2)],
        (SetPlan(1, {"batch_size": 48}), SetStage("SHL")),
        1.0,
        (Release(1), Release(2)),
    ),
    (
        "flushes and releases keep their order, the push decision in its place",
        [Flush(upto=1), Buffer(8.0, 2), Release(3), Flush(), Apply(9.0), Release(1)],
        (),
        1.0,
        (Flush(upto=1), Buffer(8.0, 2), Release(3), Flush(), Release(1)),
    ),
    (
        "a gate composed with a weight rule and a planner",
        [Apply(0.25), Release(2), Scale(0.5), SetPlan(2, {"lr_scale": 0.5, "pipeline": True})],
        (SetPlan(2, {"lr_scale": 0.5, "pipeline": True}),),
        0.5,
        (Apply(0.25), Release(2)),
    ),
    (
        "an optimizer restart keeps its place: after the flush, before the releases",
        [Flush(), RestartOptimizer(), SetStage("main"), Release(2)],
        (SetStage("main"),),
        1.0,
        (Flush(), RestartOptimizer(), Release(2)),
    ),
    (
        "a release twice is kept twice (releasing a worker not waiting does nothing)",
        [Release(1), Release(1)],
        (),
        1.0,
        (Release(1), Release(1)),
    ),
]


@pytest.mark.parametrize(
    ("decisions", "plans", "scale", "actions"), [r[1:] for r in ROWS], ids=[r[0] for r in ROWS]
)
def test_resolve_table(
    decisions: Sequence[Decision],
    plans: tuple[Any, ...],
    scale: float,
    actions: tuple[Any, ...],
) -> None:
    r = resolve(decisions)
    assert r == Resolved(plans, scale, actions)
    pushes = [a for a in actions if isinstance(a, Apply | Buffer | Drop)]
    assert r.push == (pushes[0] if pushes else None)


def test_resolve_takes_any_iterable() -> None:
    assert resolve(iter([Apply(1.0), Release(1)])).actions == (Apply(1.0), Release(1))


@pytest.mark.parametrize(
    ("fields", "words"),
    [
        ({"batch_sise": 32}, ["batch_sise", "batch_size"]),  # a typo names the real fields
        ({"colour": "red", "lr_scale": 1.0}, ["colour"]),
        ({"batch_size": "32"}, ["batch_size", "int"]),
        ({"pipeline": 1}, ["pipeline", "bool"]),
        ({"push_kind": "sideways"}, ["push_kind", "delta"]),
    ],
)
def test_a_bad_set_plan_is_a_policy_bug(fields: dict[str, Any], words: list[str]) -> None:
    with pytest.raises(ValueError) as info:
        resolve([Apply(1.0), SetPlan(1, fields)])
    for word in words:
        assert word in str(info.value)


def test_something_that_is_not_a_decision_raises() -> None:
    with pytest.raises(TypeError, match="not a decision"):
        resolve([Apply(1.0), "release everyone"])  # type: ignore[list-item]
