"""Prometheus metrics of one daemon: its own registry, filled from an engine sample per scrape.

``Metrics.sample`` runs on the engine task (through ``engine.queue.call``) and copies the numbers out;
``Metrics.render`` turns the last sample into the text format with prometheus-client. Each daemon has
its own :class:`~prometheus_client.CollectorRegistry`, so two daemons in one process (tests) never
mix their series.

The staleness histogram is cumulative, as Prometheus requires: each sample adds the staleness values
of the pushes seen since the previous one (the engine keeps the last few thousand per worker, so a
scrape at least every ~2000 pushes per worker sees all of them).
"""

from __future__ import annotations

import bisect
import json
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

from hetd.core.engine import Engine

STALENESS_BUCKETS = (0, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64, 128, 256)  # versions


@dataclass
class _Histogram:
    """Cumulative staleness counts of one worker."""

    counts: list[int] = field(default_factory=lambda: [0] * (len(STALENESS_BUCKETS) + 1))
    total: float = 0.0
    seen: int = 0  # pushes accounted so far

    def add(self, values: list[int]) -> None:
        for v in values:
            self.counts[bisect.bisect_left(STALENESS_BUCKETS, v)] += 1
            self.total += v

    def buckets(self) -> list[tuple[str, float]]:
        out, running = [], 0
        for le, n in zip((*STALENESS_BUCKETS, float("inf")), self.counts, strict=True):
            running += n
            out.append(("+Inf" if le == float("inf") else str(le), float(running)))
        return out


@dataclass(frozen=True)
class _WorkerSample:
    labels: tuple[str, str]  # (worker id, name)
    clock: int
    samples: int
    samples_per_s: float
    pushes: int
    applied: int
    buffered: int
    dropped: int
    refused: int
    duplicates: int
    bytes_in: int
    bytes_out: int
    wait_s: float  # total time waiting for releases, the current wait included
    idle_fraction: float
    compute_s: float | None
    batch_size: int
    plan: Mapping[str, Any]  # the worker's current plan as sent (Plan.to_wire)
    staleness: list[tuple[str, float]]
    staleness_sum: float


class Metrics:
    """One daemon's registry and the latest engine sample behind it."""

    def __init__(self, engine: Engine, extra: Callable[[], dict[str, float]] | None = None) -> None:
        self.engine = engine
        self.registry = CollectorRegistry(auto_describe=False)
        self._extra = extra  # daemon-level gauges (checkpoints), read at sample time
        self._hist: dict[int, _Histogram] = {}
        self._sample: dict[str, Any] = {}
        self._workers: list[_WorkerSample] = []
        self.registry.register(_Collector(self))

    def sample(self) -> None:
        """Copy the engine's numbers (run on the engine task, between two events)."""
        e = self.engine
        now = e.clock.now()
        last = e.evaluations.evals[-1] if e.evaluations.evals else None
        self._sample = {
            "version": e.store.version,
            "stage": e.host.stage,
            "stage_switches": list(e.host.stages),
            "policy": e.host.policy.describe(),
            "workers": len(e.members.facts),
            "updates_applied": e.applier.updates_applied,
            "buffered": e.applier.buffered(),
            "uptime_s": now - e.started_at,
            "accuracy": None if last is None or last[2] != last[2] else last[2],
            "loss": None if last is None else last[1],
            "metrics": dict(e.evaluations.latest),
            "departures": len(e.members.departures),
            "throughput": e.meters.rates.rates(),
            "latency": e.meters.latency.summary(),
            "extra": self._extra() if self._extra is not None else {},
        }
        rows = []
        entries = e.members.entries
        for wid in sorted(entries):
            entry = entries[wid]
            f, st = entry.facts, entry.stats
            h = self._hist.setdefault(wid, _Histogram())
            new = st.pushes - h.seen
            if new > 0:
                h.add(st.staleness[-new:] if new <= len(st.staleness) else list(st.staleness))
                h.seen = st.pushes
            alive = max(1e-9, now - f.joined_at)
            waiting = now - f.waiting_since if f.waiting and f.waiting_since is not None else 0.0
            rows.append(
                _WorkerSample(
                    labels=(str(wid), f.name),
                    clock=f.clock,
                    samples=f.samples,
                    samples_per_s=f.samples / alive,
                    pushes=st.pushes,
                    applied=st.applied,
                    buffered=st.buffered,
                    dropped=st.dropped,
                    refused=st.refused,
                    duplicates=st.duplicates,
                    bytes_in=st.bytes_in,
                    bytes_out=st.bytes_out,
                    wait_s=f.idle_s + waiting,
                    idle_fraction=min(1.0, (f.idle_s + waiting) / alive),
                    compute_s=f.compute_s,
                    batch_size=f.batch_size,
                    plan=entry.plan.to_wire(),
                    staleness=h.buckets(),
                    staleness_sum=h.total,
                )
            )
        for wid in set(self._hist) - set(entries) - set(e.members.departed):
            del self._hist[wid]
        self._workers = rows

    def render(self) -> bytes:
        """The last sample in the Prometheus text format."""
        out: bytes = generate_latest(self.registry)
        return out


