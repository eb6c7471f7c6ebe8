"""Live throughput and latency of the engine, for ``/v1/status``, ``/metrics`` and benchmarks.

Owns :class:`LatencyRecorder` (the last few thousand engine event latencies, and their quantiles)
and :class:`RateMeter` (updates and bytes per second over a sliding window, from cumulative counters
sampled on the engine's ticks). Both are written only by the engine task; readers go through
``engine.queue.call`` or read between two events. Pure bookkeeping: the caller passes the time.
"""

from __future__ import annotations

from collections import deque

import numpy as np

MB = 1e6  # bytes in the MB of every "MB/s" figure


class LatencyRecorder:
    """A ring of the last ``size`` latencies (s)."""

    def __init__(self, size: int = 8192) -> None:
        self._ring = np.zeros(size, np.float64)
        self._count = 0  # latencies recorded since the last reset

    def add(self, seconds: float) -> None:
        """Record one latency."""
        self._ring[self._count % self._ring.size] = seconds
        self._count += 1

    def reset(self) -> None:
        """Forget every latency (a benchmark window starts)."""
        self._count = 0

    @property
    def count(self) -> int:
        """Latencies recorded since the last reset (the ring keeps the last ``size``)."""
        return self._count

    def summary(self) -> dict[str, float | int | None]:
        """``events`` since the last reset and the p50 / p99 / max in ms of those kept."""
        kept = self._ring[: min(self._count, self._ring.size)]
        if not kept.size:
            return {"events": 0, "p50_ms": None, "p99_ms": None, "max_ms": None}
        p50, p99 = np.quantile(kept, (0.5, 0.99))
        return {
            "events": self._count,
            "p50_ms": round(float(p50) * 1e3, 4),
            "p99_ms": round(float(p99) * 1e3, 4),
            "max_ms": round(float(kept.max()) * 1e3, 4),
        }


class RateMeter:
    """Updates/s and MB/s in and out over the last ``window_s`` seconds."""

    def __init__(self, window_s: float = 10.0) -> None:
        self.window_s = window_s
        # (t s, updates applied, bytes received, bytes sent), oldest first; all cumulative
        self._samples: deque[tuple[float, int, int, int]] = deque()

    def sample(self, now: float, updates: int, bytes_in: int, bytes_out: int) -> None:
        """Add the cumulative counters as of ``now``; drop samples older than the window."""
        self._samples.append((now, updates, bytes_in, bytes_out))
        while len(self._samples) > 2 and now - self._samples[1][0] >= self.window_s:
            self._samples.popleft()

    def rates(self) -> dict[str, float]:
        """The rates between the oldest and newest samples kept (0 before two samples)."""
        if len(self._samples) < 2:
            return {"updates_per_s": 0.0, "mb_in_per_s": 0.0, "mb_out_per_s": 0.0, "window_s": 0.0}
        t0, u0, i0, o0 = self._samples[0]
        t1, u1, i1, o1 = self._samples[-1]
        dt = max(1e-9, t1 - t0)
        return {
            "updates_per_s": round((u1 - u0) / dt, 3),
            "mb_in_per_s": round((i1 - i0) / dt / MB, 3),
            "mb_out_per_s": round((o1 - o0) / dt / MB, 3),
            "window_s": round(dt, 3),
        }


class Meters:
    """The engine's meters, a part of :class:`hetd.core.engine.Engine`: bytes in and out, batches
    published, the largest clock lead released, and the latency recorders and rate meter above."""

    def __init__(self) -> None:
        self.bytes_in = 0  # push bytes received, all workers, since start
        self.bytes_out = 0  # parameter bytes sent, all workers, since start
        self.publishes = 0  # batches published by run() (updates / publishes: batch size)
        self.max_release_gap = 0  # the largest clock lead any worker was released with
        self.latency = LatencyRecorder()  # s to decide one event: policy, bookkeeping, acks
        self.publish_latency = LatencyRecorder()  # s per publish: steps, snapshot, param frames
        self.wait = LatencyRecorder()  # s a command waited in the queue
        self.rates = RateMeter()  # updates/s and MB/s over the last seconds, sampled on ticks

    def sample(self, now: float, updates: int) -> None:
        """A tick's sample of the rates: ``updates`` applied so far, and the bytes counted here."""
        self.rates.sample(now, updates, self.bytes_in, self.bytes_out)
