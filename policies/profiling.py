"""Measured worker speed for adaptive policies (docs/policies.md): robust profiles,
an EWMA speed tracker, drift detection, and the per-worker bookkeeping ``adsp`` and ``ashl`` share.

Owns: :func:`trimmed_mean`, :class:`Profile` (one worker's measured costs), :func:`drifted`,
:class:`SpeedTracker`, and :func:`track`, which folds one event into the per-worker
:class:`WorkerTrack` map and says who joined, left, got a profile, or drifted.

Where a profile comes from, in order of preference:

1. the engine's facts, once it runs a ``profile`` exchange with a joining worker: a mapping
   ``WorkerFacts.profile`` with keys ``sample_s``, ``push_s``, ``pull_s``, ``compress_s`` (seconds);
2. the engine's EWMA ``WorkerFacts.sample_s`` (a policy swapped into a running cluster: the
   pushes' speed then replaces a join-time profile's, which may have been read while the other
   workers compiled, :func:`profile_from_facts`);
3. the pushes themselves: ``pushes`` ASP-style pushes, per-sample time ``compute_s / samples``,
   trimmed mean; communication from ``push_bytes / link_bps`` when the facts have both.

Pure: no I/O, no clock (times come from events), state replaced, never mutated.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any, TypeVar

from policies.types import ClusterView, Event, Push, WorkerFacts

K = TypeVar("K")
V = TypeVar("V")

MIN_SAMPLE_S = 1e-9  # s; a floor so a zero measurement cannot make a planner divide by zero


def freeze(d: Mapping[K, V]) -> Mapping[K, V]:
    """A read-only copy of ``d`` (state fields are never mutated in place)."""
    return MappingProxyType(dict(d))


def is_int(x: object, lo: int) -> bool:
    """``x`` is an int (not a bool) and ``>= lo``: for validating factory parameters."""
    return isinstance(x, int) and not isinstance(x, bool) and x >= lo


def trimmed_mean(xs: Sequence[float], trim: float = 0.2) -> float:
    """Mean of ``xs`` after dropping ``floor(trim * n)`` of the smallest and of the largest values.

    At least one value always remains. The ASHL code drops the 20 largest and 20 smallest of its
    samples; a fraction works for short profiles as well (5 samples, ``trim=0.2``: the middle 3).
    """
    if not 0.0 <= trim < 0.5:
        raise ValueError(f"trim must be in [0, 0.5), got {trim!r}")
    if not xs:
        raise ValueError("trimmed_mean of no samples: profile at least one push first")
    s = sorted(xs)
    k = min(int(len(s) * trim), (len(s) - 1) // 2)
    kept = s[k : len(s) - k]
    return sum(kept) / len(kept)


@dataclass(frozen=True, slots=True)
class Profile:
    """One worker's measured costs (§10 stage P: c_i per sample, u_i, d_i, z_i)."""

    sample_s: float  # s of compute per sample; the per-step time is sample_s * batch
    push_s: float = 0.0  # s, one uncompressed push, send -> PS arrival (u_i)
    pull_s: float = 0.0  # s, one parameter reply (d_i)
    compress_s: float = 0.0  # s per push spent compressing (z_i)
    at: float = 0.0  # s, engine clock when measured
    source: str = "pushes"  # "pushes" | "engine" | "measured" | "facts" | "drift"

    def step_s(self, batch: int) -> float:
        """Seconds of compute for one local step of ``batch`` samples."""
        return self.sample_s * max(1, batch)

    def shifted(self, dt: float) -> Profile:
        """The same profile with its engine-clock time moved by ``dt`` s (a checkpoint restored
        under another clock)."""
        return replace(self, at=self.at + dt)


def drifted(old: float | Profile, new: float | Profile, threshold: float = 0.3) -> bool:
    """True when the per-sample time moved by more than ``threshold`` (relative) from ``old``."""
    a = old.sample_s if isinstance(old, Profile) else old
    b = new.sample_s if isinstance(new, Profile) else new
    if not (a > 0 and math.isfinite(a) and math.isfinite(b)):
        return False
    return abs(b - a) / a > threshold


@dataclass(frozen=True, slots=True)
class SpeedTracker:
    """EWMA of one worker's per-sample compute time, plus its last few raw samples."""

    ewma: float | None = None  # s per sample
    recent: tuple[float, ...] = ()  # s per sample, the last ``window`` pushes, oldest first

    def observe(self, x: float, alpha: float = 0.5, window: int = 10) -> SpeedTracker:
        """Fold in one per-sample time."""
        e = x if self.ewma is None else alpha * x + (1.0 - alpha) * self.ewma
        return SpeedTracker(e, (*self.recent, x)[-window:])