class _Collector:
    """Yields metric families from the owner's last sample (prometheus-client calls ``collect``)."""

    def __init__(self, owner: Metrics) -> None:
        self._owner = owner

    def collect(self) -> Iterator[Metric]:
        s = self._owner._sample
        if not s:
            return
        yield _gauge(
            "hetd_version", "Global parameter version (updates applied to the model).", s["version"]
        )
        yield _gauge("hetd_workers", "Active workers.", s["workers"])
        yield _counter(
            "hetd_updates_applied",
            "Updates applied to the model (a flushed round counts once).",
            s["updates_applied"],
        )
        yield _gauge(
            "hetd_buffered_updates", "Pushes waiting in the aggregation buffer.", s["buffered"]
        )
        yield _gauge("hetd_uptime_seconds", "Seconds since the engine started.", s["uptime_s"])
        yield _counter(
            "hetd_worker_departures",
            "Workers that left or timed out (last 64 kept).",
            s["departures"],
        )
        stage = GaugeMetricFamily(
            "hetd_stage", "Current training stage (value 1).", labels=["stage"]
        )
        stage.add_metric([s["stage"]], 1.0)
        yield stage
        entered = GaugeMetricFamily(
            "hetd_stage_entered_seconds",
            "Seconds after start when each stage was last entered.",
            labels=["stage"],
        )
        last: dict[str, float] = {}
        for at, name in s["stage_switches"]:
            last[name] = at
        for name, at in last.items():
            entered.add_metric([name], at)
        yield entered
        pol = GaugeMetricFamily(
            "hetd_policy", "Active policy and its parameters (value 1).", labels=["name", "params"]
        )
        pol.add_metric(
            [s["policy"]["name"], json.dumps(s["policy"]["params"], sort_keys=True, default=str)],
            1.0,
        )
        yield pol
        if s["accuracy"] is not None:
            yield _gauge(
                "hetd_test_accuracy",
                "Test accuracy of the global model at the last evaluation.",
                s["accuracy"],
            )
            yield _gauge(
                "hetd_test_loss", "Test loss of the global model at the last evaluation.", s["loss"]
            )
        if s["metrics"]:
            named = GaugeMetricFamily(
                "hetd_eval_metric",
                "Every metric of the last evaluation by name (a Task's own metrics and its loss).",
                labels=["metric"],
            )
            for name, value in sorted(s["metrics"].items()):
                named.add_metric([name], value)
            yield named
        rates = s["throughput"]
        yield _gauge(
            "hetd_updates_per_second",
            "Updates applied per second over the last window (hetd_throughput_window_seconds).",
            rates["updates_per_s"],
        )
        yield _gauge(
            "hetd_received_megabytes_per_second",
            "Push MB (1e6 bytes) received per second over the last window.",
            rates["mb_in_per_s"],
        )
        yield _gauge(
            "hetd_sent_megabytes_per_second",
            "Parameter MB (1e6 bytes) sent per second over the last window.",
            rates["mb_out_per_s"],
        )
        yield _gauge(
            "hetd_throughput_window_seconds",
            "Seconds the throughput gauges average over.",
            rates["window_s"],
        )
        lat = GaugeMetricFamily(
            "hetd_engine_latency_seconds",
            "Engine time per event (taken off the queue to replies queued), last 8192 events.",
            labels=["quantile"],
        )
        for q, key in (("0.5", "p50_ms"), ("0.99", "p99_ms"), ("1", "max_ms")):
            if s["latency"][key] is not None:
                lat.add_metric([q], s["latency"][key] / 1e3)
        yield lat
        for name, value in s["extra"].items():
            yield _gauge(name, name.replace("_", " "), value)
        yield from self._per_worker()

    def _per_worker(self) -> Iterator[Metric]:
        rows = self._owner._workers
        labels = ["worker", "name"]

        def family(
            cls: type[GaugeMetricFamily] | type[CounterMetricFamily],
            name: str,
            doc: str,
            get: Callable[[_WorkerSample], float | None],
        ) -> Metric:
            m = cls(name, doc, labels=labels)
            for r in rows:
                value = get(r)
                if value is not None:
                    m.add_metric(list(r.labels), float(value))
            return m

        g, c = GaugeMetricFamily, CounterMetricFamily
        yield family(
            g, "hetd_worker_clock", "The worker's clock (pushes accounted).", lambda r: r.clock
        )
        yield family(
            c, "hetd_worker_samples", "Samples the worker has pushed.", lambda r: r.samples
        )
        yield family(
            g,
            "hetd_worker_samples_per_second",
            "Samples per second since the worker joined.",
            lambda r: r.samples_per_s,
        )
        yield family(
            c, "hetd_worker_pushes", "Pushes received from the worker.", lambda r: r.pushes
        )
        yield family(
            c,
            "hetd_worker_updates_applied",
            "The worker's pushes applied on arrival.",
            lambda r: r.applied,
        )
        yield family(
            c,
            "hetd_worker_updates_buffered",
            "The worker's pushes buffered for a flush.",
            lambda r: r.buffered,
        )
        yield family(
            c, "hetd_worker_updates_dropped", "The worker's pushes dropped.", lambda r: r.dropped
        )
        yield family(
            c,
            "hetd_worker_updates_refused",
            "The worker's pushes refused by the update guard (norm out of range).",
            lambda r: r.refused,
        )
        yield family(
            c,
            "hetd_worker_updates_duplicate",
            "The worker's pushes received again (same request id) and not applied again.",
            lambda r: r.duplicates,
        )
        yield family(
            c,
            "hetd_worker_received_bytes",
            "Push bytes received from the worker.",
            lambda r: r.bytes_in,
        )
        yield family(
            c,
            "hetd_worker_sent_bytes",
            "Parameter bytes sent to the worker.",
            lambda r: r.bytes_out,
        )
        yield family(
            c,
            "hetd_worker_wait_seconds",
            "Seconds the worker waited for a release.",
            lambda r: r.wait_s,
        )
        yield family(
            g,
            "hetd_worker_idle_fraction",
            "Fraction of its time the worker waited.",
            lambda r: r.idle_fraction,
        )
        yield family(
            g,
            "hetd_worker_compute_seconds",
            "Seconds of compute per push (EWMA).",
            lambda r: r.compute_s,
        )
        yield family(
            g, "hetd_worker_batch_size", "The worker's planned batch size.", lambda r: r.batch_size
        )
        for key, name, doc in _PLAN_GAUGES:
            yield family(g, name, doc, partial(_plan_number, key))
        codec = GaugeMetricFamily(
            "hetd_worker_codec",
            "The codec the worker's plan names for its pushes (value 1).",
            labels=[*labels, "codec"],
        )
        for r in rows:
            codec.add_metric([*r.labels, str(r.plan.get("codec", "none"))], 1.0)
        yield codec
        h = HistogramMetricFamily(
            "hetd_worker_staleness",
            "Staleness of each push (versions behind on arrival).",
            labels=labels,
        )
        for r in rows:
            h.add_metric(list(r.labels), r.staleness, r.staleness_sum)
        yield h


def _gauge(name: str, doc: str, value: float) -> Metric:
    return GaugeMetricFamily(name, doc, value=float(value))


def _counter(name: str, doc: str, value: float) -> Metric:
    return CounterMetricFamily(name, doc, value=float(value))


# Plan fields shown per worker: (plan key, metric name, help). Absent or non-numeric: not shown.
_PLAN_GAUGES = (
    ("local_steps", "hetd_worker_local_steps", "Local steps per push in the worker's plan (H)."),
    ("bits", "hetd_worker_bits", "Bits per value the worker's plan asks for."),
    ("topk", "hetd_worker_topk_ratio", "Fraction of values a sparsifying codec keeps (rho)."),
    ("lr_scale", "hetd_worker_lr_scale", "The worker's local learning-rate scale."),
    ("data_share", "hetd_worker_data_share", "The worker's share of the data and weight (p_i)."),
    (
        "staleness_bound",
        "hetd_worker_staleness_bound",
        "Clocks the worker may run ahead of the slowest (where the policy bounds it).",
    ),
)


def _plan_number(key: str, row: _WorkerSample) -> float | None:
    value = row.plan.get(key)
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)
