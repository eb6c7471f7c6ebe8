"""The timing twin's records (:mod:`policies.twin`): its configuration, what it found, one applied
push, its error, and the small statistics it reports them with. Apart from the loop
(:mod:`policies.twin_loop`) and its workers (:mod:`policies.twin_worker`), which fill them, and from
:func:`policies.twin.run_twin`, which hands them out."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from policies.efficiency import Efficiency, effective_samples


class TwinError(ValueError):
    """The twin cannot run this case: a worker without timing facts, or a decision it does not
    model (pipeline replicas). The message says which and what would make it runnable."""


REFERENCE_SAMPLES = 10_000.0  # the reference loss halves after this many applied samples [D]


def reference_loss(samples: float) -> float:
    """A stand-in training loss, ``1 / (1 + samples / REFERENCE_SAMPLES)`` [D]: it falls and
    flattens, as a loss does, so that a policy steering by the loss's trend takes the decisions
    it takes in training. Its values mean nothing; the twin predicts no accuracy."""
    return 1.0 / (1.0 + max(0.0, samples) / REFERENCE_SAMPLES)


@dataclass(frozen=True, slots=True)
class TwinConfig:
    """How far to run and the costs the worker facts do not carry. Every time is in seconds."""

    horizon_s: float | None = 10.0  # virtual s to run; None: until ``horizon_rounds``
    horizon_rounds: int | None = None  # stop once every worker pushed this often; None: no limit
    apply_s: float = 0.0  # daemon: one update applied (an Apply, or one flushed group)
    message_s: float = 0.0  # daemon: handling one push, apply excluded
    step_overhead_s: float = 0.0  # worker: fixed time per step outside compute
    latency_s: float = 0.0  # one way, per message, on every link
    release_stagger_s: float = 0.0  # the k-th worker released by one event gets its frame k× later
    # What one push's round trip costs beyond compute and the links as modelled (framing, codecs,
    # the daemon's intake, thread hops), paid on every push before it arrives: a worker without
    # pipeline waits for it, a pipelined one computes meanwhile. None: read from the view
    # (:func:`policies.twin_worker.exchange_s`, what the workers' last pushes took).
    exchange_s: float | None = None
    model_bytes: float | None = None  # bytes of a full fp32 parameter frame; None: from push_bytes
    global_batch: int | None = None  # None: the view's
    batch_size: int | None = None  # the default plan's batch; None: each worker's current one
    tick_s: float = 0.25  # the daemon's periodic Tick
    max_staleness: int = 1000  # the daemon drops pushes staler than this
    max_events: int = 1_000_000  # guard: the run stops (``truncated``) after this many events
    # The loss a push (and an evaluation) reports, as a function of the samples applied so far;
    # None: pushes carry no loss. Only its shape matters, to policies that search or switch on
    # the loss (adsp, ashl): without one, adsp's search climbs until no commit fits.
    loss: Callable[[float], float] | None = field(default=reference_loss)
    eval_interval_s: float | None = None  # s between Eval events (with ``loss``); None: none

    def __post_init__(self) -> None:
        if self.horizon_s is None and self.horizon_rounds is None:
            raise ValueError("give horizon_s (seconds) or horizon_rounds (rounds), or both")
        if self.horizon_s is not None and not (0 < self.horizon_s < math.inf):
            raise ValueError(f"horizon_s must be > 0 and finite, got {self.horizon_s!r}")
        if self.horizon_rounds is not None and not (
            isinstance(self.horizon_rounds, int) and self.horizon_rounds >= 1
        ):
            raise ValueError(f"horizon_rounds must be an int >= 1, got {self.horizon_rounds!r}")
        for name in ("apply_s", "message_s", "step_overhead_s", "latency_s", "release_stagger_s"):
            v = getattr(self, name)
            if not (v >= 0 and math.isfinite(v)):
                raise ValueError(f"{name} must be a finite number >= 0 (seconds), got {v!r}")
        if self.exchange_s is not None and not (
            self.exchange_s >= 0 and math.isfinite(self.exchange_s)
        ):
            raise ValueError(
                f"exchange_s must be a finite number >= 0 (seconds) or None, got {self.exchange_s!r}"
            )
        if self.eval_interval_s is not None and not self.eval_interval_s > 0:
            raise ValueError(f"eval_interval_s must be > 0 (or None), got {self.eval_interval_s!r}")
        if not self.tick_s > 0:
            raise ValueError(f"tick_s must be > 0, got {self.tick_s!r}")


@dataclass(frozen=True, slots=True)
class Applied:
    """One push that reached the model: alone (an Apply) or inside a flushed aggregate."""

    at: float  # s, engine clock, when it was applied
    update: int  # the version it produced (an aggregate's pushes share one)
    worker: int
    samples: int  # samples of the push (batch × local steps)
    steps: int  # local steps (1: a gradient)
    staleness: int  # applied updates between its base and its arrival
    update_samples: int  # samples of the whole update it was part of
    # Its weight against an even share, times its worker's ``lr_scale``: 1 for a push applied
    # alone with weight 1/N (N active workers) or inside a mean weighted by samples; ashl's
    # shares weigh a fast worker's pushes above 1 and a slow one's below.
    weight: float = 1.0


@dataclass(frozen=True, slots=True)
class TwinResult:
    """What the twin predicts for one policy over its horizon (times from the view's ``now``)."""

    policy: str
    start_s: float  # s, engine clock: the view's ``now``
    duration_s: float  # s simulated
    samples_per_s: float  # samples pushed per s (what ``hetd bench`` reports as samples/s)
    applied_samples_per_s: float  # samples that reached the model per s
    updates_per_s: float  # new versions per s
    pushes: int
    dropped: int
    staleness_mean: float  # applied updates, over every push that arrived
    staleness_p95: float
    idle_fraction: Mapping[int, float]  # per worker: the share of the horizon its device waited
    bytes_up: float  # push bytes that arrived
    bytes_down: float  # parameter bytes released
    max_release_gap: int  # the largest clock lead of a worker when it was released
    applied: tuple[Applied, ...] = field(repr=False)
    truncated: bool = False  # stopped at ``max_events``
    stages: tuple[tuple[float, str], ...] = ()  # (s engine clock, stage entered), from "main"

    @property
    def stage(self) -> str:
        """The stage at the end of the horizon."""
        return self.stages[-1][1] if self.stages else "main"

    def time_to_samples(self, n: float, efficiency: Efficiency | None = None) -> float:
        """Seconds from the start until ``n`` samples are applied (with ``efficiency``:
        ``n`` effective samples). Read off the run when it gets there; beyond the horizon,
        extrapolated at the rate of the run's second half (the first may hold a transient: a
        profile stage, a first re-plan). ``math.inf`` when nothing is applied."""
        if n <= 0:
            return 0.0
        prev_t, prev_c = 0.0, 0.0
        points = _cumulative(self.applied, efficiency)
        for at, c in points:
            t = at - self.start_s
            if c >= n:
                span = c - prev_c
                return prev_t + (t - prev_t) * ((n - prev_c) / span if span > 0 else 1.0)
            prev_t, prev_c = t, c
        # beyond the horizon: the rate between the first point past its middle and the last
        mid = next(((at, c) for at, c in points if at - self.start_s >= self.duration_s / 2), None)
        if mid is None or prev_t + self.start_s <= mid[0]:
            rate = prev_c / self.duration_s
        else:
            rate = (prev_c - mid[1]) / (prev_t + self.start_s - mid[0])
        if rate <= 0:
            return math.inf
        return prev_t + (n - prev_c) / rate

    def effective_samples_per_s(self, efficiency: Efficiency) -> float:
        """Effective samples applied per second (:func:`effective_samples` over the horizon)."""
        return effective_samples(self.applied, efficiency) / self.duration_s

    def summary(self) -> dict[str, Any]:
        """The figures as plain values (no per-push records)."""
        return {
            "policy": self.policy,
            "start_s": self.start_s,
            "duration_s": self.duration_s,
            "samples_per_s": self.samples_per_s,
            "applied_samples_per_s": self.applied_samples_per_s,
            "updates_per_s": self.updates_per_s,
            "pushes": self.pushes,
            "dropped": self.dropped,
            "staleness_mean": self.staleness_mean,
            "staleness_p95": self.staleness_p95,
            "idle_fraction": dict(self.idle_fraction),
            "bytes_up": self.bytes_up,
            "bytes_down": self.bytes_down,
            "max_release_gap": self.max_release_gap,
            "truncated": self.truncated,
            "stages": [list(x) for x in self.stages],
        }


def _cumulative(
    applied: Sequence[Applied], efficiency: Efficiency | None
) -> list[tuple[float, float]]:
    """(time, samples applied so far) at each time something was applied (the pushes of one
    aggregate together), effective samples with ``efficiency``."""
    out: list[tuple[float, float]] = []
    total = 0.0
    for a in applied:
        total += a.samples if efficiency is None else efficiency.worth(a)
        if out and out[-1][0] == a.at:
            out[-1] = (a.at, total)
        else:
            out.append((a.at, total))
    return out


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) with linear interpolation between ranks (numpy's default),
    0 for no values."""
    if not values:
        return 0.0
    s = sorted(values)
    pos = (len(s) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return float(s[lo] + (s[hi] - s[lo]) * (pos - lo))
