"""A timing twin: a candidate policy run forward on the live cluster's facts, without tensors.

Owns :func:`run_twin`; its records (:class:`TwinConfig`, :class:`TwinResult`, :class:`Applied`,
:class:`TwinError`) are :mod:`policies.twin_records`'s, re-exported here. The event loop itself is
:mod:`policies.twin_loop`; the statistical-efficiency term, kept apart from the timing, is
:mod:`policies.efficiency`.

The twin answers "what would policy P do on this cluster over the next ``h`` seconds?" for a
planner that must choose between policies while training runs. It starts P the way a hot swap
starts it (``init`` on the live view with every clock set to the highest, nothing buffered, the
stage ``main``, then a ``Tick``), and then plays the cluster forward from the workers' measured
facts: each worker computes ``batch × local steps × sample_s`` (plus a fixed per-step overhead),
sends ``push_bytes`` over its link, the daemon hands the push to P's real ``update`` and carries
out the decisions by :func:`policies.compose.resolve`'s rules, and released workers receive the
parameters over their link and compute again. Nothing is random: the same view, policy and
configuration give the same result.

What comes out is timing only: samples/s pushed and applied, updates/s, staleness, idle time and
bytes. How much an applied sample is worth (a stale gradient, a delta of many local steps, a big
aggregate) is a separate, openly guessed model, :class:`policies.efficiency.Efficiency` [D], so that a planner can
calibrate or replace it without touching the timing.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from policies.registry import make_policy
from policies.twin_loop import simulate
from policies.twin_records import (
    Applied,
    TwinConfig,
    TwinError,
    TwinResult,
    percentile,
    reference_loss,
)
from policies.types import ClusterView, Policy

__all__ = [
    "Applied",
    "TwinConfig",
    "TwinError",
    "TwinResult",
    "percentile",
    "reference_loss",
    "run_twin",
]


# --- running it -----------------------------------------------------------------------------------


def run_twin(
    view: ClusterView,
    policy: Policy | str,
    params: Mapping[str, Any] | None = None,
    config: TwinConfig | None = None,
) -> TwinResult:
    """Run ``policy`` (a :class:`Policy`, or a registered name built with ``params``) forward from
    ``view`` for ``config``'s horizon, on the workers' facts alone; see the module docstring.

    Raises :class:`policies.registry.PolicyError` for a bad name or parameters, :class:`TwinError`
    when a worker has no timing facts yet, and whatever the policy's own ``init``/``update``
    raise (a candidate that fails here would fail a real swap too)."""
    cfg = config or TwinConfig()
    p = make_policy(policy, params) if isinstance(policy, str) else policy
    if not view.workers:
        raise TwinError("the view has no active workers: nothing to simulate")
    return simulate(view, p, cfg)
