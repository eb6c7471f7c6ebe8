"""Pure decision modules for hetd: synchronisation gates, weight rules, batch shares, stages.

Importing this package registers the built-in policies; :func:`make_policy` builds one by name.
"""

from policies import adsp, ashl  # noqa: F401  (registers adsp, ashl)
from policies import shares as shares
from policies import staleness as staleness
from policies import sync as sync
from policies.base import (
    ClusterView,
    Plan,
    Policy,
    PolicyError,
    WorkerFacts,
    compose,
    make_policy,
    policy_names,
)

__all__ = [
    "ClusterView",
    "Plan",
    "Policy",
    "PolicyError",
    "WorkerFacts",
    "compose",
    "make_policy",
    "policy_names",
    "shares",
    "staleness",
    "sync",
]
