"""Read-only summaries of the engine (the daemon at a glance, one row per worker), a part of
:class:`hetd.core.engine.Engine`; other tasks call them through
:meth:`~hetd.core.engine.Engine.call`.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from hetd.core.entries import EngineBase
from policies.compose import describe_state


class ViewsMixin(EngineBase):
    """:meth:`status` and :meth:`workers`."""

    def status(self) -> dict[str, Any]:
        """The daemon at a glance."""
        last = self.evals[-1] if self.evals else None
        return {
            "version": self.store.version,
            "stage": self.stage,
            "stage_switches": [{"at_s": t, "stage": st} for t, st in self.stages[-20:]],
            "policy": self.policy.describe(),
            "policy_state": describe_state(self.policy_state),
            "outer_optimizer": self.store.outer_spec,  # how deltas are applied (a swap changes it)
            "uptime_s": self.clock.now() - self.started_at,
            "workers": len(self._workers),
            # pipeline replicas, head -> members in stage order (JSON keys are strings)
            "replicas": {str(head): list(members) for head, members in self._replicas.items()},
            "updates_applied": self.updates_applied,
            "max_release_gap": self.max_release_gap,
            "accuracy": None if last is None or not math.isfinite(last[2]) else last[2],
            "loss": None if last is None else last[1],
            # every metric of the last evaluation by name (a Task's own); NaN shown as null
            "metrics": {
                k: (v if math.isfinite(v) else None) for k, v in self.evaluations.latest.items()
            },
            "target": None
            if self.evaluations.target is None
            else {
                "metric": self.evaluations.target.metric,
                "mode": self.evaluations.target.mode,
                "value": self.evaluations.target.value,
                "reached_at_s": self.evaluations.target_at,
            },
            "throughput": self.rates.rates(),
            "engine_latency": self.latency.summary(),
            "publish_latency": self.publish_latency.summary(),
            "queue_wait": self.wait.summary(),
        }

    def workers(self) -> list[dict[str, Any]]:
        """One row per active worker."""
        now = self.clock.now()
        rows = []
        for wid in sorted(self._workers):
            entry = self._workers[wid]
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
                    "push_ratio": st.bytes_in / max(1, st.pushes) / (4 * self.store.n_params),
                    "bytes_per_pull": st.bytes_out / max(1, st.releases),
                    "pull_ratio": st.bytes_out / max(1, st.releases) / (4 * self.store.n_params),
                    "last_seen_s": now - st.last_seen,
                    "plan": entry.plan.to_wire(),
                    # [head, stage] of the pipeline replica it is a stage of (None: data parallel)
                    "replica": self._replica_row(wid),
                }
            )
        return rows

    def _replica_row(self, wid: int) -> list[int] | None:
        head = wid if wid in self._replicas else self._stages.get(wid)
        if head is None:
            return None
        return [head, self._replicas[head].index(wid)]
