"""An emulated worker: what ``workers/client.py`` does with the daemon's frames, in virtual time.

Owns :class:`EmuWorker` and :class:`InFlight`. A worker follows the real client's protocol: it
applies ``params`` frames with the client's own :func:`hetd.protocol.params.apply_params` (full
frames, or deltas against the version it holds; an unusable delta means a ``pull`` for everything),
follows ``plan`` frames by the rules of :mod:`hetd.protocol.plan` (batch size, local steps, push
kind, codec with error feedback, data share, ``pipeline``), answers a ``profile`` request by
timing a few emulated steps before its first step, and computes when it holds parameters and has at
most ``depth`` pushes unanswered (0, or 1 when its plan says ``pipeline``: the next step overlaps
the push in flight, and pushes leave in order). It imports nothing from ``workers/``.

Times are virtual seconds from the scenario and the cost profile (:mod:`hetd.sim.costs`: encoding a
push and a fixed overhead add to each step, decoding parameters to their delivery, and a calibrated
profile exchange takes the time measured for it); nothing here reads a clock or touches the engine —
:mod:`hetd.sim.loop` moves the clock and delivers what this module produces.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np

from hetd.codecs import registry as codecs
from hetd.codecs.feedback import ErrorFeedback, encode_with_feedback
from hetd.protocol import wire
from hetd.protocol.frames import Hello, Params, Push
from hetd.protocol.messages import ProfileRequest, Welcome
from hetd.protocol.params import Held, apply_params
from hetd.protocol.plan import Plan, codec_for, data_range, local_steps_for
from hetd.sim.compute import StepWork, Straggler
from hetd.sim.costs import CostProfile
from hetd.sim.scenario import Scenario
from hetd.zoo.data import BatchSampler, Dataset, shard_indices, share_indices
from hetd.zoo.optim import parse_optimizer
from hetd.zoo.shapes import block_facts


@dataclass(eq=False)
class InFlight:
    """One push on its way to the daemon (its update is computed lazily, see simworkers)."""

    worker: EmuWorker
    work: StepWork
    id: int  # the push's request id
    base: int  # the version it started from
    samples: int
    compute_s: float  # emulated seconds of compute
    sent_at: float  # s, when it left the worker
    idle_s: float  # s the device sat idle before this step
    nbytes: int  # the frame's size as charged
    arrive: float  # s, when it reaches the daemon
    frame: bytes | None = None  # encoded once the update is known
    begin: float = 0.0  # s, when its compute began
    encode_s: float = 0.0  # s after the compute before it can leave (encoding, step overhead)
    exchange_s: float = 0.0  # s of the round trip's loopback cost on its way (not the link's)


@dataclass
class Started:
    """What starting a step produced: the push, and a profile result (arrival time, result)."""

    push: InFlight
    profile: tuple[float, dict[str, float]] | None = None


@dataclass(eq=False)
class EmuWorker:
    """One emulated worker's protocol state."""

    index: int  # position in the scenario's worker list
    sc: Scenario
    data: Dataset
    seed: int
    shapes: Mapping[str, tuple[int, ...]]  # the model's parameter shapes
    wid: int = 0
    plan: Plan = field(default_factory=Plan)  # the daemon's latest plan for this worker
    held: Held | None = None  # the parameters it holds
    in_flight: int = 0  # pushes not yet answered with parameters
    busy_until: float = 0.0  # s: the device computes (or, without pipeline, waits for a send)
    sending_until: float = 0.0  # s: the link carries the previous push
    idle_from: float = 0.0  # s: when the device last became idle
    idle_total: float = 0.0  # s the device sat idle before the steps it started
    asked: ProfileRequest | None = None  # a pending profile request
    steps: int = 0  # pushes made
    staleness: list[int] = field(default_factory=list)
    sampler: BatchSampler | None = None
    _shard: int = 0
    _share: tuple[float, float] | None = None
    worker_lr: float = 0.0  # the local lr of delta plans, from the welcome
    inner: str = "sgd"  # the inner optimizer's spec without its lr, from the welcome
    last_delta: StepWork | None = None  # the previous local-step work (its inner state)
    _sizes: dict[tuple[str, str], int] = field(default_factory=dict)  # tensor bytes per codec/kind
    costs: CostProfile = field(default_factory=CostProfile)  # codecs' and overheads' time
    joined_at: float = 0.0  # s: when it arrived (churn: its join's time)
    gone: str | None = None  # churn: "clean" (stopped, says bye) or "crash" (silent from then)
    gone_at: float = math.inf  # s: when it was stopped or crashed
    last_arrive: float = 0.0  # s: when its last push reaches the daemon (a bye comes after it)
    delivered: list[int] = field(default_factory=list)  # ids of its pushes the daemon received
    answered: list[int] = field(default_factory=list)  # ids the daemon acknowledged, in order
    in_replica: bool = False  # a pipeline replica's stage: it runs no data-parallel step

    def __post_init__(self) -> None:
        spec = self.sc.all_workers[self.index]  # a joiner's comes after the initial workers
        self.spec = spec
        self.n_params = sum(int(np.prod(s)) for s in self.shapes.values())
        self.straggler = Straggler(
            spec.stragglers, np.random.default_rng([self.seed, self.index, 7])
        )
        self.rng = np.random.default_rng([self.seed, self.index, 11])  # stochastic rounding
        self.feedback = ErrorFeedback()

    # --- the daemon's messages --------------------------------------------------------------

    @property
    def profile(self) -> ProfileRequest | None:
        """The profile request it answers before its next step, if one is pending."""
        return self.asked

    @profile.setter
    def profile(self, asked: ProfileRequest | None) -> None:
        self.asked = asked

    def hello(self) -> wire.Message:
        """The hello a real worker sends (device info from the scenario), as the daemon reads
        it."""
        device: dict[str, Any] = {"platform": "sim", "kind": f"x{self.spec.slowdown:g}"}
        if self.spec.memory is not None:
            device.update(memory=self.spec.memory, free_memory=self.spec.memory)
        # it runs pipeline stages (hetd.sim.replicas), as hetd-worker does
        hello = Hello(1, f"w{self.index}", device, tuple(codecs.names()), ("stages",))
        return wire.decode(hello.encode())

    def welcome(self, w: Welcome) -> None:
        """Plan and shard from the welcome (the shard as ``workers.loop.Trainer`` samples it)."""
        self.plan = w.plan
        train = w.setup.get("train") or {}
        self.worker_lr = float(train.get("worker_lr") or self.sc.worker_lr)  # as workers.loop
        inner = parse_optimizer(str(train.get("inner_optimizer") or "sgd"))
        self.worker_lr = inner.lr or self.worker_lr  # a spec's own lr wins, as on a worker
        self.inner = str(inner.without_lr())
        self._shard = w.shard
        rows = shard_indices(len(self.data.y_train), w.shard, w.shards, self.seed)
        self.sampler = self._sampler(rows)

    def _sampler(self, rows: np.ndarray) -> BatchSampler:
        seed = self.seed * 1000 + self._shard
        return BatchSampler(self.data.x_train, self.data.y_train, rows, seed=seed)

    def follow_plan(self, new: Plan) -> None:
        """A ``plan`` frame's plan (the whole plan, every time) replaces the one it follows; one
        that stops pipelining forgets the pushes in flight, as the real client does
        (``workers.inbox.Inbox.unpipeline``)."""
        if self.plan.pipeline and not new.pipeline:
            self.in_flight = 0
        self.plan = new

    def _follow_share(self) -> None:
        """A plan's ``data_share``/``data_offset``, as ``workers.loop.Trainer`` follows them."""
        wanted = data_range(self.plan)
        if wanted is None or self._share == wanted:
            return
        self.sampler = self._sampler(share_indices(len(self.data.y_train), *wanted, self.seed))
        self._share = wanted

    def receive(self, frames: Sequence[Params]) -> bool:
        """Apply one release's ``params`` frames in order, each answering one push in flight (as
        the real client counts them: a release for a wait that two pushes joined brings an empty
        frame for the second); False if a delta did not fit what it holds (the worker then pulls
        everything, as the real client does)."""
        for msg in frames:
            held = apply_params(self.held, msg)
            if held is None:
                return False
            self.held = held
            self.in_flight = max(0, self.in_flight - 1)
        return True

    def decode_s(self, frames: Sequence[Params]) -> float:
        """Seconds to decode one release's ``params`` frames and apply them (an empty delta,
        "go on with what you have", costs nothing)."""
        total = 0.0
        for msg in frames:
            codec = codec_name(msg.tensors)
            if codec is not None:
                total += self.costs.worker_decode(codec, self.n_params)
        return total

    # --- steps -----------------------------------------------------------------------------------

    @property
    def depth(self) -> int:
        """Pushes that may be unanswered when a step starts."""
        return 1 if self.plan.pipeline else 0

    def ready(self, t: float) -> bool:
        """Whether a step may start at ``t``."""
        return (
            self.gone is None
            and not self.in_replica
            and self.held is not None
            and t >= self.busy_until
            and self.in_flight <= self.depth
        )

    def fits(self) -> bool:
        """Whether a whole-model step fits the memory the worker reports (always, when it reports
        none): the parameters, their gradients and one micro-batch's activations (a
        block-structured model's; for any other model the parameters and gradients alone). A
        step that does not fit ends the worker, as an out-of-memory error ends a real one."""
        if self.spec.memory is None:
            return True
        micro = self.sc.micro_batch or self.sc.batch_per_worker
        acts = sum(a for _, a, _ in block_facts(self.shapes))
        return 8.0 * self.n_params + micro * acts <= self.spec.memory

    def _step_s(self, samples: int, t: float) -> float:
        """Emulated seconds of one step over ``samples`` samples starting at ``t``: one straggle
        draw per step, as ``workers.emulate`` draws once per step it emulates."""
        return self._nominal_s(samples, t) * self.straggler.factor()

    def _nominal_s(self, samples: int, t: float) -> float:
        """The same without a straggle (no draw)."""
        sc = self.sc
        return sc.base_step_s / sc.base_batch * sc.slowdown_at(self.index, t) * samples

    def start(self, t: float) -> Started:
        """Start a step at ``t`` (after a profile run if one was asked for)."""
        assert self.held is not None and self.sampler is not None  # ready() and welcome()
        spec = self.spec
        profile = None
        idle_s = t - self.idle_from  # the profile's steps are compute, not idle time
        if self.asked is not None:
            profile = self._profile(t)
            t = profile[0] - spec.latency_s  # the step starts once the profile is done
        self._follow_share()
        batch = max(1, self.plan.batch_size)
        # A real worker sizes a time-budgeted plan by its last measured step; no draw here.
        k = local_steps_for(self.plan, self._nominal_s(batch, t))
        delta = k > 1 or self.plan.push_kind == "delta"
        rows = np.stack([self.sampler.next_indices(batch) for _ in range(k)]).astype(np.int32)
        lr = self.worker_lr * self.plan.lr_scale
        work = StepWork(
            self.held.tensors, rows, lr, delta=delta, inner=self.inner, prev=self.last_delta
        )
        if delta and not parse_optimizer(self.inner).plain_sgd:
            self.last_delta = work
        compute_s = self._step_s(batch * k, t)
        # the push is encoded after the compute, and the step's fixed overhead paid, before it
        # can leave; the device is busy meanwhile (as in workers.push.compute).
        encode_s = (
            self.costs.worker_encode(self.plan.codec, self.n_params) + self.costs.worker_step_s
        )
        end = t + compute_s + encode_s
        self.idle_from = end
        self.idle_total += max(0.0, idle_s)
        self.steps += 1
        self.in_flight += 1
        send = max(end, self.sending_until)  # pushes leave in order
        p = InFlight(
            self, work, self.steps, self.held.version, batch * k, compute_s, send, idle_s, 0, 0.0
        )
        p.begin = t
        p.encode_s = encode_s
        p.nbytes = self._estimate(p)
        # The link carries the push (the next push leaves after it), then the round trip's
        # loopback cost (exchange_s, once per step) delays its arrival: it is the way there and
        # back, not the device's time. A worker without pipeline waits for it all the same; a
        # pipelined one computes its next step meanwhile, as workers.client does (its step runs
        # while the last push travels and the daemon answers it).
        self.sending_until = send + spec.latency_s + p.nbytes / spec.bandwidth
        p.exchange_s = self.costs.exchange_s
        p.arrive = self.sending_until + p.exchange_s
        self.last_arrive = p.arrive
        self.busy_until = end if self.depth else p.arrive  # without pipeline it waits for the send
        return Started(p, profile)

    def _profile(self, t: float) -> tuple[float, dict[str, float]]:
        """Time the requested profile steps as the real client does; (arrival at the daemon,
        result). Communication is estimated from the link. The exchange takes the emulated
        steps' time, or with a calibrated ``profile_s`` that time: a real worker reports its
        steps as emulated but never sleeps them."""
        asked = self.asked or ProfileRequest(0, 0)
        self.asked = None
        steps = max(1, min(20, asked.steps or 3))  # (0: the daemon named none)
        batch = asked.batch_size or 32
        per_sample = []
        start = t
        for _ in range(steps):
            dt = self._step_s(batch, t)
            per_sample.append(dt / batch)
            t += dt
        if self.costs.profile_s is not None:
            t = start + self.costs.profile_s
        # the client drops its slowest (compile) and takes the fastest of the rest
        kept = sorted(per_sample)[: max(1, steps - 1)]
        full = sum(4 * int(np.prod(s)) for s in self.shapes.values())
        push = self._tensor_bytes(self.plan.codec, "grad")
        link = self.spec
        result = {
            "sample_s": min(kept),
            "push_s": link.latency_s + push / link.bandwidth,
            "pull_s": link.latency_s + full / link.bandwidth,
            "compress_s": self.costs.worker_encode(self.plan.codec, self.n_params),
        }
        return t + link.latency_s, result

    # --- push frames ----------------------------------------------------------------------------

    def frame(self, p: InFlight, tensors: Any, loss: float) -> bytes:
        """The push frame (``tensors`` already encoded)."""
        return Push(
            p.id,
            base=p.base,
            kind="delta" if p.work.delta else "grad",
            tensors=tensors,
            samples=p.samples,
            steps=int(p.work.indices.shape[0]),
            compute_s=p.compute_s,
            loss=loss,
            free_mem=self.spec.memory,
            sent_at=p.sent_at,
            idle_s=p.idle_s,
        ).encode()

    def _tensor_bytes(self, spec: str, kind: str) -> int:
        """Packed size of the pushed tensors: the last push's with this codec and kind, else a
        zero update's (exact for fixed-size codecs; see :meth:`encode`)."""
        size = self._sizes.get((spec, kind))
        if size is None:
            zeros = {k: np.zeros(s, np.float32) for k, s in self.shapes.items()}
            tree = codecs.encode_tree(zeros, codec_for(self.plan))
            size = self._sizes[(spec, kind)] = len(msgpack.packb(tree, use_bin_type=True))
        return size

    def _estimate(self, p: InFlight) -> int:
        kind = "delta" if p.work.delta else "grad"
        envelope = len(self.frame(p, {}, 0.0)) - 1  # an empty map packs as one byte
        return envelope + self._tensor_bytes(self.plan.codec, kind)

    def encode(self, p: InFlight) -> int:
        """Encode ``p`` (its update computed) with the plan's codec and this worker's error
        feedback; returns the bytes beyond the estimate that timed it (0 for fixed-size codecs;
        the caller then delays the arrival by their transfer time)."""
        assert p.work.tensors is not None  # computed by the caller
        spec = self.plan.codec
        wire_tensors = encode_with_feedback(
            self.feedback, p.work.tensors, codec_for(self.plan), self.rng
        )
        p.frame = self.frame(p, wire_tensors, p.work.loss)
        kind = "delta" if p.work.delta else "grad"
        self._sizes[(spec, kind)] = len(p.frame) - (len(self.frame(p, {}, 0.0)) - 1)
        return max(0, len(p.frame) - p.nbytes)


def codec_name(tensors: Mapping[str, Mapping[str, Any]]) -> str | None:
    """The codec of a frame's tensors (the first one's: a frame uses one), None when empty."""
    for tensor in tensors.values():
        return str(tensor["codec"])
    return None
