"""Profiling helpers as tables: robust means, drift on a 40 % change and not on 10 % noise, the
per-worker tracks that ``adsp`` and ``ashl`` fold events into.

The engine's contract these follow: on a Push the pusher's facts already count it; on a Leave the
leaver is already gone from the view.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import pytest

from policies.profiling import (
    Profile,
    ProfilingConfig,
    SpeedTracker,
    WorkerTrack,
    comm_estimate,
    drift_detected,
    drifted,
    init_tracks,
    track,
    trimmed_mean,
)
from policies.types import ClusterView, Join, Leave, Push, Tick, WorkerFacts


def facts(w: int, **kw: Any) -> WorkerFacts:
    base: dict[str, Any] = {"clock": 0, "version": 0, "waiting": True, "joined_at": 0.0}
    return WorkerFacts(worker=w, name=f"w{w}", **{**base, **kw})


def view_of(fs: Mapping[int, WorkerFacts], now: float = 0.0) -> ClusterView:
    return ClusterView(now=now, version=0, workers=dict(fs), global_batch=96)


def push(w: int, per_sample: float, samples: int = 32, now: float = 1.0) -> Push:
    return Push(now, w, 0, "grad", samples, 1, per_sample * samples, 1.0)


TRIMMED = [
    ("5 samples, 20 %: the middle 3", [9.0, 1.0, 2.0, 3.0, 100.0], 0.2, (2 + 3 + 9) / 3),
    ("10 samples, 20 %: drop 2 each end", [float(x) for x in range(1, 11)], 0.2, 5.5),
    ("trim 0 is the mean", [1.0, 2.0, 6.0], 0.0, 3.0),
    ("one sample", [5.0], 0.2, 5.0),
    ("two samples keep both", [1.0, 2.0], 0.4, 1.5),
    ("one value always remains", [1.0, 2.0, 30.0], 0.49, 2.0),
]


@pytest.mark.parametrize(
    ("xs", "trim", "want"), [r[1:] for r in TRIMMED], ids=[r[0] for r in TRIMMED]
)
def test_trimmed_mean(xs: list[float], trim: float, want: float) -> None:
    assert trimmed_mean(xs, trim) == pytest.approx(want)


@pytest.mark.parametrize(("xs", "trim"), [([], 0.2), ([1.0], 0.5), ([1.0], -0.1)])
def test_trimmed_mean_rejects(xs: list[float], trim: float) -> None:
    with pytest.raises(ValueError, match=r"trim|profile"):
        trimmed_mean(xs, trim)


DRIFT = [
    ("40 % slower", 1.0, 1.4, True),
    ("40 % faster", 1.0, 0.6, True),
    ("10 % noise", 1.0, 1.1, False),
    ("25 % is below 30 %", 1.0, 1.25, False),
    ("35 % is above", 2.0, 2.7, True),
    ("no reference", 0.0, 5.0, False),
]


@pytest.mark.parametrize(("old", "new", "want"), [r[1:] for r in DRIFT], ids=[r[0] for r in DRIFT])
def test_drifted(old: float, new: float, want: bool) -> None:
    assert drifted(old, new) is want
    assert drifted(Profile(old), Profile(new)) is want


def test_drifted_threshold_is_a_parameter() -> None:
    assert drifted(1.0, 1.1, threshold=0.05)
    assert not drifted(1.0, 1.4, threshold=0.5)


def test_speed_tracker_is_an_ewma_with_a_window() -> None:
    t = SpeedTracker()
    for x in (1.0, 3.0, 3.0):
        t = t.observe(x, alpha=0.5, window=2)
    assert t.ewma == pytest.approx(2.5)  # 1 -> 2 -> 2.5
    assert t.recent == (3.0, 3.0)


def test_comm_estimate_from_facts() -> None:
    assert comm_estimate(facts(1)) == (0.0, 0.0)
    assert comm_estimate(facts(1, push_bytes=1e6, link_bps=1e7)) == (0.1, 0.1)
    assert comm_estimate(facts(1, push_bytes=1e6, link_bps=1e7), factor=6) == (0.6, 0.6)


def run_pushes(
    xs: list[float], cfg: ProfilingConfig, fs: WorkerFacts | None = None
) -> tuple[WorkerTrack, list[str]]:
    """Push per-sample times ``xs`` from worker 1; return its track and what changed per push."""
    v = view_of({1: fs or facts(1)})
    tracks, _ = track({}, Join(0.0, 1), v, cfg)
    seen = []
    for i, x in enumerate(xs):
        tracks, ch = track(tracks, push(1, x, now=float(i + 1)), v, cfg)
        seen.append("profiled" if ch.profiled else "drift" if ch.drifted else "")
    return tracks[1], seen


def test_profile_from_five_pushes_drops_the_slow_first_push() -> None:
    xs = [0.5, 0.011, 0.010, 0.009, 0.010]  # the first one compiles
    t, seen = run_pushes(xs, ProfilingConfig(), facts(1, push_bytes=2e5, link_bps=1e6))
    assert seen == ["", "", "", "", "profiled"]
    assert t.profile is not None
    assert t.profile.sample_s == pytest.approx(0.0103333, rel=1e-4)
    assert (t.profile.push_s, t.profile.pull_s, t.profile.source) == (0.2, 0.2, "pushes")
    assert t.speed.ewma == t.profile.sample_s  # the EWMA restarts at the robust value


def test_profile_length_is_configurable() -> None:
    _, seen = run_pushes([1.0] * 3, ProfilingConfig(pushes=3))
    assert seen == ["", "", "profiled"]


def test_drift_fires_on_a_lasting_40_percent_change() -> None:
    xs = [1.0] * 5 + [1.4] * 6
    t, seen = run_pushes(xs, ProfilingConfig())
    assert seen.index("drift") == 7  # the third slow push
    assert seen.count("drift") == 1  # and once: the new profile is the new speed
    assert t.profile is not None and t.profile.sample_s == pytest.approx(1.4)
    assert t.profile.source == "drift"


def test_drift_fires_when_faster_too() -> None:
    _, seen = run_pushes([1.0] * 5 + [0.6] * 4, ProfilingConfig())
    assert seen.count("drift") == 1


def test_no_drift_on_10_percent_noise() -> None:
    rng = random.Random(7)
    xs = [1.0] * 5 + [1.0 + rng.uniform(-0.1, 0.1) for _ in range(300)]
    _, seen = run_pushes(xs, ProfilingConfig())
    assert "drift" not in seen


def test_no_drift_on_a_single_10x_spike() -> None:
    _, seen = run_pushes([1.0] * 8 + [10.0] + [1.0] * 8, ProfilingConfig())
    assert "drift" not in seen


def test_drift_detected_needs_both_ewma_and_median() -> None:
    cfg = ProfilingConfig()
    p = Profile(1.0)
    spike = WorkerTrack(p, SpeedTracker(5.5, (1.0, 1.0, 10.0)))
    lasting = WorkerTrack(p, SpeedTracker(1.35, (1.4, 1.4, 1.4)))
    assert not drift_detected(spike, cfg)
    assert drift_detected(lasting, cfg)
    assert not drift_detected(WorkerTrack(None, lasting.speed), cfg)


def test_track_follows_joins_and_leaves() -> None:
    cfg = ProfilingConfig()
    tracks, ch = track({}, Join(0.0, 1), view_of({1: facts(1), 2: facts(2)}), cfg)
    assert ch.joined == (1, 2) and set(tracks) == {1, 2}
    tracks, ch = track(tracks, Leave(1.0, 2), view_of({1: facts(1)}), cfg)
    assert ch.left == (2,) and ch.replan and set(tracks) == {1}
    assert ch.reason() == "left 2"


@dataclass(frozen=True, slots=True)
class ProfiledFacts(WorkerFacts):
    """Facts as the engine will have them once it runs the ``profile`` exchange."""

    profile: Mapping[str, float] | None = None


def test_engine_profile_is_used_as_soon_as_it_appears() -> None:
    cfg = ProfilingConfig(comm_factor=2.0)
    tracks, ch = track({}, Join(0.0, 1), view_of({1: facts(1)}), cfg)
    assert ch.joined == (1,)
    engine = {"sample_s": 0.002, "push_s": 0.01, "pull_s": 0.02, "compress_s": 0.003}
    fs = ProfiledFacts(1, "w1", 0, 0, True, 0.0, profile=engine)
    tracks, ch = track(tracks, Tick(0.5), view_of({1: fs}), cfg)
    assert ch.profiled == (1,)
    assert tracks[1].profile == Profile(0.002, 0.02, 0.04, 0.003, 0.5, "engine")


def test_engine_ewma_is_not_a_profile_except_on_a_hot_swap() -> None:
    cfg = ProfilingConfig()
    v = view_of({1: facts(1, sample_s=0.5)})
    tracks, ch = track({}, Join(0.0, 1), v, cfg)
    assert ch.joined == (1,) and tracks[1].profile is None  # one push's EWMA is no profile
    swapped = init_tracks(v, cfg)
    assert swapped[1].profile is not None and swapped[1].profile.source == "facts"


def test_a_swap_times_a_worker_that_has_pushed_by_its_pushes_keeping_the_profile_link() -> None:
    """A join-time profile read while other workers compiled (x4.5 slow) gives way to the pushes'
    speed when a policy is built on a running cluster; the link and compression stay the
    profile's. Without pushes, and for a policy already running, the profile stands."""
    cfg = ProfilingConfig()
    engine = {"sample_s": 0.0045, "push_s": 0.01, "pull_s": 0.02, "compress_s": 0.003}
    pushed = ProfiledFacts(1, "w1", 9, 9, True, 0.0, sample_s=0.001, samples=288, profile=engine)
    fresh = ProfiledFacts(2, "w2", 0, 0, True, 0.0, profile=engine)
    swapped = init_tracks(view_of({1: pushed, 2: fresh}, now=3.0), cfg)
    assert swapped[1].profile == Profile(0.001, 0.01, 0.02, 0.003, 3.0, "measured")
    assert swapped[2].profile == Profile(0.0045, 0.01, 0.02, 0.003, 3.0, "engine")
    tracks, ch = track({}, Tick(3.0), view_of({1: pushed}), cfg)
    assert ch.profiled == (1,) and tracks[1].profile is not None
    assert tracks[1].profile.source == "engine"


@pytest.mark.parametrize(
    ("kw", "word"),
    [
        ({"pushes": 0}, "profile_pushes"),
        ({"trim": 0.5}, "trim"),
        ({"drift": 0.0}, "drift"),
        ({"patience": True}, "drift_patience"),
        ({"alpha": 0.0}, "alpha"),
        ({"comm_factor": -1.0}, "comm_factor"),
    ],
)
def test_profiling_config_rejects(kw: dict[str, Any], word: str) -> None:
    with pytest.raises(ValueError, match=word):
        ProfilingConfig(**kw)
