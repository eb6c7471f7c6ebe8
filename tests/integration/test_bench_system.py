"""``hetd bench --suite system``: the files it writes, and that its no-compute senders' pushes really
reach the model through the real daemon (real websockets on loopback, real peer processes)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hetd.bench.system import (
    SystemOptions,
    check_system,
    hetd_cell,
    make_daemon,
    synthetic_shapes,
)
from hetd.bench.system_peers import PeerPool
from hetd.cli.bench import main
from hetd.server.metrics import Metrics

pytestmark = pytest.mark.slow  # a real daemon on loopback (and real worker processes)


def test_a_tiny_run_writes_system_json_in_its_schema_and_a_table(tmp_path: Path) -> None:
    out = tmp_path / "sys"
    code = main(
        [
            "bench",
            "--suite",
            "system",
            "--out",
            str(out),
            "--params",
            "200000",
            "--codecs",
            "int8",
            "--senders",
            "1",
            "--seconds",
            "1",
            "--latency-workers",
            "12",
            "--startup-workers",
            "1",
            "--big-params",
            "300000",
            "--no-shm",  # (the shared-memory path: the test below)
            "--quiet",
        ]
    )
    assert code == 0
    doc = json.loads((out / "system.json").read_text())
    check_system(doc)
    row, *big = doc["throughput"]
    assert (row["params"], row["codec"], row["workers"]) == (199_010, "int8", 1)
    # the big-model rows (part big): one sender, int8 and none, with the process's peak RSS
    assert [(r["params"], r["codec"], r["workers"]) for r in big] == [
        (299_010, "int8", 1),
        (299_010, "none", 1),
    ]
    assert all(r["updates_per_s"] > 0 and r["rss_mb"] > 0 for r in big)
    assert row["updates_per_publish"] >= 1
    assert row["updates_per_s"] > 0 and row["limit_updates_per_s"] > 0
    assert row["fraction_of_limit"] == pytest.approx(
        row["updates_per_s"] / row["limit_updates_per_s"], rel=0.01
    )
    assert doc["engine_latency"]["connected"] == 12
    assert 0 < doc["engine_latency"]["p50_ms"] <= doc["engine_latency"]["p99_ms"]
    assert doc["startup"]["workers"] == 1 and doc["startup"]["seconds_to_first_update"] > 0
    assert doc["startup"]["cold_seconds_to_first_update"] > 0  # a first start, empty cache
    md = (out / "system.md").read_text()
    assert row["transport"] == "ws"
    assert "| 199,010 | int8 | 1 | ws |" in md and "Engine latency" in md and "Start-up" in md


def test_check_system_names_what_is_wrong() -> None:
    good = {
        "setup": {},
        "throughput": [
            {
                "params": 10,
                "codec": "none",
                "workers": 1,
                "updates_per_s": 1.0,
                "mb_in_per_s": 1.0,
                "mb_out_per_s": 1.0,
                "limit_updates_per_s": 2.0,
                "fraction_of_limit": 0.5,
            }
        ],
    }
    check_system(good)
    bad = json.loads(json.dumps(good))
    del bad["throughput"][0]["fraction_of_limit"]
    with pytest.raises(ValueError, match="fraction_of_limit"):
        check_system(bad)
    bad = json.loads(json.dumps(good))
    bad["engine_latency"] = {"connected": 256, "p50_ms": 0.1, "p99_ms": float("nan")}
    with pytest.raises(ValueError, match="p99_ms"):
        check_system(bad)


async def test_every_push_of_the_no_compute_sender_is_applied(tmp_path: Path) -> None:
    shapes = synthetic_shapes(200_000)
    daemon = make_daemon(shapes, "int8")
    await daemon.start()
    pool = PeerPool(1)
    try:
        engine = daemon.engine
        v0 = engine.store.version
        opts = SystemOptions(out=tmp_path, seconds=1.0)
        tally, [report] = await hetd_cell(daemon, pool, shapes, "int8", 1, opts)
        assert report.error is None
        assert report.pushes > 10
        # Every push was acked as applied, and the model moved by exactly that many versions.
        assert report.applied == report.pushes
        assert engine.store.version - v0 == report.pushes
        assert engine.applier.updates_applied == report.pushes
        assert tally.updates > 0 and tally.rates()["updates_per_s"] > 0
        # The same figures are live for operators: /v1/status and /metrics.
        await engine.queue.call(engine.tick)
        status = await engine.queue.call(engine.status)
        assert status["throughput"]["updates_per_s"] > 0
        assert status["engine_latency"]["p99_ms"] is not None
        metrics = Metrics(engine)
        await engine.queue.call(metrics.sample)
        text = metrics.render().decode()
        assert "hetd_updates_per_second" in text
        assert 'hetd_engine_latency_seconds{quantile="0.99"}' in text
        # The same through shared memory: every push read from the sender's ring and applied.
        v0, read = engine.store.version, daemon.shm.pushes_read
        tally, [report] = await hetd_cell(daemon, pool, shapes, "int8", 1, opts, 1.0, shm=True)
        assert report.error is None and report.extra["shm"] and report.pushes > 10
        assert report.applied == report.pushes == engine.store.version - v0
        # (its first push may answer the parameters of its join, sent before the offer)
        assert report.pushes - 1 <= daemon.shm.pushes_read - read <= report.pushes
        assert daemon.shm.frames_written > 0
    finally:
        pool.close()
        await daemon.stop(final_checkpoint=False)
