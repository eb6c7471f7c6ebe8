"""Pipeline replicas in the engine's simulator: what the daemon's replica driver
(:mod:`hetd.server.replicas`) does, in virtual time.

A policy's ``Regroup`` reaches :meth:`SimReplicas.regroup` (the engine's ``regroup_to``): a
replica running as asked keeps going with the asked micro-batch count, any other dissolves, each
asked one not running is formed (:meth:`hetd.core.engine.Engine.form_replica`) and its first step
released at once. A released head reaches :meth:`SimReplicas.released` (the engine's
``run_step``), which runs the replica's next step on the version published then.

A step is charged as :func:`hetd.sim.dpmp.step_time` charges it: every stage pulls its slice
over its own link, the stages run the micro-batches in their 1F1B order at their workers'
slow-downs (the scenario's, at the step's start), activations and their gradients are relayed
through the head's links, every stage pushes its slice. A stage shape a worker has not run before
compiles first: the step takes the slowest such member's ``compile_s`` (the scenario's worker key,
what its profile reports) longer. Its update is the whole model's gradient
of the step's samples (the head's data, as stage 0 reads its inputs and the last stage its
labels from the same rows), which is what the assembled parts of a pipeline step add up to; it
is computed lazily with the workers' steps and handed to the engine as one push of the head,
as the driver hands the assembled step. The stage workers run no data-parallel step while in a
replica; when it dissolves, the members still there pull the whole parameters and go on as
data-parallel workers, as ``hetd-worker`` does on ``abort{dissolve}``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial

import numpy as np

from hetd.core.engine import Engine
from hetd.protocol.messages import PushIn
from hetd.sim import events as ev
from hetd.sim.agent import EmuWorker
from hetd.sim.compute import StepWork
from hetd.sim.dpmp import step_time
from policies.dpmp.costs import Block, WorkerSpec
from policies.types import ReplicaShape

log = logging.getLogger("hetd.sim.replicas")

Key = tuple[tuple[int, ...], tuple[int, ...], int]


@dataclass
class _Running:
    """One formed replica and its step under way."""

    members: tuple[int, ...]
    cuts: tuple[int, ...]
    micro: int
    micro_batches: int
    inflight: tuple[int, ...]
    step: int = 0
    pending: bool = False  # a step is released and its push has not reached the engine

    @property
    def key(self) -> Key:
        return (self.members, self.cuts, self.micro)


class SimReplicas:
    """The simulator's replica driver for one run."""

    def __init__(
        self,
        engine: Engine,
        heap: ev.EventHeap,
        clock: ev.VirtualClock,
        workers: Callable[[], Sequence[EmuWorker]],
        start: Callable[[StepWork], None],
        finish: Callable[[StepWork], None],
        push: Callable[[PushIn, EmuWorker], None],
    ) -> None:
        """``workers``: every emulated worker of the run; ``start``/``finish``: a step's update
        joins the lazily computed ones / is computed now; ``push``: a push to the daemon."""
        self.engine, self.heap, self.clock = engine, heap, clock
        self._workers, self._start, self._finish, self._push = workers, start, finish, push
        self.blocks = [
            Block(f"b{j:02d}", p, a, f) for j, (p, a, f) in enumerate(engine.pipelines.blocks)
        ]
        self.running: dict[int, _Running] = {}  # head -> replica
        # (worker, blocks lo, hi, stage, of, micro) of every stage a worker compiled: a worker
        # keeps its compiled stages, so a return to one costs nothing
        self.compiled: set[tuple[int, int, int, int, int, int]] = set()
        self.assembled = 0  # steps pushed
        self.aborted = 0  # steps given up (their replica dissolved first)
        engine.pipelines.regroup_to = self.regroup
        engine.pipelines.run_step = self.released

    def _by_wid(self, wid: int) -> EmuWorker | None:
        return next((w for w in self._workers() if w.wid == wid and w.gone is None), None)

    def _sync(self) -> None:
        """Forget replicas the engine dissolved itself (a member left)."""
        for head, r in list(self.running.items()):
            if self.engine.pipelines.view.get(head) != r.members:
                self._end(head, r)

    def regroup(self, shapes: Sequence[ReplicaShape]) -> None:
        """Exactly these replicas run (on the engine's call, inside its decisions)."""
        self._sync()
        wanted = {(tuple(s.members), tuple(s.cuts), s.micro): s for s in shapes}
        for head, r in list(self.running.items()):
            shape = wanted.pop(r.key, None)
            if shape is None:
                self.dissolve(head, "regrouped")
            else:
                r.micro_batches = shape.micro_batches
        for shape in wanted.values():
            self.form(shape)

    def form(self, shape: ReplicaShape) -> None:
        """Make ``shape`` a replica and release its first step (nothing, logged, when the
        engine refuses the group)."""
        members = tuple(shape.members)
        if len(shape.cuts) != len(members) + 1 or shape.cuts[-1] != len(self.blocks):
            log.warning("replica %s not formed: cuts %s", list(members), list(shape.cuts))
            return
        try:
            self.engine.form_replica(list(members))
        except ValueError as exc:
            log.warning("replica %s not formed: %s", list(members), exc)
            return
        caps = tuple(shape.inflight) or tuple(len(members) - s for s in range(len(members)))
        r = _Running(members, tuple(shape.cuts), shape.micro, shape.micro_batches, caps)
        self.running[members[0]] = r
        for wid in members:
            w = self._by_wid(wid)
            if w is not None:
                w.in_replica = True
        self._release(members[0], r)

    def dissolve(self, head: int, reason: str) -> None:
        """End replica ``head``: its step is given up, the engine puts its members back."""
        r = self.running.get(head)
        if r is None:
            return
        self.engine.dissolve_replica(head, reason)
        self._end(head, r)

    def _end(self, head: int, r: _Running) -> None:
        """The replica is gone from the engine: its members pull the whole parameters and go on
        as data-parallel workers."""
        del self.running[head]
        if r.pending:
            self.aborted += 1
        for wid in r.members:
            w = self._by_wid(wid)
            if w is None or not w.in_replica:
                continue
            w.in_replica = False
            w.held = None  # it drops its slice
            w.in_flight = 1  # the pull's answer is what it waits for
            self.heap.schedule(self.clock.t + w.spec.latency_s, ev.Repull(w))

    def released(self, head: int) -> None:
        """The engine released replica ``head`` (its updates applied): its next step, unless one
        is under way."""
        self._sync()
        r = self.running.get(head)
        if r is not None and not r.pending:
            self._release(head, r)

    def _release(self, head: int, r: _Running) -> None:
        lead = self._by_wid(head)
        group = [self._by_wid(w) for w in r.members]
        if lead is None or lead.sampler is None or any(w is None for w in group):
            return  # a member is gone: the engine dissolves the replica when it hears of it
        now = self.clock.t
        snap = self.engine.store.snapshot()
        r.step += 1
        r.pending = True
        samples = r.micro * r.micro_batches
        rows = lead.sampler.next_indices(samples)[None].astype(np.int32)
        work = StepWork(snap.tensors, rows, 0.0)
        self._start(work)
        specs = [self._spec(w, now) for w in group if w is not None]
        took = step_time(self.blocks, specs, r.cuts, r.micro, r.micro_batches, r.inflight)
        took += self._compile(r, group)
        for w in group:
            if w is not None:  # busy from now to the step's end
                w.idle_total += max(0.0, now - w.idle_from)
                w.idle_from = now + took
        done = partial(self._done, head, r, r.step, work, snap.version, samples, took)
        self.heap.schedule(now + took, ev.Later(done))

    def _compile(self, r: _Running, group: Sequence[EmuWorker | None]) -> float:
        """Seconds the step waits for its stages' compiles: the slowest member's
        ``compile_s`` (the scenario's) among those that never compiled their stage of this
        shape; a step of the stages' shape that follows costs nothing more."""
        n, wait = len(r.members), 0.0
        for s, w in enumerate(group):
            if w is None:
                continue
            key = (w.wid, r.cuts[s], r.cuts[s + 1], s, n, r.micro)
            if key not in self.compiled:
                self.compiled.add(key)
                wait = max(wait, w.spec.compile_s or 0.0)
        return wait

    def _spec(self, w: EmuWorker, now: float) -> WorkerSpec:
        """The planner's spec of worker ``w`` as it runs now: the scenario's speed (one straggle
        draw per step, as a data-parallel step draws) and its link."""
        sc = w.sc
        per_sample = sc.base_step_s / sc.base_batch * sc.slowdown_at(w.index, now)
        return WorkerSpec(
            w.wid,
            per_sample * w.straggler.factor(),
            bw_up=w.spec.bandwidth,
            bw_down=w.spec.bandwidth,
            lat_s=w.spec.latency_s,
        )

    def _done(
        self,
        head: int,
        r: _Running,
        step: int,
        work: StepWork,
        base: int,
        samples: int,
        took: float,
    ) -> None:
        """The step's last part is in: its update goes to the engine as the head's push."""
        if self.running.get(head) is not r or r.step != step:
            return  # dissolved (or replaced) meanwhile: nothing of the step is applied
        lead = self._by_wid(head)
        if lead is None:
            return
        r.pending = False
        self._finish(work)
        assert work.tensors is not None  # computed just now
        lead.steps += 1
        self.assembled += 1
        push = PushIn(
            worker=head,
            id=lead.steps,
            base=base,
            kind="grad",
            tensors=work.tensors,
            samples=samples,
            steps=1,
            compute_s=took,
            loss=work.loss,
            free_mem=None,
            nbytes=sum(int(t.nbytes) for t in work.tensors.values()),
        )
        work.params = {}  # let the old version go
        self._push(push, lead)
