"""Read-only summaries of the engine (the policy's view, the daemon at a glance, one row per
worker), read from its
parts (:class:`Parts`, which :class:`hetd.core.engine.Engine` is); other tasks call them through
:meth:`~hetd.core.queue.CommandQueue.call`.
"""

from __future__ import annotations

import math
from typing import Any, Protocol

import numpy as np

from hetd.core.applier import Applier
from hetd.core.evals import Evaluations
from hetd.core.members import Members
from hetd.core.noise import GradientNoise
from hetd.core.peers import Clock
from hetd.core.policy_host import PolicyHost
from hetd.core.rates import Meters
from hetd.core.replicas import Replicas
from hetd.core.store import Store
from policies.compose import describe_state
from policies.types import ClusterView


class Parts(Protocol):
    """What the summaries read."""

    @property
    def store(self) -> Store: ...
    @property
    def members(self) -> Members: ...
    @property
    def host(self) -> PolicyHost: ...
    @property
    def applier(self) -> Applier: ...
    @property
    def pipelines(self) -> Replicas: ...
    @property
    def evaluations(self) -> Evaluations: ...
    @property
    def meters(self) -> Meters: ...
    @property
    def noise(self) -> GradientNoise: ...
    @property
    def clock(self) -> Clock: ...
    @property
    def started_at(self) -> float: ...


def cluster_view(e: Parts, global_batch: int, optimizer: str | None = None) -> ClusterView:
    """The facts as the policy sees them (active replicas only); ``optimizer``: the workers'."""
    m, pipelines = e.members, e.pipelines
    return ClusterView(
        now=e.clock.now(),
        version=e.store.version,
        workers=m.view_facts,
        global_batch=global_batch,
        buffered=e.applier.buffered(),
        stage=e.host.stage,
        replicas=pipelines.groups,
        stage_workers={w: m.active[w].facts for w in pipelines.head_of if w in m.active},
        blocks=pipelines.blocks,
        noise_scale=e.noise.value,
        optimizer=optimizer,
    )


def status(e: Parts) -> dict[str, Any]:
    """The daemon at a glance."""
    last = e.evaluations.evals[-1] if e.evaluations.evals else None
    return {
        "version": e.store.version,
        "stage": e.host.stage,
        "stage_switches": [{"at_s": t, "stage": st} for t, st in e.host.stages[-20:]],
        "policy": e.host.policy.describe(),
        "policy_state": describe_state(e.host.state),
        "outer_optimizer": e.store.outer_spec,  # how deltas are applied (a swap changes it)
        "uptime_s": e.clock.now() - e.started_at,
        "workers": len(e.members.active),
        # pipeline replicas, head -> members in stage order (JSON keys are strings)
        "replicas": {str(head): list(members) for head, members in e.pipelines.groups.items()},
        "updates_applied": e.applier.updates_applied,
        "max_release_gap": e.meters.max_release_gap,
        "accuracy": None if last is None or not math.isfinite(last[2]) else last[2],
        "loss": None if last is None else last[1],
        # every metric of the last evaluation by name (a Task's own); NaN shown as null
        "metrics": {k: (v if math.isfinite(v) else None) for k, v in e.evaluations.latest.items()},
        "target": None
        if e.evaluations.target is None
        else {
            "metric": e.evaluations.target.metric,
            "mode": e.evaluations.target.mode,
            "value": e.evaluations.target.value,
            "reached_at_s": e.evaluations.target_at,
        },
        # the gradient noise scale in samples (None until enough pairs of gradient pushes at the
        # same base version came), and the pairs it is from
        "noise_scale": e.noise.value,
        "noise_pairs": e.noise.pairs,
        "throughput": e.meters.rates.rates(),
        "engine_latency": e.meters.latency.summary(),
        "publish_latency": e.meters.publish_latency.summary(),
        "queue_wait": e.meters.wait.summary(),
    }


def worker_rows(e: Parts) -> list[dict[str, Any]]:
    """One row per active worker."""
    now = e.clock.now()
    rows = []
    for wid in sorted(e.members.active):
        entry = e.members.active[wid]
        f, st = entry.facts, entry.stats
        alive = max(1e-9, now - f.joined_at)
        rows.append(
            {
                "worker": wid,
                "name": f.name,
                "device": dict(st.device),
                "shard": list(entry.shard),  # [index, count] of the data it reads
                "clock": f.clock,
                "samples": f.samples,
                "samples_per_s": f.samples / alive,
                "compute_s": f.compute_s,
                "batch_size": f.batch_size,
                "codec": entry.plan.codec,  # what its pushes use (the plan's)
                "params_codec": f.codec,  # what its parameters come in (negotiated)
                "path": entry.transport,  # "ws" or "shm" (same-host shared memory)
                "pushes": st.pushes,
                "applied": st.applied,
                "dropped": st.dropped,
                "refused": st.refused,
                "duplicates": st.duplicates,
                "staleness_mean": float(np.mean(st.staleness)) if st.staleness else 0.0,
                "idle_fraction": min(1.0, f.idle_s / alive),
                "worker_idle_s": st.worker_idle_s,
                "link_bps": f.link_bps,
                "bytes_in": st.bytes_in,
                "bytes_out": st.bytes_out,
                "bytes_per_push": st.bytes_in / max(1, st.pushes),
                # encoded push bytes / the same update in float32 (frame overhead included)
                "push_ratio": st.bytes_in / max(1, st.pushes) / (4 * e.store.n_params),
                "bytes_per_pull": st.bytes_out / max(1, st.releases),
                "pull_ratio": st.bytes_out / max(1, st.releases) / (4 * e.store.n_params),
                "last_seen_s": now - st.last_seen,
                "plan": entry.plan.to_wire(),
                # [head, stage] of the pipeline replica it is a stage of (None: data parallel)
                "replica": e.pipelines.row(wid),
            }
        )
    return rows
