"""The worker's plan as workers and the simulator read it: parsing and what its fields mean.

Owns the rules both the real worker (``workers/``) and the emulated one (:mod:`hetd.sim.agent`)
follow for a :class:`~policies.types.Plan`: how many local steps a push takes
(:func:`local_steps_for`, ADSP's time budget included), which codec its pushes use
(:func:`codec_for`) and which part of the training set it samples (:func:`data_range`). The plan
record itself, with its wire form (``Plan.to_wire`` / ``Plan.from_wire``), is
:class:`policies.types.Plan`, re-exported here.
"""

from __future__ import annotations

from hetd.codecs import registry as codecs
from policies.types import Plan

MAX_TIMED_STEPS = 100_000  # guard on the local steps a time budget may ask for


def local_steps_for(plan: Plan, step_s: float | None) -> int:
    """Local steps for the next push: the plan's ``local_steps``, or in time mode (a positive
    ``local_time_s``, ADSP's) as many steps as fit that time at this worker's own measured
    ``step_s`` seconds per step; at least 1."""
    steps = max(1, plan.local_steps)
    budget = plan.local_time_s
    if budget is None or not budget > 0:
        return steps
    if step_s is None or not step_s > 0:
        return steps  # no measurement yet: the daemon's estimate
    return max(1, min(MAX_TIMED_STEPS, int(budget / step_s)))


def codec_for(plan: Plan) -> codecs.Codec:
    """The codec a plan names (a spec such as ``int8:block=1024``); a bare ``topk`` keeps the plan's
    ``topk`` fraction of the values."""
    if plan.codec == "topk":
        return codecs.get_codec("topk", k=plan.topk)
    return codecs.from_spec(plan.codec)


def data_range(plan: Plan) -> tuple[float, float] | None:
    """``(offset, share)``: the part of one seed-fixed permutation of the training set the plan
    asks the worker to sample (ASHL's data shares), or None to keep its shard. A share outside
    ``(0, 1]`` is ignored; an offset outside ``[0, 1)`` counts as 0."""
    share = plan.data_share
    if share is None or not 0 < share <= 1:
        return None
    offset = plan.data_offset
    return (offset if offset is not None and 0 <= offset < 1 else 0.0), share


__all__ = ["Plan", "codec_for", "data_range", "local_steps_for"]
