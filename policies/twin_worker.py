"""A worker in the timing twin: its device and link as numbers (:mod:`policies.twin_loop` runs it).

Owns :class:`TwinWorker` (what one worker holds, owes and is busy with during a run),
:func:`local_steps` (the worker's rule for a plan's local steps), the wire size of a push under a
plan's codec (:meth:`TwinWorker.push_bytes`, from :data:`CODEC_BITS`) and :func:`speed`, a
worker's seconds per sample from its facts. The rules mirror ``hetd/sim/agent.py`` and
``hetd/protocol/plan.py`` without importing them (policies import nothing from hetd).
"""

from __future__ import annotations

from collections.abc import Mapping

from policies.twin_records import TwinError
from policies.types import Plan, WorkerFacts

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