@dataclass(frozen=True, slots=True)
class ProfilingConfig:
    """How profiles are taken and when they are considered stale."""

    pushes: int = 5  # pushes per worker in a profile taken from pushes
    trim: float = 0.2  # fraction dropped at each end of the profile samples
    drift: float = 0.3  # relative change of the speed that triggers a new profile
    patience: int = 3  # the median of this many last pushes must also have drifted
    alpha: float = 0.5  # EWMA weight of a new sample (docs/policies.md)
    comm_factor: float = 1.0  # multiplies u_i and d_i (the ASHL code uses 6; §10)

    def __post_init__(self) -> None:
        if not is_int(self.pushes, 1):
            raise ValueError(f"profile_pushes must be an int >= 1, got {self.pushes!r}")
        if not 0.0 <= self.trim < 0.5:
            raise ValueError(f"trim must be in [0, 0.5), got {self.trim!r}")
        if not self.drift > 0:
            raise ValueError(f"drift must be > 0 (0.3 means 30 %), got {self.drift!r}")
        if not is_int(self.patience, 1):
            raise ValueError(f"drift_patience must be an int >= 1, got {self.patience!r}")
        if not 0.0 < self.alpha <= 1.0:
            raise ValueError(f"alpha must be in (0, 1], got {self.alpha!r}")
        if not (self.comm_factor >= 0 and math.isfinite(self.comm_factor)):
            raise ValueError(f"comm_factor must be >= 0, got {self.comm_factor!r}")

    @property
    def window(self) -> int:
        """Raw samples kept per worker."""
        return max(self.pushes, self.patience)


def profiling_of(cfg: Any) -> ProfilingConfig:
    """The profiling part of a policy's configuration: its ``profile_pushes``, ``trim``, ``drift``,
    ``drift_patience``, ``alpha`` and ``comm_factor`` (the names ``adsp`` and ``ashl`` share)."""
    return ProfilingConfig(
        cfg.profile_pushes, cfg.trim, cfg.drift, cfg.drift_patience, cfg.alpha, cfg.comm_factor
    )


@dataclass(frozen=True, slots=True)
class WorkerTrack:
    """What a policy knows about one worker's speed."""

    profile: Profile | None = None  # None while it is being profiled
    speed: SpeedTracker = field(default_factory=SpeedTracker)
    pushes: int = 0  # pushes observed since it joined

    def shifted(self, dt: float) -> WorkerTrack:
        """The same track with its engine-clock times moved by ``dt`` s."""
        return self if self.profile is None else replace(self, profile=self.profile.shifted(dt))


def shift_tracks(tracks: Mapping[int, WorkerTrack], dt: float) -> Mapping[int, WorkerTrack]:
    """Tracks with their engine-clock times moved by ``dt`` s (a checkpoint restored under another
    clock: times stay as long before now as they were before the checkpoint)."""
    return freeze({w: t.shifted(dt) for w, t in tracks.items()})


@dataclass(frozen=True, slots=True)
class Changes:
    """What one event changed in the tracks."""

    joined: tuple[int, ...] = ()  # new workers without a profile: give them a profiling plan
    left: tuple[int, ...] = ()
    profiled: tuple[int, ...] = ()  # got their first profile at this event
    drifted: tuple[int, ...] = ()  # their profile was replaced after a drift

    @property
    def replan(self) -> bool:
        """Whether the set of profiles changed."""
        return bool(self.left or self.profiled or self.drifted)

    def reason(self) -> str:
        """A short text for logs: ``"left 2; drift 1"``."""
        parts = [
            f"{word} {','.join(map(str, ws))}"
            for word, ws in (
                ("left", self.left),
                ("profiled", self.profiled),
                ("drift", self.drifted),
            )
            if ws
        ]
        return "; ".join(parts)


def comm_estimate(facts: WorkerFacts, factor: float = 1.0) -> tuple[float, float]:
    """(push_s, pull_s) from the facts: ``push_bytes / link_bps`` each way, or zeros when unknown.

    A reply carries the full model, like an uncompressed push, so d_i = u_i [D].
    """
    if facts.push_bytes is None or not facts.link_bps:
        return 0.0, 0.0
    u = factor * facts.push_bytes / facts.link_bps
    return u, u


def _num(m: Mapping[str, Any], key: str) -> float:
    v = m.get(key, 0.0)
    return float(v) if isinstance(v, int | float) and math.isfinite(v) and v >= 0 else 0.0


def profile_from_facts(
    facts: WorkerFacts, now: float, cfg: ProfilingConfig, use_ewma: bool = False
) -> Profile | None:
    """A profile the engine already has for this worker: its ``profile`` mapping, else (with
    ``use_ewma``, for a policy swapped into a running cluster) its EWMA ``sample_s``.

    With ``use_ewma`` a worker that has pushed is timed by its pushes even when it has a join-time
    profile: that profile is a few steps at the join, which on a shared host can run while the
    other workers compile (a x1 worker read 4.5x its speed at load 19-22), and the pushes since
    are what it really does. The profile's link and compression times stay (pushes carry no
    better ones). Source ``"measured"``."""
    # Filled by the engine's profile exchange once it exists; absent from older facts.
    engine = getattr(facts, "profile", None)
    measured = use_ewma and facts.samples > 0 and facts.sample_s is not None and facts.sample_s > 0
    if isinstance(engine, Mapping) and _num(engine, "sample_s") > 0:
        f = cfg.comm_factor
        return Profile(
            sample_s=max(facts.sample_s or 0.0, MIN_SAMPLE_S)
            if measured
            else _num(engine, "sample_s"),
            push_s=f * _num(engine, "push_s"),
            pull_s=f * _num(engine, "pull_s"),
            compress_s=_num(engine, "compress_s"),
            at=now,
            source="measured" if measured else "engine",
        )
    if use_ewma and facts.sample_s is not None and facts.sample_s > 0:
        u, d = comm_estimate(facts, cfg.comm_factor)
        return Profile(max(facts.sample_s, MIN_SAMPLE_S), u, d, 0.0, now, "facts")
    return None


