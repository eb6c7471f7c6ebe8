"""The single writer: one asyncio task owns all training state and reads one queue of commands.

Sessions put commands on the queue (join, push, pull, heartbeat, leave) with typed inputs
(:class:`~hetd.protocol.messages.JoinIn`, :class:`~hetd.protocol.messages.PushIn`); the admin API
sends others (swap policy, status, checkpoint). For each event the engine updates its facts, asks
the policy for decisions, applies them to the store, and hands typed replies (welcome, ack, plan,
profile request) and encoded parameter frames to per-session :class:`Peer` outboxes, which never
block it. Time comes from an injected :class:`Clock`; the engine imports neither aiohttp nor the
wire format, so the simulator drives the same code under a virtual clock.

The engine is a router over its parts, each a plain class with its own state:
:class:`~hetd.core.members.Members` (the worker table: joins, resumes, leaves),
:class:`~hetd.core.policy_host.PolicyHost` (the policy, its state, the stage),
:class:`~hetd.core.applier.Applier` (the store and the aggregation buffers),
:class:`~hetd.core.publish.Publisher` (releases and the downlink),
:class:`~hetd.core.replicas.Replicas` (pipeline replicas),
:class:`~hetd.core.evals.Evaluations`, :class:`~hetd.core.guard.UpdateGuard` and
:class:`~hetd.core.rates.Meters`. Commands (:mod:`hetd.core.commands`) come in through
:meth:`Engine.handle`; the parts' policy events go to the policy, and its decisions back to the
parts. Its whole training state is an :class:`EngineState` (:meth:`Engine.state` /
:meth:`Engine.restore`; checkpoints store that).

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
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Literal

from hetd.codecs import registry as codecs
from hetd.core import commands as cmd
from hetd.core import saved
from hetd.core.applier import Applier
from hetd.core.entries import (
    LINK_WINDOW,
    EngineConfig,
    WorkerEntry,
    WorkerStats,
    block_facts,
)
from hetd.core.evals import Evaluations, Keeper, metrics_of
from hetd.core.guard import UpdateGuard
from hetd.core.ingest import update_norm
from hetd.core.members import PROFILE_KEYS, Members
from hetd.core.peers import Clock, MonotonicClock, Peer
from hetd.core.policy_host import PolicyHost
from hetd.core.publish import OFF_LOOP_PARAMS, Publisher
from hetd.core.rates import Meters
from hetd.core.replicas import Replicas
from hetd.core.saved import EngineState, SavedWorker
from hetd.core.store import Snapshot, Store
from hetd.core.views import status, worker_rows
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
from policies.compose import Resolved
from policies.types import (
    Apply,
    Buffer,
    ClusterView,
    Drop,
    Event,
    Flush,
    Join,
    Leave,
    Plan,
    Policy,
    Pull,
    Push,
    PushDecision,
    Regroup,
    Release,
    SetStage,
    Tick,
    WorkerFacts,
)

__all__ = [
    "BATCH",
    "LINK_WINDOW",
    "OFF_LOOP_PARAMS",
    "PROFILE_KEYS",
    "Clock",
    "Engine",
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


class Engine:
    """Routes commands to the parts, events to the policy and its decisions back."""

    def __init__(
        self,
        store: Store,
        policy: Policy,
        config: EngineConfig,
        clock: Clock | None = None,
        evaluator: Callable[[Snapshot], tuple[float, float]] | None = None,
    ) -> None:
        self.store = store
        store.hashes = config.param_hashes  # a snapshot's frame carries its hash (or not)
        self.config = config
        self.clock: Clock = clock or MonotonicClock()
        self.started_at = self.clock.now()
        self._queue: asyncio.Queue[tuple[float, cmd.Command]] = asyncio.Queue()
        self.meters = Meters()
        self.members = Members(config, self.clock, self.started_at)
        self.applier = Applier(store)
        self.publisher = Publisher(self.members, store, config, self.meters)
        self.pipelines = Replicas(self.members, block_facts(store.shapes))
        self.guard = UpdateGuard(config.guard_factor, config.guard_warmup)
        self.evaluations = Evaluations(
            self.clock,
            self.started_at,
            config.eval_interval_s,
            config.eval_inline,
            self.submit,
            evaluator,
        )
        self.host = PolicyHost(policy, self.clock, self.started_at)
        self.host.state = policy.init(self.view())

    # --- what callers read (each part's own) --------------------------------------------------------

    @property
    def entries(self) -> Mapping[int, WorkerEntry]:
        """The active workers' entries, by id (read-only, live)."""
        return self.members.entries

    @property
    def facts(self) -> Mapping[int, WorkerFacts]:
        """The facts the policy sees, by id (read-only, live; not a replica's later stages)."""
        return self.members.facts

    @property
    def departed(self) -> Mapping[int, WorkerFacts]:
        """The facts of workers that left (or that a restored checkpoint knows), by id."""
        return self.members.departed

    @property
    def stats(self) -> Mapping[int, WorkerStats]:
        """Every worker's counters, active or departed, by id (read-only, live)."""
        return self.members.stats

    @property
    def plans(self) -> Mapping[int, Plan]:
        return self.members.plans

    @property
    def departures(self) -> Sequence[tuple[float, int, str]]:
        """The last departures: (s since start, worker, reason)."""
        return self.members.departures

    @property
    def replicas(self) -> Mapping[int, tuple[int, ...]]:
        """The pipeline replicas, head -> members in stage order (read-only, live)."""
        return self.pipelines.view

    @property
    def policy(self) -> Policy:
        return self.host.policy

    @policy.setter
    def policy(self, policy: Policy) -> None:
        self.host.policy = policy

    @property
    def policy_state(self) -> Any:
        return self.host.state

    @policy_state.setter
    def policy_state(self, state: Any) -> None:
        self.host.state = state

    @property
    def stage(self) -> str:
        return self.host.stage

    @property
    def stages(self) -> list[tuple[float, str]]:
        """(s since start, stage entered), each switch."""
        return self.host.stages

    @property
    def updates_applied(self) -> int:
        return self.applier.updates_applied

    @property
    def evals(self) -> list[tuple[float, float, float]]:
        """Every evaluation: (s since start, loss, accuracy)."""
        return self.evaluations.evals

    def buffered(self) -> int:
        """Pushes waiting in aggregation buffers."""
        return self.applier.buffered()

    # --- the single writer -----------------------------------------------------------------------

    def submit(self, command: cmd.Command) -> None:
        """Queue a command for the engine task."""
        self._queue.put_nowait((time.perf_counter(), command))

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
                self.members.seen(wid)
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
        """Process commands until cancelled; timer tasks feed ticks and evaluations."""
        ticker = asyncio.create_task(self._ticker())
        evals = asyncio.create_task(self.evaluations.timer(self.config.tick_s))
        self.defer_publishing()
        try:
            while True:
                await self._run_batch(await self._queue.get())
        finally:
            self.publisher.deferred = False
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
        m = self.meters
        item: tuple[float, cmd.Command] | None = first
        taken = 0
        while item is not None:
            queued_at, command = item
            start = time.perf_counter()
            m.wait.add(start - queued_at)
            try:
                self.handle(command)
            except Exception:  # a bug in one command must not stop training
                log.exception("engine command %s failed", type(command).__name__)
            m.latency.add(time.perf_counter() - start)
            taken += 1
            item = self._queue.get_nowait() if taken < BATCH and not self._queue.empty() else None
        if self._to_publish():
            start = time.perf_counter()
            m.publishes += 1
            wants = self.publisher.take()
            try:
                if self.store.n_params >= OFF_LOOP_PARAMS:
                    frames = await asyncio.to_thread(self.publisher.encode, wants)
                else:
                    frames = self.publisher.encode(wants)
            except Exception:
                log.exception("publishing parameters failed; dropping %d session(s)", len(wants))
                why = "the daemon could not encode parameters for this worker; reconnect"
                self.publisher.drop(wants, why)
            else:
                self.publisher.send_all(wants, frames)
            self._run_replicas()
            m.publish_latency.add(time.perf_counter() - start)

    async def _ticker(self) -> None:
        while True:
            await asyncio.sleep(self.config.tick_s)
            self.submit(cmd.Tick())

    def defer_publishing(self) -> None:
        """Publish as the daemon does, for a caller that runs commands in batches without
        :meth:`run` (the simulator's daemon server): releases wait for :meth:`publish_batch`,
        and the updates queued in between go through one optimizer step of their weighted sum."""
        self.publisher.deferred = True
        self.store.combine = True

    def publish_batch(self) -> None:
        """What :meth:`run` does after each batch, synchronously."""
        if self._to_publish():
            self.meters.publishes += 1
            wants = self.publisher.take()
            self.publisher.send_all(wants, self.publisher.encode(wants))
            self._run_replicas()

    def _to_publish(self) -> bool:
        return bool(self.publisher.pending or self.store.pending or self.pipelines.pending)

    # --- worker commands --------------------------------------------------------------------------

    def join(self, hello: JoinIn, peer: Peer, on_id: Callable[[int], None] | None = None) -> int:
        """Admit a worker: facts, plan, welcome with a new random secret; the policy decides when
        it may start. A worker that says it is a known one (``resume_id``) and shows that worker's
        secret gets its id, clock, last push id and secret back (an active one's old session
        leaves first); a wrong or missing secret makes it a new worker. ``on_id`` is called with
        the worker's id once it is welcomed and before the policy hears of it."""
        codec = codecs.negotiate(list(hello.codecs), self.config.codec)  # raises before any change
        members, rid = self.members, hello.resume_id
        if rid in members.active and members.may_resume(rid, hello.resume_secret):
            self._leave(rid, "resumed on a new connection", None, keep=True)
        entry = members.admit(hello, peer, codec, self._default_plan(codec, self.host.stage))
        wid, cuts = entry.facts.worker, members.shard_for(entry)
        peer.send(
            Welcome(
                id=hello.id,
                worker_id=wid,
                plan=entry.plan,
                heartbeat_s=self.config.heartbeat_s,
                shard=entry.shard[0],
                shards=entry.shard[1],
                setup=self.config.welcome,
                secret=entry.secret,
            )
        )
        members.send_cuts(cuts, but=wid)
        if self.config.profile_steps > 0:
            peer.send(ProfileRequest(self.config.profile_steps, self.config.batch_size))
        log.info(
            "worker %d (%s) joined on slot %d, codec %s", wid, hello.name, entry.stats.slot, codec
        )
        if on_id is not None:
            on_id(wid)
        self._dispatch(Join(self.clock.now(), wid))
        return wid

    def leave(self, wid: int, reason: str, peer: Peer | None = None) -> None:
        """A worker left; it leaves every barrier at once (its entry is kept as departed).
        ``peer``: the session that ended; nothing happens when the worker is now on another one
        (it resumed on a new connection first)."""
        self._leave(wid, reason, peer)

    def _leave(self, wid: int, reason: str, peer: Peer | None, keep: bool = False) -> None:
        gone = self.members.remove(wid, reason, peer, keep)
        if gone is None:
            return
        head = self.pipelines.of(wid)
        if head is not None:  # its replica cannot go on: the others go back to data parallel
            self.dissolve_replica(head, f"worker {wid} left")
        if self.config.recut_shards:
            self.members.send_cuts(self.members.recut())
        if gone[1]:  # a replica's later stage left the view when the replica formed
            self._dispatch(Leave(self.clock.now(), wid, reason))

    def bye_all(self, reason: str) -> None:
        """Say bye to every worker and let it leave (they may reconnect later)."""
        for wid in list(self.members.active):
            self.members.send(wid, Bye(reason))
            self.leave(wid, reason)

    def profile_result(self, wid: int, result: Mapping[str, Any]) -> None:
        if self.members.profiled(wid, result):
            self._dispatch(Tick(self.clock.now()))

    def heartbeat(self, wid: int) -> None:
        self.members.seen(wid)

    def pull(self, wid: int, have: int | None = None) -> None:
        """A worker asks for parameters (``have``: the version it holds; None: send them in full);
        the gate decides when it gets them."""
        entry = self.members.active.get(wid)
        if entry is None:
            return
        now = self.clock.now()
        entry.stats.last_seen = now
        if self.pipelines.of(wid) is not None:
            # A stage without its step's base: the newest in full, outside any gate (the
            # replica's steps are released with its head).
            self.resend(wid)
            return
        f = entry.facts
        held = f.version if have is not None and have == f.version else -1
        self.members.update(entry, waiting=True, waiting_since=f.waiting_since or now, version=held)
        self._dispatch(Pull(now, wid))

    def push(self, p: PushIn) -> None:
        """One validated update: facts, policy, store, ack."""
        entry = self.members.active.get(p.worker)
        if entry is None:
            return
        now = self.clock.now()
        st = entry.stats
        st.last_seen = now
        if p.id <= entry.last_push:  # seen before (sent again, or after a reconnect): never twice
            st.duplicates += 1
            last = entry.last_push
            self._ack(
                p,
                "duplicate",
                f"push {p.id} was received before (last push {last}); not applied again",
            )
            return
        if p.worker in self.pipelines.head_of:  # a data-parallel step that ended after its
            st.dropped += 1  # worker became a replica's stage: the policy no longer counts it
            entry.last_push = max(entry.last_push, p.id)
            self._ack(p, "dropped", "the worker is a stage of a pipeline replica now")
            return
        refusal = (
            self.guard.check(p.kind, p.norm if p.norm is not None else update_norm(p.tensors))
            if self.guard.on
            else None
        )
        if refusal is not None:  # nothing of it counts: the worker goes on from what it holds
            st.refused += 1
            log.warning("worker %d: push %d refused: %s", p.worker, p.id, refusal)
            self.members.send(p.worker, ErrorReply(p.id, "out_of_range", refusal))
            return
        entry.last_push = p.id  # from here on, this push is answered with an ack
        if entry.facts.waiting:  # one release ends the wait: it answers this push too
            entry.joined_pushes += 1
        self.meters.bytes_in += p.nbytes
        staleness = max(0, self.store.version - p.base)
        st.staleness.append(staleness)
        if len(st.staleness) > 4096:
            del st.staleness[:2048]
        self.members.pushed(entry, p, now)
        kind: Literal["grad", "delta"] = "grad" if p.kind == "grad" else "delta"
        if p.base > self.store.version or staleness > self.config.max_staleness:
            why = "base version from the future" if p.base > self.store.version else "too stale"
            self._ack(p, "dropped", why)
            st.dropped += 1
            self._dispatch(Tick(now))  # the clock moved: gates may open
            return
        event = Push(now, p.worker, p.base, kind, p.samples, p.steps, p.compute_s, p.loss)
        self._dispatch(event, p)

    def resend(self, wid: int, peer: Peer | None = None) -> None:
        """Send a worker the newest parameters in full, in place of a full frame its outbox
        dropped because it was still writing an earlier one (a slow reader: the dropped frame
        would have pinned one more snapshot). Not a release: the policy is not asked and the
        worker's gates do not change. ``peer``: the session that asked (nothing happens when the
        worker is on another one)."""
        entry = self.members.active.get(wid)
        if entry is None or entry.peer is None or (peer is not None and entry.peer is not peer):
            return
        self.publisher.resend(entry)

    def set_transport(self, wid: int, peer: Peer, transport: str) -> None:
        """Worker ``wid``'s session ``peer`` now carries its big frames by ``transport``
        (``"shm"``: the daemon's shared memory); /v1/workers shows it as ``path``."""
        entry = self.members.active.get(wid)
        if entry is not None and entry.peer is peer:
            entry.transport = transport

    def tick(self) -> None:
        """Time passes: heartbeats, evaluation, and a chance for gates to open."""
        now = self.clock.now()
        m = self.meters
        m.rates.sample(now, self.applier.updates_applied, m.bytes_in, m.bytes_out)
        for wid, entry in list(self.members.active.items()):
            if now - entry.stats.last_seen > self.config.heartbeat_timeout_s:
                self.leave(wid, "heartbeat timeout")
        self.members.evict_due(now)
        self._evaluate_if_due(now)
        self._dispatch(Tick(now))

    # --- replicas ---------------------------------------------------------------------------------

    def form_replica(self, members: Sequence[int]) -> None:
        """Make connected workers ``members`` (stage order) one replica (:meth:`Replicas.form`;
        ValueError before anything changes)."""
        events = self.pipelines.form(members, self.clock.now())
        for wid in members[1:]:
            self.publisher.pending.pop(wid, None)
        self._events(events)

    def dissolve_replica(self, head: int, reason: str = "") -> None:
        """End replica ``head`` (:meth:`Replicas.dissolve`)."""
        self._events(self.pipelines.dissolve(head, reason, self.clock.now()))

    def _run_replicas(self) -> None:
        """After a publish: the released replicas' next steps."""
        for head in self.pipelines.take_pending():
            if not self.pipelines.run(head):
                self.dissolve_replica(head, "no replica driver")

    def replica_of(self, wid: int) -> int | None:
        return self.pipelines.of(wid)

    # --- the policy --------------------------------------------------------------------------------

    def view(self) -> ClusterView:
        """The facts as the policy sees them (active replicas only)."""
        m = self.members
        return ClusterView(
            now=self.clock.now(),
            version=self.store.version,
            workers=m.view_facts,
            global_batch=self.config.global_batch,
            buffered=self.applier.buffered(),
            stage=self.host.stage,
            replicas=self.pipelines.groups,
            stage_workers={w: m.active[w].facts for w in self.pipelines.head_of if w in m.active},
            blocks=self.pipelines.blocks,
        )

    def swap_policy(self, name: str, params: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """Replace the policy between two events, all or nothing.

        The new policy is built, initialised and asked for its first decisions on a trial view
        (:meth:`PolicyHost.trial`); any error raises :class:`PolicyError` and nothing has
        changed. Then the swap is carried out: buffered pushes are applied (never lost), the
        policy, its state, the stage and the plans change together (each worker whose plan
        changed is told once), and the first decisions' releases and flushes are carried out.
        """
        active = self.members.active
        visible = {wid: e.facts for wid, e in active.items() if wid in self.members.view_facts}
        t = self.host.trial(
            name,
            params,
            visible,
            lambda f: self._default_plan(f.codec, "main"),
            self.store.version,
            self.config.global_batch,
            self.config.outer_for,
        )
        # Nothing below refuses: the swap happens as a whole.
        if self.applier.buffered():  # never lose buffered updates: apply them before the change
            self.applier.flush(Flush(normalize=True))
        old = self.host.policy.name
        self.host.install(t.policy, t.state)
        # after the flush, which applied the old policy's rounds through the old one
        if t.outer is not None and self.store.set_outer(t.outer):
            log.info("outer optimizer -> %s (state reset)", self.store.outer_spec)
        self.host.enter(t.stage, "policy swap")
        for wid, plan in t.plans.items():
            entry = active[wid]
            changed = plan != entry.plan
            entry.plan = plan
            self.members.update(entry, batch_size=plan.batch_size, clock=t.top)
            if changed:
                self.members.send(wid, PlanUpdate(plan))
        for gone in self.members.gone.values():  # one that returns rejoins the same round
            gone.facts = dataclasses.replace(gone.facts, clock=min(gone.facts.clock, t.top))
        log.info("policy swapped: %s -> %s %s", old, t.policy.name, dict(t.policy.params))
        self._execute(Resolved((), t.first.scale, t.first.actions), None)
        return t.policy.describe()

    def _default_plan(self, codec: str, stage: str) -> Plan:
        """A worker's plan before any policy changes it: the configured batch, pushes in the
        codec its parameters come in, nothing else set."""
        return Plan(batch_size=self.config.batch_size, codec=codec, stage=stage)

    def _events(self, events: Iterable[Event]) -> None:
        for event in events:
            self._dispatch(event)

    def _dispatch(self, event: Event, push: PushIn | None = None) -> None:
        """Ask the policy about ``event`` and carry out its decisions."""
        self._execute(self.host.decide(event, self.view(), push is not None), push)

    def _execute(self, r: Resolved, push: PushIn | None) -> None:
        """Carry out one event's resolved decisions (the rules are :func:`policies.resolve`'s)."""
        # Plans first, so a worker released by this event computes under its new plan.
        for d in r.plans:
            if isinstance(d, SetStage):
                if self.host.enter(d.stage):
                    for wid in list(self.members.active):
                        self._set_plan(wid, {"stage": d.stage})
            elif isinstance(d, Regroup):
                self.pipelines.regroup(d.replicas, self.host.policy.name)
            else:
                self._set_plan(d.worker, d.fields)
        for a in r.actions:
            if isinstance(a, Flush):
                self.applier.flush(a)
            elif isinstance(a, Release):
                self._release(a.worker)
            elif push is not None:
                self._decide_push(a, push, r.scale)
        if push is not None and r.push is None:
            # A policy that says nothing about a push must not lose it.
            log.warning("policy %s made no decision on a push; applying it", self.host.policy.name)
            self._decide_push(Apply(1.0 / max(1, len(self.members.view_facts))), push, r.scale)

    def _decide_push(self, d: PushDecision, p: PushIn, factor: float) -> None:
        st = self.members.stats[p.worker]
        if isinstance(d, Apply):
            self.applier.apply(p.kind, p.tensors, d.weight * factor)
            st.applied += 1
            self._ack(p, "applied")
        elif isinstance(d, Buffer):
            self.applier.buffer(d.group, p.kind, p.tensors, d.weight * factor)
            st.buffered += 1
            self._ack(p, "buffered")
        elif isinstance(d, Drop):
            st.dropped += 1
            self._ack(p, "dropped", d.reason)

    def _set_plan(self, wid: int, fields: Mapping[str, Any]) -> None:
        entry = self.members.active.get(wid)
        if entry is None:
            return
        new = entry.plan.merge(fields)  # checked: resolve() raised on unknown fields already
        if new == entry.plan:
            return
        entry.plan = new
        self.members.update(entry, batch_size=new.batch_size)
        self.members.send(wid, PlanUpdate(new))

    def _release(self, wid: int) -> None:
        entry = self.members.active.get(wid)
        if entry is None or not entry.facts.waiting or wid in self.pipelines.head_of:
            return  # a replica's later stage is released with its head
        f, now = entry.facts, self.clock.now()
        gap = f.clock - min(x.clock for x in self.members.view_facts.values())
        self.meters.max_release_gap = max(self.meters.max_release_gap, gap)
        idle = now - f.waiting_since if f.waiting_since is not None else 0.0
        self.members.update(entry, waiting=False, waiting_since=None, idle_s=f.idle_s + idle)
        if wid not in self.pipelines.groups:
            self.publisher.release(entry)
        elif self.publisher.deferred:  # its driver runs the step once this batch is applied
            self.pipelines.pending[wid] = None
        else:
            self.store.flush()
            if not self.pipelines.run(wid):
                self.dissolve_replica(wid, "no replica driver")

    def _ack(self, p: PushIn, status: AckStatus, reason: str | None = None) -> None:
        self.members.send(p.worker, Ack(p.id, self.store.version, status, reason))

    # --- evaluations ---------------------------------------------------------------------------------

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
        """Evaluate at ``at`` + k × ``eval_interval_s`` from now on (engine clock)."""
        self.evaluations.anchor(at)

    def keep_evals(self, keeper: Keeper | None) -> None:
        """Defer evaluations to ``keeper`` (:meth:`Evaluations.keep`)."""
        self.evaluations.keep(keeper, self.host.policy)

    # --- state and summaries -------------------------------------------------------------------------

    def state(self) -> EngineState:
        """Everything a restart needs (:func:`hetd.core.saved.capture`)."""
        return saved.capture(self.members, self.applier, self.host)

    def restore(self, state: EngineState, revive: Callable[[Any, Any], Any] | None = None) -> None:
        """Put a saved state into this engine before it serves anyone
        (:func:`hetd.core.saved.restore`)."""
        saved.restore(state, self.members, self.applier, self.host, self.view, revive)

    def status(self) -> dict[str, Any]:
        return status(self)

    def workers(self) -> list[dict[str, Any]]:
        return worker_rows(self)
