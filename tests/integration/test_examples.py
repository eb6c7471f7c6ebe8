"""Each example in ``examples/`` trained to its own target by a real daemon and two real
``hetd-worker`` processes, each under another policy, as a user runs them (the README's commands:
``hetd serve --task examples/X.py:task`` and ``hetd-worker URL --task examples/X.py:task``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.conftest import Cluster

pytestmark = pytest.mark.slow

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


# tiny_gpt's evaluation (the held-out text through the transformer) takes 0.2 s of a core: the
# daemon evaluates it at its default interval (1 s), not the tests' 0.5 s, and leaves the cores to
# the workers.
@pytest.mark.parametrize(
    ("example", "policy", "params", "train"),
    [
        ("digits_cnn", "ssp", {"staleness": 3}, {}),
        ("tiny_gpt", "asp", {}, {"eval_interval_s": 1.0}),
        ("regression", "bsp", {}, {}),
        ("linen_mlp", "lbbsp", {}, {}),
    ],
)
async def test_an_example_reaches_its_target(
    cluster: Any, example: str, policy: str, params: dict[str, Any], train: dict[str, Any]
) -> None:
    spec = f"{EXAMPLES / example}.py:task"
    c: Cluster = await cluster(policy, params, task=spec, **train)
    assert c.engine.evaluations.target is not None
    for slowdown in (1.0, 1.5):
        await c.spawn(slowdown, 0.0, "--task", spec)
    await c.wait_for(
        lambda: c.engine.evaluations.target_at is not None,
        300,
        f"{example}'s target {c.engine.evaluations.target}",
    )
    metric = c.engine.evaluations.target.metric
    reached = [
        m[metric] for _, m in c.engine.evaluations.history if c.engine.evaluations.target.reached(m)
    ]
    assert reached, c.engine.evaluations.history[-3:]
