"""A worker in the timing twin: its device and link as numbers (:mod:`policies.twin_loop` runs it).

Owns :class:`TwinWorker` (what one worker holds, owes and is busy with during a run),
:func:`local_steps` (the worker's rule for a plan's local steps), the wire size of a push under a
plan's codec (:meth:`TwinWorker.push_bytes`, from :data:`CODEC_BITS`), :func:`speed`, a
worker's seconds per sample from its facts, and :func:`exchange_s`, what a push's round trip
costs beyond compute and the links, read from the workers' last pushes. The rules mirror ``hetd/sim/agent.py`` and
``hetd/protocol/plan.py`` without importing them (policies import nothing from hetd).
"""

from __future__ import annotations

from collections.abc import Mapping

from policies.twin_records import TwinError
from policies.types import ClusterView, Plan, WorkerFacts

TOPK_BYTES_PER_VALUE = 6.0  # a kept float32 value and its 16-bit index gap
MAX_TIMED_STEPS = 100_000  # a time-budgeted plan's guard on local steps (as the worker's)
# Bits per value of a codec, by name; a name not here counts the plan's ``bits``.
CODEC_BITS: Mapping[str, int] = {
    "none": 32,
    "fp32": 32,
    "bf16": 16,
    "fp16": 16,
    "int8": 8,
    "int4": 4,
    "sign": 1,
}


class TwinWorker:
    """One worker's device and link in the twin's loop (mutable; private to one run)."""

    __slots__ = (
        "busy_until",
        "full_bytes",
        "held",
        "idle_from",
        "idle_total",
        "in_flight",
        "link_bps",
        "owed",
        "plan",
        "pushes",
        "sample_s",
        "sending_until",
        "wid",
    )

    def __init__(self, wid: int, plan: Plan, sample_s: float, link: float | None, full: float):
        self.wid = wid
        self.plan = plan
        self.sample_s = sample_s  # s per sample, the worker's own speed
        self.link_bps = link  # bytes/s; None: free
        self.full_bytes = full  # bytes of an uncompressed update or parameter frame
        self.held: int | None = None  # the version it holds
        self.in_flight = 0  # pushes not yet answered with parameters
        self.owed = 0  # pushes the next release answers
        self.busy_until = 0.0
        self.sending_until = 0.0
        self.idle_from = 0.0
        self.idle_total = 0.0
        self.pushes = 0  # pushes that arrived since the start

    def transfer_s(self, nbytes: float, latency: float) -> float:
        """Seconds for ``nbytes`` over this worker's link."""
        return latency + (nbytes / self.link_bps if self.link_bps else 0.0)

    def push_bytes(self) -> float:
        """Bytes of one push under the current plan: the full update scaled by the codec's bits
        per value, or for top-k by 1.5 times the kept fraction (a float32 value and a 16-bit index
        gap each, as ``hetd/codecs/topk.py`` packs them when the gaps fit)."""
        name = self.plan.codec.split(":", 1)[0].strip()
        if name == "topk":
            return self.full_bytes * min(1.0, TOPK_BYTES_PER_VALUE / 4.0 * self.plan.topk)
        return self.full_bytes * CODEC_BITS.get(name, self.plan.bits) / 32.0


def local_steps(plan: Plan, step_s: float) -> int:
    """The worker's rule (``hetd/protocol/plan.py``): the plan's ``local_steps``, or with a
    positive ``local_time_s`` as many steps of ``step_s`` as fit it; at least 1."""
    steps = max(1, plan.local_steps)
    budget = plan.local_time_s
    if budget is None or not budget > 0 or not step_s > 0:
        return steps
    return max(1, min(MAX_TIMED_STEPS, int(budget / step_s)))


def codec_bits(codec: str) -> int:
    """Bits per value of a codec spec (``"int8:block=1024"``: 8); 32 for a name not known."""
    return CODEC_BITS.get(codec.split(":", 1)[0].strip(), 32)


def speed(f: WorkerFacts) -> float:
    """A worker's seconds per sample from its facts; TwinError when it has none yet."""
    if f.sample_s is not None and f.sample_s > 0:
        return f.sample_s
    if f.compute_s is not None and f.compute_s > 0:
        return f.compute_s / max(1, f.batch_size)
    prof = f.profile or {}
    s = prof.get("sample_s")
    if isinstance(s, int | float) and s > 0:
        return float(s)
    raise TwinError(
        f"worker {f.worker} ({f.name}) has no timing facts yet (sample_s, compute_s or a "
        "profile): let it push a few times, or give its facts"
    )


def exchange_s(
    view: ClusterView, latency_s: float = 0.0, model_bytes: float | None = None
) -> float:
    """What one push's round trip costs beyond what the twin models (compute, ``latency_s`` each
    way, the push and the parameter frame over the worker's measured link), read from the view:
    the smallest over the workers of their last cycle (``last_push_at - prev_push_at``) less the
    compute it reported and the modelled transfers; 0 when no worker has two pushes and a
    compute time, never below 0.

    A cycle holds the worker's wait for its release too, which a synchronous round makes long
    for all but its slowest worker: the smallest is that worker's, or under an asynchronous
    policy anyone's, which is the round trip alone. A pipelined worker overlaps its round trip
    with compute and shows none: then so does this (the twin charges what it charged before).
    On loopback a push of a 0.2 M-parameter model took about 15 ms beyond its 10-40 ms of
    compute (framing, codecs, the daemon's intake and apply, thread hops), of which the links as
    measured explain about 5: what the twin left out made a step-by-step synchronous policy
    look 1.5x faster than it ran, and local-step policies, which pay it once per many steps,
    slower against it."""
    found: float | None = None
    for f in view.workers.values():
        if f.last_push_at is None or f.prev_push_at is None or f.compute_s is None:
            continue
        cycle = f.last_push_at - f.prev_push_at
        if not cycle > 0:
            continue
        rest = cycle - max(0.0, f.compute_s) - moved_s(f, latency_s, model_bytes)
        found = rest if found is None else min(found, rest)
    return max(0.0, found) if found is not None else 0.0


def moved_s(f: WorkerFacts, latency_s: float = 0.0, model_bytes: float | None = None) -> float:
    """Seconds the twin charges a worker's push and the parameter frame that answers it on its
    measured link (``latency_s`` each way; 0 over a link not measured yet)."""
    up = f.push_bytes or 0.0
    full = model_bytes or up * 32 / codec_bits(f.codec)
    link = f.link_bps if f.link_bps and f.link_bps > 0 else None
    return 2 * latency_s + ((up + full) / link if link else 0.0)
