"""The single writer: one asyncio task owns all training state and reads one queue of commands.

Sessions and the admin API put :mod:`~hetd.core.commands` on the queue; :meth:`Engine.handle` routes
each to the part that owns its state (plain classes, listed in :mod:`hetd.core`, public attributes
of the engine that readers read directly: ``engine.members.facts``, ``engine.host.policy``), asks
the policy about the events the parts return, and hands its decisions to the
:class:`~hetd.core.execute.Executor`, whose consequences come back as events. Replies go to
per-session :class:`~hetd.core.peers.Peer` outboxes, which never block it; time comes from an
injected :class:`~hetd.core.peers.Clock`, so the simulator drives the same code. :meth:`Engine.run`
publishes once per batch of commands (:mod:`hetd.core.publish`); called directly (unit tests) every
command publishes before it returns.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from hetd.core import commands as cmd
from hetd.core import saved
from hetd.core.applier import Applier
from hetd.core.decisions import DecisionSink
from hetd.core.entries import EngineConfig
from hetd.core.evals import Evaluations, metrics_of
from hetd.core.execute import Executor
from hetd.core.guard import UpdateGuard
from hetd.core.intake import Intake
from hetd.core.members import Members
from hetd.core.noise import GradientNoise
from hetd.core.peers import Clock, MonotonicClock, Peer
from hetd.core.policy_host import PolicyHost
from hetd.core.publish import Publisher
from hetd.core.queue import CommandQueue
from hetd.core.rates import Meters
from hetd.core.replicas import Replicas
from hetd.core.saved import EngineState
from hetd.core.store import Snapshot, Store
from hetd.core.views import cluster_view, status, worker_rows
from hetd.protocol.messages import Bye, JoinIn, PushIn
from hetd.zoo.shapes import block_facts
from policies.types import ClusterView, Event, Join, Leave, Policy, Push, Tick

__all__ = ["Engine"]


class Engine:
    """Routes commands to the parts, events to the policy and its decisions to the executor."""

    def __init__(
        self,
        store: Store,
        policy: Policy,
        config: EngineConfig,
        clock: Clock | None = None,
        evaluator: Callable[[Snapshot], tuple[float, float]] | None = None,
        decisions: DecisionSink | None = None,
    ) -> None:
        """``decisions``: a log of every decision (:class:`~hetd.core.applier.Applier`)."""
        self.store, self.config = store, config
        self.clock: Clock = clock or MonotonicClock()
        self.started_at = now = self.clock.now()
        self.meters = Meters()
        self.queue = CommandQueue(self.meters)
        self.members = Members(config, self.clock, now)
        self.applier = Applier(store, decisions)
        self.publisher = Publisher(self.members, store, config, self.meters)
        self.pipelines = Replicas(self.members, block_facts(store.shapes))
        self.guard = UpdateGuard(config.guard_factor, config.guard_warmup)
        parts = (self.members, self.pipelines, self.guard, self.applier, config, self.meters)
        self.intake = Intake(*parts)
        self.noise = GradientNoise()  # the gradient noise scale, from pairs of pushes
        every = config.eval_interval_s
        self.evaluations = Evaluations(
            self.clock, now, every, config.eval_inline, self.queue.submit, evaluator
        )
        self.host = PolicyHost(policy, self.clock, now)
        self.executor = Executor(
            self.members, self.host, self.applier, self.publisher, self.pipelines, store, config,
            self.meters, self.clock, self.noise,
        )  # fmt: skip
        self.host.state = policy.init(self.view())

    def handle(self, command: cmd.Command) -> Any:
        """Carry out one command now (on the engine task, or synchronously in tests and the
        simulator); a ``Join`` returns the worker's id, a ``Call`` its function's result."""
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
                self.publisher.resend(wid, peer)
            case cmd.Transport(wid, peer, transport, sink):
                if sink is not None:
                    self.publisher.sink_to(sink)
                self.members.set_transport(wid, peer, transport)
            case cmd.Tick():
                self.tick()
            case cmd.EvalDue():
                self._evaluate_if_due(self.clock.now())
            case cmd.EvalDone(result, taken):
                self._dispatch(self.evaluations.record(*result, taken, metrics_of(result)))
            case cmd.Forecast(forecast):
                if self.host.policy.reads_forecasts:
                    self._dispatch(forecast)
            case cmd.DissolveReplica(head, reason):
                self.dissolve_replica(head, reason)
            case cmd.Call():
                return command.answer()
        return None

    async def run(self) -> None:
        """Process commands until cancelled, publishing once after each batch; timer tasks feed
        ticks and evaluations."""
        tick = self.config.tick_s
        async with self.queue.ticking(tick, self.evaluations.timer(tick)):
            self.defer_publishing()
            try:
                while True:
                    await self.queue.run_batch(self.handle)
                    if self._to_publish():
                        start = time.perf_counter()
                        await self.publisher.publish_off_loop()
                        self._run_replicas()
                        self.meters.publish_latency.add(time.perf_counter() - start)
            finally:
                self.publisher.defer(False)
                self.evaluations.cancel()

    def defer_publishing(self) -> None:
        """Publish as :meth:`run` does, each batch by :meth:`publish_batch` (the simulator)."""
        self.publisher.defer()

    def publish_batch(self) -> None:
        """What :meth:`run` does after each batch, synchronously."""
        if self._to_publish():
            self.publisher.publish()
            self._run_replicas()

    def _to_publish(self) -> bool:
        return self.publisher.due() or bool(self.pipelines.pending)

    # --- worker commands: each part's answer, then the policy's ----------------------------------

    def join(self, hello: JoinIn, peer: Peer, on_id: Callable[[int], None] | None = None) -> int:
        """Admit a worker (:meth:`Members.join`; one resuming an active worker makes its old
        session leave first); ``on_id`` hears its id before the policy hears of it."""
        codec, plan = self.members.terms(hello, self.host.stage)  # raises before any change
        if (rid := self.members.resuming(hello)) is not None:
            self.leave(rid, "resumed on a new connection", None, keep=True)
        wid = self.members.join(hello, peer, codec, plan).facts.worker
        if on_id is not None:
            on_id(wid)
        self._dispatch(Join(self.clock.now(), wid))
        return wid

    def leave(self, wid: int, reason: str, peer: Peer | None = None, keep: bool = False) -> None:
        """A worker left (:meth:`Members.remove`; ``peer``: the session that ended) every barrier
        at once; its replica dissolves, the shards are recut."""
        gone = self.members.remove(wid, reason, peer, keep)
        if gone is None:
            return
        if (head := self.pipelines.of(wid)) is not None:
            self.dissolve_replica(head, f"worker {wid} left")
        self.members.recut_on_leave()
        if gone[1]:  # a replica's later stage left the view when the replica formed
            self._dispatch(Leave(self.clock.now(), wid, reason))

    def bye_all(self, reason: str) -> None:
        """Say bye to every worker and let it leave (they may reconnect later)."""
        for wid in list(self.members.active):
            self.members.send(wid, Bye(reason))
            self.leave(wid, reason)

    def profile_result(self, wid: int, result: Mapping[str, Any]) -> None:
        """A worker's profile run (:meth:`Members.profiled`): a chance for gates to open."""
        if self.members.profiled(wid, result):
            self._dispatch(Tick(self.clock.now()))

    def pull(self, wid: int, have: int | None = None) -> None:
        """A worker asks for parameters (:meth:`Intake.pull`); a replica's member gets the newest
        in full at once."""
        event = self.intake.pull(wid, have, self.clock.now())
        if event is not None:
            self._dispatch(event)
        elif self.pipelines.of(wid) is not None:
            self.publisher.resend(wid)

    def push(self, p: PushIn) -> None:
        """One validated update: checks (:class:`~hetd.core.intake.Intake`), policy, store, ack."""
        reply, event = self.intake.push(p, self.clock.now())
        if reply is not None:
            self.members.send(p.worker, reply)
        if event is not None:
            self._dispatch(event, p if isinstance(event, Push) else None)

    def tick(self) -> None:
        """Time passes: heartbeats, evaluation, and a chance for gates to open."""
        now = self.clock.now()
        self.meters.sample(now, self.applier.updates_applied)
        for wid in self.members.silent(now):
            self.leave(wid, "heartbeat timeout")
        self.members.evict_due(now)
        self._evaluate_if_due(now)
        self._dispatch(Tick(now))

    def _evaluate_if_due(self, now: float) -> None:
        if not self.store.holds_params and self.evaluations.source is None:
            return  # (a head whose pservers hold the parameters, before they are reachable)
        if (event := self.evaluations.due(now, self.store.snapshot)) is not None:
            self._dispatch(event)

    # --- replicas and the policy -------------------------------------------------------------------

    def form_replica(self, members: Sequence[int]) -> None:
        """Make connected workers ``members`` (stage order) one replica (:meth:`Replicas.form`)."""
        events = self.pipelines.form(members, self.clock.now())
        self.publisher.forget(members[1:])
        self._events(events)

    def dissolve_replica(self, head: int, reason: str = "") -> None:
        """End replica ``head`` (:meth:`Replicas.dissolve`)."""
        self._events(self.pipelines.dissolve(head, reason, self.clock.now()))

    def _run_replicas(self) -> None:
        """After a publish: the released replicas' next steps."""
        self._events(self.pipelines.run_pending(self.clock.now()))

    def view(self) -> ClusterView:
        """The facts as the policy sees them (active replicas only)."""
        return cluster_view(self, self.config.global_batch, self.config.inner_optimizer)

    def swap_policy(self, name: str, params: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """Replace the policy between two events, all or nothing (:meth:`Executor.swap`), then
        carry out its first decisions' releases and flushes."""
        first, described = self.executor.swap(name, params)
        self._events(self.executor.run(first, None))
        return described

    def _events(self, events: Iterable[Event]) -> None:
        for event in events:
            self._dispatch(event)

    def _dispatch(self, event: Event, push: PushIn | None = None) -> None:
        """Ask the policy about ``event`` and carry out its decisions (and what they cause)."""
        resolved = self.host.decide(event, self.view(), push is not None)
        self._events(self.executor.run(resolved, push))

    # --- state and summaries -------------------------------------------------------------------------

    def state(self) -> EngineState:
        """Everything a restart needs (:func:`saved.capture`), then a checkpoint entry in the
        decision log (:meth:`Applier.log_checkpoint`)."""
        st = saved.capture(self.members, self.applier, self.host)
        self.applier.log_checkpoint()
        return st

    def restore(
        self,
        state: EngineState,
        revive: Callable[[Any, Any], Any] | None = None,
        ref: str | None = None,
    ) -> None:
        """Put a saved state into this engine before it serves anyone (:func:`saved.restore`),
        then a restore entry naming checkpoint ``ref`` (default: the state's version)."""
        saved.restore(state, self.members, self.applier, self.host, self.view, revive)
        self.applier.log_restore(ref or f"v{state.version}", state.version)

    def status(self) -> dict[str, Any]:
        return status(self)

    def workers(self) -> list[dict[str, Any]]:
        return worker_rows(self)
