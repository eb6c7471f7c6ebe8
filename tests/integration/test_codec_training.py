"""Training with lossy codecs both ways (pushes and parameter deltas) still learns."""

from __future__ import annotations

import pytest

from hetd.protocol.messages import EMULATED_LINK

pytestmark = pytest.mark.slow


# Each path once: ("sign", "delta") sends both workers deltas whatever their link (two references
# kept, one per worker); ("int8", "auto") sends int8 pushes and int8 deltas to the worker on a slow
# link, full frames to the one on loopback. ("int8", "delta") ran the two paths again.
@pytest.mark.parametrize(("codec", "downlink"), [("sign", "delta"), ("int8", "auto")])
async def test_lossy_codecs_both_ways_beat_0_9_on_digits(
    cluster, codec: str, downlink: str
) -> None:  # type: ignore[no-untyped-def]
    c = await cluster("ssp", {"staleness": 3}, codec=codec, downlink=downlink)
    await c.spawn(1, 0.01)
    # The second worker emulates a 10 MB/s link: on loopback, it stands for a remote worker.
    await c.spawn(2, 0.01, "--emulate-bandwidth", "10MB/s")
    await c.wait_for(lambda: len(c.engine.members.facts) == 2, 60, "2 workers to join")
    # Both workers must have pushed: under load one may still be compiling when the other alone
    # has trained past 0.9 (ssp no longer waits for a joiner that has not pushed yet).
    await c.wait_for(
        lambda: (
            bool(c.engine.evaluations.evals)
            and c.engine.evaluations.evals[-1][2] > 0.9
            and all(row["pushes"] > 10 for row in c.engine.workers())
        ),
        150,
        "accuracy > 0.9 and more than 10 pushes from each worker",
    )
    n_params = c.engine.store.n_params
    for row in c.engine.workers():
        assert row["codec"] == codec
        # Pushes travel compressed: far below 4 bytes a parameter.
        assert row["bytes_in"] / row["pushes"] < (1.5 if codec == "int8" else 0.5) * n_params
        assert row["pushes"] > 10
        if downlink == "delta" or row["device"].get(EMULATED_LINK):
            # Parameters come back as deltas against what each worker holds: the two workers
            # run at different speeds (rarely at the same version), yet a release averages well
            # under a float32 copy (the first one is full). So does a worker on loopback that
            # emulates a slow link (the real-mode bench's workers), as a remote one would.
            assert row["pull_ratio"] < (0.5 if codec == "int8" else 0.25), row
        else:
            # Over loopback a delta saves no time, only daemon CPU: parameters go in full.
            assert row["pull_ratio"] > 0.9, row
    if downlink == "auto":  # one worker of each kind
        assert sorted(bool(r["device"].get(EMULATED_LINK)) for r in c.engine.workers()) == [
            False,
            True,
        ]
