"""The single writer: one asyncio task owns all training state and reads one queue of commands.

Sessions put commands on the queue (join, push, pull, heartbeat, leave) with typed inputs
(:class:`~hetd.protocol.messages.JoinIn`, :class:`~hetd.protocol.messages.PushIn`); the admin API
sends others (swap policy, status, checkpoint). For each event the engine updates its facts, asks
the policy for decisions, applies them to the store, and hands typed replies (welcome, ack, plan,
profile request) and encoded parameter frames to per-session :class:`Peer` outboxes, which never
block it. Time comes from an injected :class:`Clock`; the engine imports neither aiohttp nor the
wire format, so the simulator drives the same code under a virtual clock.

The engine owns one :class:`WorkerEntry` per worker (facts, counters, plan, peer, the parameters
it holds), active or departed, and its whole training state as an :class:`EngineState`
(:meth:`Engine.state` / :meth:`Engine.restore`; checkpoints store that).

Under :meth:`Engine.run` (the daemon) a released worker's parameters are not encoded at once: the
engine first takes whatever else is already queued (up to :data:`BATCH` commands), then *publishes*
once — applies the batch's updates (one optimizer step of their weighted sum per kind:
:attr:`hetd.core.store.Store.combine`), takes the snapshot and encodes each (codec, held version)'s
frames once — in a worker thread for models of :data:`OFF_LOOP_PARAMS` or more, while the engine
task awaits it, so one writer still owns the state and the sockets keep flowing. Called directly
(unit tests), every command publishes synchronously before it returns; after
:meth:`Engine.defer_publishing` (the simulator) the caller publishes each batch with
:meth:`Engine.publish_batch`, as :meth:`Engine.run` does.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable
from typing import Any, Literal

from hetd.core import commands as cmd
from hetd.core.decisions import DecisionsMixin
from hetd.core.entries import (
    LINK_WINDOW,
    EngineBase,
    EngineConfig,
    WorkerEntry,
    WorkerStats,
)
from hetd.core.evals import Keeper, metrics_of
from hetd.core.ingest import update_norm
from hetd.core.members import PROFILE_KEYS, MembersMixin
from hetd.core.peers import Clock, MonotonicClock, Peer
from hetd.core.publish import OFF_LOOP_PARAMS, PublishMixin
from hetd.core.saved import EngineState, SavedWorker, StateMixin
from hetd.core.views import ViewsMixin
from hetd.protocol.messages import ErrorReply, PushIn
from policies.types import Pull, Push, Tick

__all__ = [
    "BATCH",
    "LINK_WINDOW",
    "OFF_LOOP_PARAMS",
    "PROFILE_KEYS",
    "Clock",
    "Engine",
    "EngineBase",
    "EngineConfig",
    "EngineState",
    "MonotonicClock",
    "Peer",
    "SavedWorker",
    "WorkerEntry",
    "WorkerStats",
]

log = logging.getLogger("hetd.core.engine")

BATCH = 64  # commands at most taken before one publish
EWMA = 0.5  # smoothing of per-worker timing facts (docs/policies.md)


class Engine(MembersMixin, ViewsMixin, StateMixin, DecisionsMixin, PublishMixin):
    """Owns the workers' entries, policy state, the store and the aggregation buffers. Its parts:
    :class:`~hetd.core.entries.EngineBase` (fields, tables, the view),
    :class:`~hetd.core.members.MembersMixin` (joins, leaves, profiles, heartbeats),
    :class:`~hetd.core.decisions.DecisionsMixin` (the policy's decisions, policy swaps),
    :class:`~hetd.core.evals.Evaluations` (evaluations, a part of its own),
    :class:`~hetd.core.publish.PublishMixin` (releases, publishing),
    :class:`~hetd.core.replicas.ReplicaMixin` (pipeline replicas),
    :class:`~hetd.core.saved.StateMixin` (checkpoints) and
    :class:`~hetd.core.views.ViewsMixin` (summaries). This module keeps the single writer's loop
    and the commands on the hot path (pull, push with its update guard, tick)."""

    # --- the single writer -----------------------------------------------------------------------

    async def call(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` on the engine task and return its result (or raise its error)."""
        done: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self.submit(cmd.Call(fn, done))
        return await done

    def handle(self, command: cmd.Command) -> Any:
        """Carry out one command now (on the engine task, or synchronously in tests and the
        simulator); a :class:`~hetd.core.commands.Join` returns the worker's id, a
        :class:`~hetd.core.commands.Call` its function's result."""
        match command:
            case cmd.Push(push):
                self.push(push)
            case cmd.Pull(wid, have):
                self.pull(wid, have)
            case cmd.Heartbeat(wid):
                self.heartbeat(wid)
            case cmd.Join(hello, peer, on_id):
                return self.join(hello, peer, on_id)
            case cmd.Leave(wid, reason, peer):
                self.leave(wid, reason, peer)
            case cmd.ProfileResult(wid, result):
                self.profile_result(wid, result)
            case cmd.Resend(wid, peer):
                self.resend(wid, peer)
            case cmd.Transport(wid, peer, transport, sink):
                if sink is not None:
                    self.store.frame_sink = sink
                self.set_transport(wid, peer, transport)
            case cmd.Tick():
                self.tick()
            case cmd.EvalDue():
                self._evaluate_if_due(self.clock.now())
            case cmd.EvalDone(result, taken):
                self.record_eval(*result, taken, metrics=metrics_of(result))
            case cmd.DissolveReplica(head, reason):
                self.dissolve_replica(head, reason)
            case cmd.Call(fn, None):
                return fn()
            case cmd.Call(fn, done):
                assert done is not None  # (the case above took None)
                try:
                    result = fn()
                except Exception as exc:
                    if not done.done():
                        done.set_exception(exc)
                else:
                    if not done.done():
                        done.set_result(result)
        return None

    async def run(self) -> None:
        """Process commands until cancelled; a timer task feeds ticks."""
        ticker = asyncio.create_task(self._ticker())
        evals = asyncio.create_task(self.evaluations.timer(self.config.tick_s))
        self._deferred = True
        self.store.combine = True  # a batch's updates: one optimizer step of their weighted sum
        try:
            while True:
                await self._run_batch(await self._queue.get())
        finally:
            self._deferred = False
            self.store.combine = False
            ticker.cancel()
            evals.cancel()
            self.evaluations.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await ticker
            with contextlib.suppress(asyncio.CancelledError):
                await evals

    async def _run_batch(self, first: tuple[float, cmd.Command]) -> None:
        """Run ``first`` and whatever else is already queued (up to :data:`BATCH`), then publish
        once: one snapshot and one encode serve every release of the batch."""
        item: tuple[float, cmd.Command] | None = first
        taken = 0
        while item is not None:
            queued_at, command = item
            start = time.perf_counter()
            self.wait.add(start - queued_at)
            try:
                self.handle(command)
            except Exception:  # a bug in one command must not stop training
                log.exception("engine command %s failed", type(command).__name__)
            self.latency.add(time.perf_counter() - start)
            taken += 1
            item = self._queue.get_nowait() if taken < BATCH and not self._queue.empty() else None
        if self._releases or self.store.pending or self._replica_releases:
            start = time.perf_counter()
            self.publishes += 1
            await self._publish()
            self.publish_latency.add(time.perf_counter() - start)

    async def _ticker(self) -> None:
        while True:
            await asyncio.sleep(self.config.tick_s)
            self.submit(cmd.Tick())

    # --- commands (run on the engine task only) -----------------------------------------------------

    def pull(self, wid: int, have: int | None = None) -> None:
        """A worker asks for parameters (``have``: the version it holds; None: send them in full);
        the gate decides when it gets them."""
        entry = self._workers.get(wid)
        if entry is None:
            return
        if self.replica_of(wid) is not None:
            # A stage without its step's base: the newest in full, outside any gate (the
            # replica's steps are released with its head).
            entry.stats.last_seen = self.clock.now()
            self.resend(wid)
            return
        facts = entry.facts
        now = self.clock.now()
        entry.stats.last_seen = now
        held = facts.version if have is not None and have == facts.version else -1
        self._put(
            entry,
            dataclasses.replace(
                facts, waiting=True, waiting_since=facts.waiting_since or now, version=held
            ),
        )
        self._dispatch(Pull(now, wid))

    def push(self, p: PushIn) -> None:
        """One validated update: facts, policy, store, ack."""
        entry = self._workers.get(p.worker)
        if entry is None:
            return
        facts = entry.facts
        now = self.clock.now()
        st = entry.stats
        st.last_seen = now
        if p.id <= entry.last_push:  # seen before (sent again, or after a reconnect): never twice
            st.duplicates += 1
            why = (
                f"push {p.id} was received before (last push {entry.last_push}); not applied again"
            )
            self._ack(p, "duplicate", why)
            return
        if p.worker in self._stages:  # a data-parallel step that ended after its worker became
            st.dropped += 1  # a replica's stage: the policy no longer counts it
            entry.last_push = max(entry.last_push, p.id)
            self._ack(p, "dropped", "the worker is a stage of a pipeline replica now")
            return
        refusal = self._guard(p)
        if refusal is not None:  # nothing of it counts: the worker goes on from what it holds
            st.refused += 1
            log.warning("worker %d: push %d refused: %s", p.worker, p.id, refusal)
            if entry.peer is not None:
                entry.peer.send(ErrorReply(p.id, "out_of_range", refusal))
            return
        entry.last_push = p.id  # from here on, this push is answered with an ack
        if facts.waiting:  # one release ends the wait: it answers this push too (publish)
            entry.joined_pushes += 1
        st.pushes += 1
        st.bytes_in += p.nbytes
        self.bytes_in += p.nbytes
        st.worker_idle_s += p.idle_s or 0.0
        staleness = max(0, self.store.version - p.base)
        st.staleness.append(staleness)
        if len(st.staleness) > 4096:
            del st.staleness[:2048]

        def ewma(old: float | None, new: float) -> float:
            return new if old is None else EWMA * new + (1 - EWMA) * old

        new = dataclasses.replace(
            facts,
            clock=facts.clock + 1,
            waiting=True,
            waiting_since=now,
            prev_push_at=facts.last_push_at,
            last_push_at=now,
            compute_s=ewma(facts.compute_s, p.compute_s),
            sample_s=ewma(facts.sample_s, p.compute_s / max(1, p.samples))
            if p.samples
            else facts.sample_s,
            push_bytes=ewma(facts.push_bytes, float(p.nbytes)),
            link_bps=self._link_rate(st, p.nbytes, p.transfer_s, facts.link_bps),
            samples=facts.samples + p.samples,
            free_mem=p.free_mem if p.free_mem is not None else facts.free_mem,
        )
        self._put(entry, new)
        kind: Literal["grad", "delta"] = "grad" if p.kind == "grad" else "delta"
        event = Push(now, p.worker, p.base, kind, p.samples, p.steps, p.compute_s, p.loss)
        if p.base > self.store.version or staleness > self.config.max_staleness:
            why = "base version from the future" if p.base > self.store.version else "too stale"
            self._ack(p, "dropped", why)
            st.dropped += 1
            self._dispatch(Tick(now))  # the clock moved: gates may open
            return
        self._dispatch(event, p)

    def _guard(self, p: PushIn) -> str | None:
        """Why the update guard refuses push ``p`` (None: it passes)."""
        if not self.guard.on:
            return None
        norm = p.norm if p.norm is not None else update_norm(p.tensors)
        return self.guard.check(p.kind, norm)

    def tick(self) -> None:
        """Time passes: heartbeats, evaluation, and a chance for gates to open."""
        now = self.clock.now()
        self.rates.sample(now, self.updates_applied, self.bytes_in, self.bytes_out)
        for wid, entry in list(self._workers.items()):
            if now - entry.stats.last_seen > self.config.heartbeat_timeout_s:
                self.leave(wid, "heartbeat timeout")
        self._evaluate_if_due(now)
        self._dispatch(Tick(now))

    # --- evaluations (hetd.core.evals.Evaluations) -------------------------------------------------

    def _evaluate_if_due(self, now: float) -> None:
        event = self.evaluations.due(now, self.store.snapshot)
        if event is not None:
            self._dispatch(event)

    def record_eval(
        self,
        loss: float,
        accuracy: float,
        taken: float | None = None,
        metrics: dict[str, float] | None = None,
    ) -> None:
        """Store an evaluation (:meth:`Evaluations.record`) and tell the policy."""
        self._dispatch(self.evaluations.record(loss, accuracy, taken, metrics))

    def anchor_evals(self, at: float) -> None:
        """Evaluate at ``at`` + k × ``eval_interval_s`` from now on (engine clock): the real bench
        puts the grid on its t = 0, where the simulator evaluates."""
        self.evaluations.anchor(at)

    def keep_evals(self, keeper: Keeper | None) -> None:
        """Defer evaluations to ``keeper`` (:meth:`Evaluations.keep`; ValueError if the running
        policy reads ``Eval`` events; a policy swapped in later is checked by the caller)."""
        self.evaluations.keep(keeper, self.policy)
