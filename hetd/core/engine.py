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
import hmac
import logging
import math
import secrets
import statistics
import time
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any, Literal

import numpy as np

from hetd.codecs import registry as codecs
from hetd.core.entries import (
    LINK_WINDOW,
    Clock,
    EngineBase,
    EngineConfig,
    MonotonicClock,
    Peer,
    WorkerEntry,
    WorkerStats,
)
from hetd.core.ingest import update_norm
from hetd.core.publish import OFF_LOOP_PARAMS, PublishMixin
from hetd.core.saved import EngineState, SavedWorker, StateMixin
from hetd.core.store import Aggregator, Snapshot, make_outer
from hetd.core.views import ViewsMixin
from hetd.protocol.messages import (
    Ack,
    AckStatus,
    Bye,
    ErrorReply,
    JoinIn,
    PlanUpdate,
    ProfileRequest,
    PushIn,
    Welcome,
)
from policies.compose import Resolved, resolve
from policies.registry import PolicyError, make_policy
from policies.types import (
    Apply,
    Buffer,
    ClusterView,
    Drop,
    Eval,
    Event,
    Flush,
    Join,
    Leave,
    Plan,
    Pull,
    Push,
    PushDecision,
    Regroup,
    Release,
    SetPlan,
    SetStage,
    Tick,
    WorkerFacts,
)

