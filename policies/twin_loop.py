"""The timing twin's discrete-event loop: workers, links and the daemon as facts, no tensors.

Owns :func:`simulate` (called by :func:`policies.twin.run_twin`). It mirrors three parts of hetd
on numbers alone:

* a worker (``hetd/sim/agent.py``'s rules): it computes when it holds parameters, is not busy and
  has at most ``depth`` pushes unanswered (0, or 1 when its plan says ``pipeline``); a step is
  ``batch × local steps × sample_s`` plus ``step_overhead_s``; its pushes leave in order over its
  link (``latency + bytes / link_bps``) and arrive ``exchange_s`` later (the round trip's cost
  beyond the link: given, or read from the view), and without ``pipeline`` it waits for the
  release;
* the daemon's intake and executor (``hetd/core/intake.py``, ``members.py``, ``execute.py``): a
  push moves the worker's clock and timing facts (EWMA ``a = 0.5``) and makes it wait, one staler
  than ``max_staleness`` is dropped (the policy hears a ``Tick``), and the policy's decisions are
  carried out in :func:`policies.compose.resolve`'s order — plans and the stage first, then
  flushes, releases and the push's own Apply/Buffer/Drop; a push the policy says nothing about
  is applied with ``1/N``. The daemon is one server: an event waits until the previous one's
  ``message_s`` and ``apply_s`` per update are paid, and its releases leave after them;
* the start of a hot swap (``hetd/core/policy_host.py``'s trial): every clock set to the highest,
  default plans, nothing buffered, stage ``main``, ``init`` and then a ``Tick``.

The loop's own bookkeeping (:class:`~policies.twin_worker.TwinWorker`, the buffer) is mutable and never leaves
:func:`simulate`; what the policy sees (views, facts, events) is frozen, as in the engine.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
from typing import Any, NamedTuple

from policies.compose import Resolved, resolve
from policies.twin_records import Applied, TwinConfig, TwinError, TwinResult, percentile
from policies.twin_worker import TwinWorker, codec_bits, exchange_s, local_steps, speed
from policies.types import (
    Apply,
    Buffer,
    ClusterView,
    Drop,
    Eval,
    Event,
    Flush,
    Plan,
    Policy,
    Push,
    PushKind,
    Regroup,
    Release,
    RestartOptimizer,
    SetStage,
    Tick,
    WorkerFacts,
)

EWMA = 0.5  # the engine's smoothing of per-worker timing facts
ARRIVE, DELIVER, WAKE, TICK, EVAL = 0, 1, 2, 3, 4


class _Sent(NamedTuple):
    """A push on its way (what the daemon learns when it arrives)."""

    base: int  # the version it started from
    samples: int
    steps: int
    compute_s: float
    nbytes: float
    delta: bool
    lr_scale: float = 1.0  # the worker's plan's when it began


class _Buffered(NamedTuple):
    worker: int
    samples: int
    steps: int
    staleness: int
    weight: float  # the Apply's or Buffer's weight
    lr_scale: float  # its worker's plan's when it began (the delta's size, not its share)


def _link(f: WorkerFacts, full: float) -> float | None:
    """A worker's link in bytes/s: measured on its pushes, or before its first push its
    join-time profile's (a full frame's ``push_s``, latency included); None (free) with
    neither."""
    if f.link_bps is not None and f.link_bps > 0:
        return f.link_bps
    push_s = (f.profile or {}).get("push_s")
    if isinstance(push_s, int | float) and push_s > 0 and full > 0:
        return full / float(push_s)
    return None


def _ewma(old: float | None, new: float) -> float:
    return new if old is None else EWMA * new + (1 - EWMA) * old


class _Run:
    """One simulation: the workers, the daemon's state, the heap and the record."""

    def __init__(self, view: ClusterView, policy: Policy, cfg: TwinConfig) -> None:
        self.policy, self.cfg = policy, cfg
        self.t0 = view.now
        self.version = self.version0 = view.version
        self.global_batch = cfg.global_batch or view.global_batch
        self.stage = "main"
        self.stages: list[tuple[float, str]] = []  # (s, stage entered) after the start
        self.heap: list[tuple[float, int, int, int, Any]] = []
        self.seq = 0
        self.free_at = view.now  # the daemon is busy until then
        self.buffer: dict[int, list[_Buffered]] = {}
        self.applied: list[Applied] = []
        self.staleness: list[float] = []
        self.pushes = self.dropped = 0
        self.samples_pushed = 0
        self.samples_applied = 0.0
        self.bytes_up = self.bytes_down = 0.0
        self.max_gap = 0
        self.state: Any = None  # the policy's
        self.end = view.now + (cfg.horizon_s if cfg.horizon_s is not None else math.inf)
        # every push's round trip beyond the modelled links: given, or as the view's pushes took
        self.exchange_s = (
            cfg.exchange_s
            if cfg.exchange_s is not None
            else exchange_s(view, cfg.latency_s, cfg.model_bytes)
        )
        top = max(f.clock for f in view.workers.values())
        self.facts: dict[int, WorkerFacts] = {}
        self.workers: dict[int, TwinWorker] = {}
        # a full frame's bytes: every worker's, the codec aside (a worker timed by its join-time
        # profile alone has pushed none yet)
        frame = cfg.model_bytes or max(
            ((f.push_bytes or 0.0) * 32 / codec_bits(f.codec) for f in view.workers.values()),
            default=0.0,
        )
        for wid, f in sorted(view.workers.items()):
            plan = Plan(batch_size=cfg.batch_size or f.batch_size, codec=f.codec)
            full = cfg.model_bytes or (f.push_bytes or 0.0) * 32 / codec_bits(f.codec) or frame
            self.workers[wid] = TwinWorker(wid, plan, speed(f), _link(f, full), full)
            self.facts[wid] = dataclasses.replace(f, batch_size=plan.batch_size, clock=top)
        for wid, f in sorted(view.workers.items()):
            self._resume(self.workers[wid], f)

    # --- the start --------------------------------------------------------------------------

    def _resume(self, w: TwinWorker, f: WorkerFacts) -> None:
        """Where a worker is when the twin starts: waiting for a release (its last push
        unanswered), or in the middle of a step under the old plan, whose push is estimated to
        arrive one step and one transfer after it was released."""
        t0, lat = self.t0, self.cfg.latency_s
        w.held = f.version if f.version >= 0 else None
        w.idle_from = t0
        if f.waiting:  # its last push (or its pull) is answered by the next release
            w.in_flight = w.owed = 1
            return
        samples = f.batch_size
        if f.compute_s is not None and f.compute_s > 0:
            samples = max(1, round(f.compute_s / w.sample_s))
        compute = samples * w.sample_s
        began = (
            t0
            if f.last_push_at is None
            else min(t0, f.last_push_at + w.transfer_s(w.full_bytes, lat))
        )
        end = max(t0, began + compute + self.cfg.step_overhead_s)
        nbytes = f.push_bytes or w.push_bytes()
        arrive = end + w.transfer_s(nbytes, lat) + self.exchange_s
        steps = max(1, round(samples / max(1, f.batch_size)))
        w.in_flight, w.busy_until, w.sending_until, w.idle_from = 1, arrive, arrive, end
        self._at(
            arrive, ARRIVE, w.wid, _Sent(f.version, samples, steps, compute, nbytes, steps > 1)
        )

    # --- the heap ---------------------------------------------------------------------------

    def _at(self, t: float, kind: int, wid: int, payload: Any = None) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (t, self.seq, kind, wid, payload))

    def view(self, now: float) -> ClusterView:
        buffered = sum(len(g) for g in self.buffer.values())
        return ClusterView(
            now, self.version, dict(self.facts), self.global_batch, buffered, self.stage
        )

    def run(self) -> TwinResult:
        cfg = self.cfg
        view = self.view(self.t0)
        state = self.policy.init(view)
        decisions, self.state = self.policy.update(Tick(self.t0), state, view)
        self._carry_out(resolve(decisions), None, self.t0)
        self._at(self.t0 + cfg.tick_s, TICK, -1)
        if cfg.eval_interval_s is not None and cfg.loss is not None:
            self._at(self.t0 + cfg.eval_interval_s, EVAL, -1)
        events, truncated, stop = 0, False, self.end
        while self.heap:
            t, _, kind, wid, payload = heapq.heappop(self.heap)
            if t > self.end:
                break
            events += 1
            if events > cfg.max_events:
                truncated, stop = True, t
                break
            if kind in (ARRIVE, TICK, EVAL) and t < self.free_at:  # the daemon is still busy
                self._at(self.free_at, kind, wid, payload)
                continue
            if kind == ARRIVE:
                self._arrive(self.workers[wid], payload, t)
                if cfg.horizon_rounds is not None and all(
                    w.pushes >= cfg.horizon_rounds for w in self.workers.values()
                ):
                    stop = t
                    break
            elif kind == DELIVER:
                w = self.workers[wid]
                version, frames = payload
                w.held = version
                w.in_flight = max(0, w.in_flight - frames)
                self._try_start(w, t)
            elif kind == WAKE:
                self._try_start(self.workers[wid], t)
            elif kind == TICK:
                self._tick(t)
                if self.end == math.inf and not any(e[2] < TICK for e in self.heap):
                    stop = t  # rounds only, and every worker waits even after a tick: stalled
                    break
            else:
                self._evaluate(t)
        return self._result(stop if stop < math.inf else self.t0, truncated)

    # --- the daemon -------------------------------------------------------------------------

    def _tick(self, t: float) -> None:
        self._decide(Tick(t), None, t)
        self._at(t + self.cfg.tick_s, TICK, -1)

    def _evaluate(self, t: float) -> None:
        """An evaluation of the global model: the reference loss at the samples applied so far."""
        assert self.cfg.loss is not None and self.cfg.eval_interval_s is not None  # scheduled so
        self._decide(Eval(t, self.cfg.loss(self.samples_applied), math.nan), None, t)
        self._at(t + self.cfg.eval_interval_s, EVAL, -1)

    def _arrive(self, w: TwinWorker, p: _Sent, t: float) -> None:
        """A push reaches the daemon: its facts (as ``Members.pushed``), then the policy."""
        f = self.facts[w.wid]
        staleness = max(0, self.version - p.base)
        self.pushes += 1
        w.pushes += 1
        w.owed += 1  # one release answers every push made since the last
        self.samples_pushed += p.samples
        self.bytes_up += p.nbytes
        self.staleness.append(staleness)
        link = f.link_bps
        self.facts[w.wid] = dataclasses.replace(
            f,
            clock=f.clock + 1,
            waiting=True,
            waiting_since=t,
            prev_push_at=f.last_push_at,
            last_push_at=t,
            compute_s=_ewma(f.compute_s, p.compute_s),
            sample_s=_ewma(f.sample_s, p.compute_s / max(1, p.samples)),
            push_bytes=_ewma(f.push_bytes, p.nbytes),
            link_bps=link,
            samples=f.samples + p.samples,
        )
        if p.base > self.version or staleness > self.cfg.max_staleness:
            self.dropped += 1
            self._decide(Tick(t), None, t)
            return
        loss = self.cfg.loss(self.samples_applied) if self.cfg.loss is not None else None
        kind: PushKind = "delta" if p.delta else "grad"
        event = Push(t, w.wid, p.base, kind, p.samples, p.steps, p.compute_s, loss)
        self._decide(event, (w.wid, p, staleness), t)

    def _decide(self, event: Event, push: tuple[int, _Sent, int] | None, t: float) -> None:
        decisions, self.state = self.policy.update(event, self.state, self.view(t))
        self._carry_out(resolve(decisions), push, t)

    def _carry_out(self, r: Resolved, push: tuple[int, _Sent, int] | None, t: float) -> None:
        """One event's resolved decisions, in the executor's order; the daemon's time is charged
        (``message_s`` per push, ``apply_s`` per update) before the releases leave."""
        updates = 0
        for d in r.plans:
            if isinstance(d, SetStage):
                if d.stage != self.stage:
                    self.stage = d.stage
                    self.stages.append((t, d.stage))
                    for w in self.workers.values():
                        w.plan = dataclasses.replace(w.plan, stage=d.stage)
            elif isinstance(d, Regroup):
                raise TwinError(
                    f"policy {self.policy.name!r} forms pipeline replicas (Regroup): the twin "
                    "models data-parallel workers only"
                )
            elif d.worker in self.workers:
                w = self.workers[d.worker]
                new = w.plan.merge(d.fields)
                if w.plan.pipeline and not new.pipeline:  # as the worker forgets its in-flight
                    w.in_flight = 0
                w.plan = new
                f = self.facts[d.worker]
                self.facts[d.worker] = dataclasses.replace(f, batch_size=new.batch_size)
        released: list[int] = []
        decided = False
        for a in r.actions:
            if isinstance(a, Flush):
                updates += self._flush(a, t)
            elif isinstance(a, Release):
                if self._release(a.worker, t):
                    released.append(a.worker)
            elif isinstance(a, RestartOptimizer):
                pass  # the twin counts samples; no optimizer state to restart
            elif push is not None:
                decided = True
                updates += self._decide_push(a, push, t)
        if push is not None and not decided:  # never lost: applied with 1/N, as the engine does
            updates += self._decide_push(Apply(1.0 / max(1, len(self.facts))), push, t)
        cost = (self.cfg.message_s if push is not None else 0.0) + self.cfg.apply_s * updates
        self.free_at = max(self.free_at, t) + cost
        for k, wid in enumerate(released):
            self._send(self.workers[wid], self.free_at + k * self.cfg.release_stagger_s)

    def _decide_push(self, d: Apply | Buffer | Drop, push: tuple[int, _Sent, int], t: float) -> int:
        wid, p, staleness = push
        if isinstance(d, Apply):
            self.version += 1
            b = _Buffered(wid, p.samples, p.steps, staleness, d.weight, p.lr_scale)
            self._record(t, [b], [b.weight * b.lr_scale * len(self.facts)])
            return 1
        if isinstance(d, Buffer):
            self.buffer.setdefault(d.group, []).append(
                _Buffered(wid, p.samples, p.steps, staleness, d.weight, p.lr_scale)
            )
            return 0
        self.dropped += 1
        return 0

    def _flush(self, f: Flush, t: float) -> int:
        """Each buffered group up to ``f.upto`` becomes one update, in group order."""
        groups = sorted(g for g in self.buffer if f.upto is None or g <= f.upto)
        for g in groups:
            self.version += 1
            pushes = self.buffer.pop(g)
            total = sum(b.samples for b in pushes)
            if f.normalize:  # Σ w·u / Σ w: a push's share of the mean against its samples' share
                weights = sum(b.weight for b in pushes)
                rel = [
                    f.scale * b.weight / weights * total / max(1, b.samples) * b.lr_scale
                    if weights > 0
                    else 0.0
                    for b in pushes
                ]
            else:  # Σ w·u: each as if applied alone with its weight
                rel = [f.scale * b.weight * b.lr_scale * len(self.facts) for b in pushes]
            self._record(t, pushes, rel)
        return len(groups)

    def _record(self, t: float, pushes: list[_Buffered], rel: list[float]) -> None:
        """One update of ``pushes``, each with its weight relative to an even share (``rel``)."""
        total = sum(b.samples for b in pushes)
        for b, r in zip(pushes, rel, strict=True):
            self.applied.append(
                Applied(t, self.version, b.worker, b.samples, b.steps, b.staleness, total, r)
            )
        self.samples_applied += total

    def _release(self, wid: int, t: float) -> bool:
        """A waiting worker may go on (as ``Executor.release``); False when it was not waiting."""
        f = self.facts.get(wid)
        if f is None or not f.waiting:
            return False
        lo = min(x.clock for x in self.facts.values())
        self.max_gap = max(self.max_gap, f.clock - lo)
        idle = t - f.waiting_since if f.waiting_since is not None else 0.0
        self.facts[wid] = dataclasses.replace(
            f, waiting=False, waiting_since=None, idle_s=f.idle_s + idle, version=self.version
        )
        return True

    def _send(self, w: TwinWorker, depart: float) -> None:
        """The parameters (one frame per push answered) travel to the worker."""
        frames, w.owed = w.owed, 0
        self.bytes_down += w.full_bytes
        arrive = depart + w.transfer_s(w.full_bytes, self.cfg.latency_s)
        self._at(arrive, DELIVER, w.wid, (self.version, frames))

    # --- the workers ------------------------------------------------------------------------

    def _try_start(self, w: TwinWorker, t: float) -> None:
        depth = 1 if w.plan.pipeline else 0
        if w.held is None or t < w.busy_until or w.in_flight > depth:
            return
        batch = max(1, w.plan.batch_size)
        k = local_steps(w.plan, w.sample_s * batch)
        compute = w.sample_s * batch * k
        end = t + compute + self.cfg.step_overhead_s
        w.idle_total += max(0.0, t - w.idle_from)
        w.idle_from = end
        w.in_flight += 1
        nbytes = w.push_bytes()
        send = max(end, w.sending_until)  # pushes leave in order
        w.sending_until = send + w.transfer_s(nbytes, self.cfg.latency_s)
        w.busy_until = end if depth else w.sending_until
        delta = k > 1 or w.plan.push_kind == "delta"
        sent = _Sent(w.held, batch * k, k, compute, nbytes, delta, w.plan.lr_scale)
        self._at(w.sending_until + self.exchange_s, ARRIVE, w.wid, sent)
        if w.busy_until < w.sending_until:  # pipelined: it may start again before the push lands
            self._at(w.busy_until, WAKE, w.wid)

    # --- the record -------------------------------------------------------------------------

    def _result(self, stop: float, truncated: bool) -> TwinResult:
        d = max(stop - self.t0, 1e-12)
        idle = {
            wid: min(1.0, (w.idle_total + max(0.0, stop - w.idle_from)) / d)
            for wid, w in self.workers.items()
        }
        st = self.staleness
        return TwinResult(
            policy=self.policy.name,
            start_s=self.t0,
            duration_s=d,
            samples_per_s=self.samples_pushed / d,
            applied_samples_per_s=self.samples_applied / d,
            updates_per_s=(self.version - self.version0) / d,
            pushes=self.pushes,
            dropped=self.dropped,
            staleness_mean=sum(st) / len(st) if st else 0.0,
            staleness_p95=percentile(st, 95),
            idle_fraction=idle,
            bytes_up=self.bytes_up,
            bytes_down=self.bytes_down,
            max_release_gap=self.max_gap,
            applied=tuple(self.applied),
            truncated=truncated,
            stages=tuple(self.stages),
        )


def simulate(view: ClusterView, policy: Policy, cfg: TwinConfig) -> TwinResult:
    """Run ``policy`` from ``view`` for ``cfg``'s horizon (see the module docstring)."""
    return _Run(view, policy, cfg).run()