def _from_pushes(t: WorkerTrack, facts: WorkerFacts, now: float, cfg: ProfilingConfig) -> Profile:
    u, d = comm_estimate(facts, cfg.comm_factor)
    c = trimmed_mean(t.speed.recent[-cfg.pushes :], cfg.trim)
    return Profile(max(c, MIN_SAMPLE_S), u, d, 0.0, now, "pushes")


def drift_detected(t: WorkerTrack, cfg: ProfilingConfig) -> bool:
    """The EWMA *and* the median of the last ``patience`` pushes moved the same way by more than
    ``drift``: a lasting change, not one slow push (a single 10x spike moves the EWMA but not
    the median)."""
    p, s = t.profile, t.speed
    if p is None or s.ewma is None or len(s.recent) < cfg.patience:
        return False
    m = statistics.median(s.recent[-cfg.patience :])
    same_way = (s.ewma > p.sample_s) == (m > p.sample_s)
    return same_way and drifted(p.sample_s, s.ewma, cfg.drift) and drifted(p.sample_s, m, cfg.drift)


def _rebase(t: WorkerTrack, now: float, cfg: ProfilingConfig) -> WorkerTrack:
    """A new profile at the drifted speed (the median of the last pushes); comm is kept."""
    if t.profile is None:
        return t
    m = max(statistics.median(t.speed.recent[-cfg.patience :]), MIN_SAMPLE_S)
    p = replace(t.profile, sample_s=m, at=now, source="drift")
    return replace(t, profile=p, speed=replace(t.speed, ewma=m))


def init_tracks(view: ClusterView, cfg: ProfilingConfig) -> Mapping[int, WorkerTrack]:
    """Tracks for the workers already in ``view``, profiled from the engine's facts when it has any
    (so a hot-swapped policy does not re-profile a running cluster)."""
    return freeze(
        {
            w: WorkerTrack(profile_from_facts(f, view.now, cfg, True))
            for w, f in view.workers.items()
        }
    )


def track(
    tracks: Mapping[int, WorkerTrack], event: Event, view: ClusterView, cfg: ProfilingConfig
) -> tuple[Mapping[int, WorkerTrack], Changes]:
    """Fold one event into the tracks, keeping them in step with the view's active workers."""
    new = dict(tracks)
    left = tuple(w for w in tracks if w not in view.workers)
    for w in left:
        del new[w]
    joined: list[int] = []
    profiled: list[int] = []
    drift: list[int] = []
    for w, f in view.workers.items():
        t = new.get(w)
        if t is None or t.profile is None:
            p = profile_from_facts(f, event.now, cfg)
            if p is not None:
                new[w] = replace(t or WorkerTrack(), profile=p)
                profiled.append(w)
            elif t is None:
                new[w] = WorkerTrack()
                joined.append(w)
    if isinstance(event, Push) and event.worker in new and event.samples > 0:
        w = event.worker
        x = max(0.0, event.compute_s) / event.samples
        t = new[w]
        t = replace(t, speed=t.speed.observe(x, cfg.alpha, cfg.window), pushes=t.pushes + 1)
        if t.profile is None and len(t.speed.recent) >= cfg.pushes:
            p = _from_pushes(t, view.workers[w], event.now, cfg)
            # The EWMA restarts at the robust value: a slow first push (jit) must not look like drift.
            t = replace(t, profile=p, speed=replace(t.speed, ewma=p.sample_s))
            profiled.append(w)
        elif drift_detected(t, cfg):
            t = _rebase(t, event.now, cfg)
            drift.append(w)
        new[w] = t
    changes = Changes(tuple(joined), left, tuple(profiled), tuple(drift))
    return freeze(new), changes


def profile_row(t: WorkerTrack) -> dict[str, Any]:
    """A track as plain values, for ``describe_state``."""
    p = t.profile
    return {
        "profiled": p is not None,
        "profile_source": None if p is None else p.source,
        "profiled_at": None if p is None else p.at,
        "sample_s": None if p is None else p.sample_s,
        "push_s": None if p is None else p.push_s,
        "pull_s": None if p is None else p.pull_s,
        "compress_s": None if p is None else p.compress_s,
        "speed_ewma_s": t.speed.ewma,
        "pushes_seen": t.pushes,
    }