__all__ = [
    "BATCH",
    "LINK_WINDOW",
    "OFF_LOOP_PARAMS",
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
PROFILE_KEYS = frozenset({"sample_s", "push_s", "pull_s", "compress_s"})
EWMA = 0.5  # smoothing of per-worker timing facts (docs/policies.md)
GUARD_WINDOW = 256  # accepted pushes' norms per kind the update guard takes its median over
MAX_NORM = math.sqrt(float(np.finfo(np.float32).max))  # a larger norm's square overflows float32


class Engine(ViewsMixin, StateMixin, PublishMixin):
    """Owns the workers' entries, policy state, the store and the aggregation buffers. Its parts:
    :class:`~hetd.core.entries.EngineBase` (fields, tables, the view),
    :class:`~hetd.core.publish.PublishMixin` (releases, publishing),
    :class:`~hetd.core.replicas.ReplicaMixin` (pipeline replicas),
    :class:`~hetd.core.saved.StateMixin` (checkpoints) and
    :class:`~hetd.core.views.ViewsMixin` (summaries)."""

    # --- the single writer -----------------------------------------------------------------------

    def submit(self, command: Callable[[], Any]) -> None:
        """Queue a command (a closure over engine methods) for the engine task."""
        self._queue.put_nowait((time.perf_counter(), command))

    async def call(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` on the engine task and return its result (or raise its error)."""
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()

        def run() -> None:
            try:
                result = fn()
            except Exception as exc:
                if not fut.done():
                    fut.set_exception(exc)
            else:
                if not fut.done():
                    fut.set_result(result)

        self.submit(run)
        return await fut

    async def run(self) -> None:
        """Process commands until cancelled; a timer task feeds ticks."""
        ticker = asyncio.create_task(self._ticker())
        evals = asyncio.create_task(self._eval_timer())
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
            if self._eval_task is not None:
                self._eval_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await ticker
            with contextlib.suppress(asyncio.CancelledError):
                await evals

    async def _run_batch(self, first: tuple[float, Callable[[], Any]]) -> None:
        """Run ``first`` and whatever else is already queued (up to :data:`BATCH`), then publish
        once: one snapshot and one encode serve every release of the batch."""
        item: tuple[float, Callable[[], Any]] | None = first
        taken = 0
        while item is not None:
            queued_at, command = item
            start = time.perf_counter()
            self.wait.add(start - queued_at)
            self._run_command(command)
            self.latency.add(time.perf_counter() - start)
            taken += 1
            item = self._queue.get_nowait() if taken < BATCH and not self._queue.empty() else None
        if self._releases or self.store.pending or self._replica_releases:
            start = time.perf_counter()
            self.publishes += 1
            await self._publish()
            self.publish_latency.add(time.perf_counter() - start)

    def _run_command(self, command: Callable[[], Any]) -> None:
        try:
            command()
        except Exception:  # a bug in one command must not stop training
            log.exception("engine command failed")

    async def _ticker(self) -> None:
        while True:
            await asyncio.sleep(self.config.tick_s)
            self.submit(self.tick)

    async def _eval_timer(self) -> None:
        """Evaluations on their grid, not at the first tick after it (ticks are 0.25 s apart)."""
        while True:
            due = self._last_eval + self.config.eval_interval_s - self.clock.now()
            await asyncio.sleep(max(0.01, due) if math.isfinite(due) else self.config.tick_s)
            self.submit(lambda: self._evaluate_if_due(self.clock.now()))

    # --- commands (run on the engine task only) -----------------------------------------------------

    def join(self, hello: JoinIn, peer: Peer, on_id: Callable[[int], None] | None = None) -> int:
        """Admit a worker: facts, plan, welcome with a new random secret; the policy decides when
        it may start. A worker that says it is a known one (``resume_id``) and shows that worker's
        secret gets its id, clock, last push id and secret back (an active one's old session
        leaves first: it reconnected before its old socket was seen to die); a wrong or missing
        secret makes it a new worker. ``on_id`` is called with the worker's id once it is
        welcomed and before the policy hears of it (the session routes pipeline frames to it
        from then on: a policy may put the worker in a replica at once)."""
        now = self.clock.now()
        codec = codecs.negotiate(list(hello.codecs), self.config.codec)  # raises before any change
        saved: WorkerFacts | None = None
        last_push = 0
        secret = ""
        rid = hello.resume_id
        if rid is not None and self._may_resume(rid, hello.resume_secret):
            if rid in self._workers:
                self.leave(rid, "resumed on a new connection")
            old = self._departed.pop(rid)
            wid, saved, last_push, secret = rid, old.facts, old.last_push, old.secret
        else:
            if rid is not None:
                log.warning("worker %s: resume refused (wrong or no secret); a new id", rid)
            wid = self._next_id
            self._next_id += 1
        secret = secret or secrets.token_urlsafe(32)
        start_clock = self.view().min_clock() if self._workers else 0
        if saved is not None:  # a returning worker keeps its clock, never below the slowest
            start_clock = max(saved.clock, start_clock) if self._workers else saved.clock
        used = {e.stats.slot for e in self._workers.values()}
        slot = next(i for i in range(len(used) + 1) if i not in used)
        facts = WorkerFacts(
            worker=wid,
            name=hello.name,
            clock=start_clock,
            version=-1,  # holds nothing yet: its first parameters go in full
            waiting=True,
            joined_at=now,
            batch_size=self.config.batch_size,
            free_mem=hello.free_mem,
            codec=codec,
            waiting_since=now,
            stages="stages" in hello.features,
        )
        entry = WorkerEntry(
            facts=facts,
            stats=WorkerStats(last_seen=now, device=dict(hello.device), slot=slot),
            plan=self._default_plan(facts, self.stage),
            peer=peer,
            same_host=hello.same_host,
            hashes="hash" in hello.features,
            last_push=last_push,
            secret=secret,
        )
        self._workers[wid] = entry
        self._facts[wid] = facts
        # Automatic shards are disjoint for up to 4 workers (fewer workers leave some data unused:
        # set [train] shards to their number). Overlapping shares (the first worker on everything,
        # the k-th on 1/k) covered all data but trained the 4-worker demo ~30 % slower.
        shards = self.config.shards or max(4, len(self._workers))
        peer.send(
            Welcome(
                id=hello.id,
                worker_id=wid,
                plan=entry.plan,
                heartbeat_s=self.config.heartbeat_s,
                shard=slot % shards,
                shards=shards,
                setup=self.config.welcome,
                secret=secret,
            )
        )
        if self.config.profile_steps > 0:
            peer.send(ProfileRequest(self.config.profile_steps, self.config.batch_size))
        log.info("worker %d (%s) joined on slot %d, codec %s", wid, hello.name, slot, codec)
        if on_id is not None:
            on_id(wid)
        self._dispatch(Join(now, wid))
        return wid

    def _may_resume(self, wid: int, secret: str | None) -> bool:
        """Whether ``secret`` is known worker ``wid``'s (compared in constant time)."""
        entry = self._workers.get(wid) or self._departed.get(wid)
        if entry is None or not entry.secret or not secret:
            return False
        return hmac.compare_digest(secret.encode(), entry.secret.encode())

    def leave(self, wid: int, reason: str, peer: Peer | None = None) -> None:
        """A worker left; it leaves every barrier at once (its entry is kept as departed).
        ``peer``: the session that ended; nothing happens when the worker is now on another one
        (it resumed on a new connection first)."""
        entry = self._workers.get(wid)
        if entry is None or (peer is not None and entry.peer is not peer):
            return
        del self._workers[wid]
        in_view = self._facts.pop(wid, None) is not None
        head = self.replica_of(wid)
        if head is not None:  # its replica cannot go on: the others go back to data parallel
            self.dissolve_replica(head, f"worker {wid} left")
        peer, entry.peer, entry.held_ref, entry.same_host = entry.peer, None, None, False
        entry.hashes = False
        self._departed[wid] = entry
        if peer is not None:
            peer.close(reason)
        self.departures.append((self.clock.now() - self.started_at, wid, reason))
        log.info("worker %d left: %s", wid, reason)
        if in_view:  # a replica's later stage left the view when the replica formed
            self._dispatch(Leave(self.clock.now(), wid, reason))

    def bye_all(self, reason: str) -> None:
        """Say bye to every worker and let it leave (they may reconnect later)."""
        for wid, entry in list(self._workers.items()):
            if entry.peer is not None:
                entry.peer.send(Bye(reason))
            self.leave(wid, reason)

    def profile_result(self, wid: int, result: Mapping[str, Any]) -> None:
        """A worker's profile run: finite, non-negative seconds for the known keys go into its
        facts (anything else is ignored); policies see it with the next event."""
        entry = self._workers.get(wid)
        if entry is None:
            return
        clean = {
            k: float(v)
            for k, v in result.items()
            if k in PROFILE_KEYS
            and isinstance(v, int | float)
            and not isinstance(v, bool)
            and math.isfinite(v)
            and v >= 0
        }
        self._put(entry, dataclasses.replace(entry.facts, profile=clean))
        entry.stats.last_seen = self.clock.now()
        log.info("worker %d profile: %s", wid, clean)
        self._dispatch(Tick(self.clock.now()))

    def heartbeat(self, wid: int) -> None:
        """A sign of life."""
        entry = self._workers.get(wid)
        if entry is not None:
            entry.stats.last_seen = self.clock.now()

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
        """Why the update guard refuses push ``p`` (None: it passes, and its norm joins the
        median window of its kind). A norm whose square overflows float32 is refused whenever the
        guard is on, warm-up included."""
        factor = self.config.guard_factor
        if factor <= 0:
            return None
        norm = p.norm if p.norm is not None else update_norm(p.tensors)
        if not norm < MAX_NORM:
            return f"update norm {norm:.3g} is out of range for a float32 model; not applied"
        window = self.guard_norms.get(p.kind)
        if window is None:
            window = self.guard_norms[p.kind] = deque(
                maxlen=max(GUARD_WINDOW, self.config.guard_warmup)
            )
        if window and len(window) >= self.config.guard_warmup:
            median = statistics.median(window)
            if median > 0 and norm > factor * median:
                return (
                    f"update norm {norm:.3g} is over {factor:g} x the median {median:.3g} of the "
                    f"last {len(window)} accepted {p.kind} pushes; not applied"
                )
        window.append(norm)
        return None

    def swap_policy(self, name: str, params: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """Replace the policy between two events, all or nothing.

        The new policy is built, initialised and asked for its first decisions (a ``Tick``) on a
        trial view in which every active worker's plan is back at its defaults (a join's plan),
        the stage is ``"main"`` and nothing is buffered; its plans and stage are worked out from
        those decisions. Any error on the way raises :class:`PolicyError` and nothing has changed:
        the old policy, its state, the stage and every plan stay. Then the swap is carried out:
        buffered pushes are applied (never lost), the policy, its state, the stage and the plans
        change together (each worker whose plan changed is told once), and the first decisions'
        releases and flushes are carried out.
        """
        new = make_policy(name, params)
        now = self.clock.now()
        # the replicas and data-parallel workers the policy sees (not a replica's later stages)
        visible = {wid: e for wid, e in self._workers.items() if wid in self._facts}
        plans = {wid: self._default_plan(e.facts, "main") for wid, e in visible.items()}
        # Every worker starts the new policy's first round together: clocks counted under the
        # old one (under asp the fast workers run rounds ahead) would make a synchronous policy
        # hold them until the slowest caught up (seen: 2 s without an update after asp -> bsp).
        top = max((e.facts.clock for e in visible.values()), default=0)
        trial = ClusterView(
            now=now,
            version=self.store.version,
            workers={
                wid: dataclasses.replace(e.facts, batch_size=plans[wid].batch_size, clock=top)
                for wid, e in visible.items()
            },
            global_batch=self.config.global_batch,
            buffered=0,
            stage="main",
        )
        stage = "main"
        try:
            outer = (
                None if self.config.outer_for is None else self.config.outer_for(name, new.params)
            )
            if outer is not None:
                make_outer(outer)  # a bad spec refuses the swap here
            decisions, state = new.update(Tick(now), new.init(trial), trial)
            first = resolve(decisions)  # raises on an unknown plan field or a wrong value
            for d in first.plans:
                if isinstance(d, SetStage):
                    stage = d.stage
                    plans = {wid: plan.merge({"stage": stage}) for wid, plan in plans.items()}
                elif isinstance(d, SetPlan) and d.worker in plans:
                    plans[d.worker] = plans[d.worker].merge(d.fields)
        except Exception as exc:
            raise PolicyError(
                f"policy {name!r} failed to start: {type(exc).__name__}: {exc}"
            ) from exc
        # Nothing below refuses: the swap happens as a whole.
        if self.buffered():  # never lose buffered updates: apply them before the change
            self._flush(Flush(normalize=True))
        old = self.policy.name
        self.policy, self.policy_state = new, state
        # after the flush, which applied the old policy's rounds through the old one
        if outer is not None and self.store.set_outer(outer):
            log.info("outer optimizer -> %s (state reset)", self.store.outer_spec)
        if stage != self.stage:
            at = now - self.started_at
            log.info("stage %s -> %s at %.2f s (policy swap)", self.stage, stage, at)
            self.stage = stage
            self.stages.append((at, stage))
        for wid, plan in plans.items():
            entry = self._workers[wid]
            changed = plan != entry.plan
            entry.plan = plan
            self._put(
                entry, dataclasses.replace(entry.facts, batch_size=plan.batch_size, clock=top)
            )
            if changed and entry.peer is not None:
                entry.peer.send(PlanUpdate(plan))
        for entry in self._departed.values():  # one that returns rejoins the same round
            entry.facts = dataclasses.replace(entry.facts, clock=min(entry.facts.clock, top))
        log.info("policy swapped: %s -> %s %s", old, new.name, dict(new.params))
        self._execute(Resolved((), first.scale, first.actions), None)
        return new.describe()

    def _default_plan(self, facts: WorkerFacts, stage: str) -> Plan:
        """A worker's plan before any policy changes it: the configured batch, pushes in the
        codec its parameters come in, nothing else set."""
        return Plan(batch_size=self.config.batch_size, codec=facts.codec, stage=stage)

    def tick(self) -> None:
        """Time passes: heartbeats, evaluation, and a chance for gates to open."""
        now = self.clock.now()
        self.rates.sample(now, self.updates_applied, self.bytes_in, self.bytes_out)
        for wid, entry in list(self._workers.items()):
            if now - entry.stats.last_seen > self.config.heartbeat_timeout_s:
                self.leave(wid, "heartbeat timeout")
        self._evaluate_if_due(now)
        self._dispatch(Tick(now))

    def anchor_evals(self, at: float) -> None:
        """Evaluate at ``at`` + k × ``eval_interval_s`` from now on (engine clock): the real bench
        puts the grid on its t = 0, where the simulator evaluates."""
        self._last_eval = at

    def _evaluate_if_due(self, now: float) -> None:
        """Start an evaluation when the next point of the grid (``eval_interval_s`` apart, at a
        fixed rate: a late one does not move the next) is due and none is running."""
        interval = self.config.eval_interval_s
        if (
            self.evaluator is not None
            and self._eval_task is None
            and now - self._last_eval >= interval
        ):
            last = self._last_eval
            self._last_eval = now if not math.isfinite(last) else now - (now - last) % interval
            if self.config.eval_inline:
                loss, acc = self.evaluator(self.store.snapshot())
                self.record_eval(loss, acc, now)
            else:
                self._eval_task = asyncio.get_running_loop().create_task(
                    self._evaluate(self.store.snapshot(), now)
                )

    async def _evaluate(self, snap: Snapshot, taken: float) -> None:
        assert self.evaluator is not None  # checked by the caller; not network input
        try:
            loss, acc = await asyncio.to_thread(self.evaluator, snap)
        finally:
            self._eval_task = None
        self.submit(lambda: self.record_eval(loss, acc, taken))

    def record_eval(self, loss: float, accuracy: float, taken: float | None = None) -> None:
        """Store an evaluation and tell the policy. ``taken`` (engine clock, default now) is when
        the evaluated parameters were snapshotted: ``evals`` keeps that time, not the end of an
        evaluation that took seconds on a loaded host (a time-to-target read from it would be
        late by as much, and the real bench's t = 0 restart would see an evaluation of the
        parameters before it land after it)."""
        now = self.clock.now()
        at = now if taken is None else taken
        self.evals.append((at - self.started_at, loss, accuracy))
        self._dispatch(Eval(now, loss, accuracy))

    # --- decisions -------------------------------------------------------------------------------

    def _dispatch(self, event: Event, push: PushIn | None = None) -> None:
        try:
            decisions, state = self.policy.update(event, self.policy_state, self.view())
            resolved = resolve(decisions)  # raises on a policy bug (e.g. an unknown plan field)
        except Exception:
            log.exception(
                "policy %s failed on %s; applying asynchronously", self.policy.name, event
            )
            state = self.policy_state
            fallback = () if push is None else (Apply(1.0 / max(1, len(self.facts))),)
            resolved = resolve(fallback)
        self.policy_state = state
        self._execute(resolved, push)

    def _execute(self, r: Resolved, push: PushIn | None) -> None:
        """Carry out one event's resolved decisions (the rules are :func:`policies.resolve`'s)."""
        # Plans first, so a worker released by this event computes under its new plan.
        for d in r.plans:
            if isinstance(d, SetStage):
                self._set_stage(d.stage)
            elif isinstance(d, Regroup):
                self._regroup(d.replicas)
            else:
                self._set_plan(d.worker, d.fields)
        for a in r.actions:
            if isinstance(a, Flush):
                self._flush(a)
            elif isinstance(a, Release):
                self._release(a.worker)
            elif push is not None:
                self._decide_push(a, push, r.scale)
        if push is not None and r.push is None:
            # A policy that says nothing about a push must not lose it.
            log.warning("policy %s made no decision on a push; applying it", self.policy.name)
            self._decide_push(Apply(1.0 / max(1, len(self.facts))), push, r.scale)

    def _decide_push(self, d: PushDecision, p: PushIn, factor: float) -> None:
        st = self.stats[p.worker]
        if isinstance(d, Apply):
            self.store.apply(p.kind, p.tensors, d.weight * factor)
            self.updates_applied += 1
            st.applied += 1
            self._ack(p, "applied")
        elif isinstance(d, Buffer):
            self.buffers.setdefault(d.group, Aggregator()).add(p.kind, p.tensors, d.weight * factor)
            st.buffered += 1
            self._ack(p, "buffered")
        elif isinstance(d, Drop):
            st.dropped += 1
            self._ack(p, "dropped", d.reason)

    def _flush(self, d: Flush) -> None:
        groups = sorted(g for g in self.buffers if d.upto is None or g <= d.upto)
        for g in groups:
            agg = self.buffers.pop(g, None)
            if agg is None or not agg.count:
                continue
            for kind, tensors in agg.take(d.normalize):
                self.store.apply(kind, tensors, d.scale)
            self.updates_applied += 1

    def _set_plan(self, wid: int, fields: Mapping[str, Any]) -> None:
        entry = self._workers.get(wid)
        if entry is None:
            return
        plan = entry.plan
        new = plan.merge(fields)  # checked: resolve() raised on unknown fields already
        if new == plan:
            return
        entry.plan = new
        self._put(entry, dataclasses.replace(entry.facts, batch_size=new.batch_size))
        if entry.peer is not None:
            entry.peer.send(PlanUpdate(new))

    def _set_stage(self, stage: str) -> None:
        if stage == self.stage:
            return
        at = self.clock.now() - self.started_at
        log.info("stage %s -> %s at %.2f s", self.stage, stage, at)
        self.stage = stage
        self.stages.append((at, stage))
        for wid in list(self._workers):
            self._set_plan(wid, {"stage": stage})

    def _ack(self, p: PushIn, status: AckStatus, reason: str | None = None) -> None:
        entry = self._workers.get(p.worker)
        if entry is not None and entry.peer is not None:
            entry.peer.send(Ack(p.id, self.store.version, status, reason))
