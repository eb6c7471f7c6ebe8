"""``hetd bench --suite soak`` machinery: a real daemon, light protocol-v1 workers, the daemon's
memory sampled; a short run here (the real soak is minutes long and a benchmark, not a test)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from hetd.bench.soak import SoakOptions, growth, run_soak

pytestmark = pytest.mark.slow  # a real daemon on loopback (and real worker processes)


def test_growth_is_measured_after_the_warm_up() -> None:
    samples = [
        {"t_s": 0.0, "rss_bytes": 100},
        {"t_s": 59.0, "rss_bytes": 300},  # warming up: not counted
        {"t_s": 60.0, "rss_bytes": 400},
        {"t_s": 120.0, "rss_bytes": 410},
        {"t_s": 180.0, "rss_bytes": 404},
    ]
    assert growth(samples) == 410 / 400 - 1
    assert growth(samples[:3]) is None  # one sample after the warm-up says nothing


def test_a_short_soak_loses_nothing_and_writes_its_report(tmp_path: Path) -> None:
    opts = SoakOptions(out=tmp_path, workers=3, minutes=0.15, sample_s=2.0)
    doc = asyncio.run(run_soak(opts))
    assert doc["pushes"] > 0 and doc["applied"] == doc["pushes"]  # asp applies every push
    assert doc["errors"] == {"peers_with_error": [], "pushes_not_applied": 0, "workers_lost": 0}
    assert len(doc["samples"]) >= 2 and all(s["rss_bytes"] > 0 for s in doc["samples"])
    assert json.loads((tmp_path / "soak.json").read_text())["workers"] == 3
    assert "RSS growth" in (tmp_path / "soak.md").read_text()


def test_the_cli_refuses_a_soak_without_workers(capsys) -> None:  # type: ignore[no-untyped-def]
    from hetd.cli.bench import main

    assert main(["bench", "--suite", "soak", "--workers", "0", "--out", "unused"]) == 2
    assert "--workers must be >= 1" in capsys.readouterr().err
