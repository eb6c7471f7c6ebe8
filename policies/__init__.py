"""Pure decision modules for hetd: synchronisation gates, weight rules, batch shares, stages.

The interface's records are :mod:`policies.types`; combining policies and decisions is
:mod:`policies.compose`; names are :mod:`policies.registry`. Importing this package registers the
built-in policies; :func:`make_policy` builds one by name.
"""

from policies import adsp, ashl, auto, diloco, quorum  # noqa: F401  (registers them)
from policies import shares as shares
from policies import staleness as staleness
from policies import sync as sync
from policies.compose import Resolved, compose, describe_state, release_waiting, resolve
from policies.dpmp import policy as _dpmp  # noqa: F401  (registers dpmp)
from policies.registry import PolicyError, make_policy, policy_names, register
from policies.types import (
    Apply,
    Buffer,
    ClusterView,
    Decision,
    Drop,
    Eval,
    Event,
    Flush,
    Forecast,
    Join,
    Leave,
    Plan,
    Policy,
    Prediction,
    Pull,
    Push,
    PushDecision,
    Release,
    RestartOptimizer,
    Scale,
    SetPlan,
    SetStage,
    Tick,
    WorkerFacts,
)

__all__ = [
    "Apply",
    "Buffer",
    "ClusterView",
    "Decision",
    "Drop",
    "Eval",
    "Event",
    "Flush",
    "Forecast",
    "Join",
    "Leave",
    "Plan",
    "Policy",
    "PolicyError",
    "Prediction",
    "Pull",
    "Push",
    "PushDecision",
    "Release",
    "Resolved",
    "RestartOptimizer",
    "Scale",
    "SetPlan",
    "SetStage",
    "Tick",
    "WorkerFacts",
    "compose",
    "describe_state",
    "make_policy",
    "policy_names",
    "register",
    "release_waiting",
    "resolve",
    "shares",
    "staleness",
    "sync",
]
