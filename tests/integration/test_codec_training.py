"""Training with lossy codecs both ways (pushes and parameter deltas) still learns."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("codec", ["int8", "sign"])
async def test_lossy_codecs_both_ways_beat_0_9_on_digits(cluster, codec: str) -> None:  # type: ignore[no-untyped-def]
    c = await cluster("ssp", {"staleness": 3}, codec=codec)
    await c.spawn(1, 0.01)
    await c.spawn(2, 0.01)
    await c.wait_for(lambda: len(c.engine.facts) == 2, 60, "2 workers to join")
    await c.wait_for(
        lambda: bool(c.engine.evals) and c.engine.evals[-1][2] > 0.9, 120, "accuracy > 0.9"
    )
    n_params = c.engine.store.n_params
    for row in c.engine.workers():
        assert row["codec"] == codec
        # Pushes travel compressed: far below 4 bytes a parameter.
        assert row["bytes_in"] / row["pushes"] < (1.5 if codec == "int8" else 0.5) * n_params
