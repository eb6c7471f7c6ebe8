"""``hetd sim``: the real engine and policies driven by a virtual clock (a discrete-event loop).

Owns :func:`run_sim` and its harness: it builds the emulated workers (:mod:`hetd.sim.agent`) and
the daemon (:class:`~hetd.sim.server_model.ServerModel`, the real engine as one server in virtual
time), takes events off the heap (:mod:`hetd.sim.events`) in time order until the budget, carries
frames over the workers' links, evaluates at fixed virtual times and writes the
:class:`~hetd.sim.results.RunResult`. The workers are in-memory peers: they get the engine's typed
replies as they are, and its real ``params`` frames (decoded with :func:`hetd.protocol.wire.decode`),
and send real hello and push frames, ingested as the daemon's sessions do (:mod:`hetd.core.ingest`).
Time charged (docs/benchmark.md)::

    pull  = latency + bytes of the release's params frames / bandwidth + worker decode
    step  = base_step_s × samples / base_batch × slowdown(t) × straggle   (samples = batch × k)
            + worker encode + worker_step_s
    push  = latency + len(push frame) / bandwidth + exchange_s   (the device is free meanwhile:
            a pipelined worker computes its next step, one without pipeline waits for the reply)

and, from the cost profile (:mod:`hetd.sim.costs`), the daemon's own work, which the server model
charges; the k-th worker released in one batch is served ``k × release_stagger_s`` after the
first. With the default profile every cost is zero, nothing waits, and the results are exactly
those of the simulator before profiles (tests/golden).

Churn (a scenario's ``[[events]]``): a joiner says hello at its time; a cleanly stopped worker
starts no more steps, and its bye reaches the daemon after its last push; a crashed one sends
nothing more (a push already on its link still arrives), and the engine drops it at the first tick
past ``heartbeat_timeout_s``, the live workers' heartbeats reaching it before each tick. Without
events no worker sends heartbeats and none times out, as before.

Forecasts (a policy that reads them, ``auto``): the first as soon as every worker has a timing
estimate (probed every :data:`EARLY_PROBE_S` of virtual time, as the daemon probes, from then
every ``plan_every_s``; the planner (:mod:`hetd.core.planner`) runs on the engine's view as it is
then, at once, and its forecast joins the daemon's queue, free: the daemon plans in a thread
within 5 % of one core, and reading this machine's CPU time would make runs differ (forecasts
carry ``cost_s`` 0). Any other policy's run has no such event.

Gradients are real and computed lazily in batches (:mod:`hetd.sim.compute`). Nothing sleeps and
nothing reads the wall clock: the same scenario, policy, lr, seed and cost profile give the same
:class:`~hetd.sim.results.RunResult`, curve included.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import jax

from hetd.core import commands as cmd
from hetd.core.engine import Engine
from hetd.core.planner import PlannerConfig, candidates_of, plan, snapshot, untimed
from hetd.protocol.frames import Params
from hetd.protocol.messages import Ack, PlanUpdate, ProfileRequest, Reply, Welcome
from hetd.sim import events as ev
from hetd.sim.agent import EmuWorker, InFlight
from hetd.sim.compute import StepWork, scenario_compute
from hetd.sim.costs import CostProfile, load_costs
from hetd.sim.replicas import SimReplicas
from hetd.sim.results import PolicySpec, RunResult, Trace, staleness_stats, time_to_target
from hetd.sim.scenario import Join, Leave, Scenario
from hetd.sim.server_model import ServerModel, engine_spec

STOPPED = "stopped (SIGTERM)"
OUT_OF_MEMORY = "out of memory: the model does not fit the memory the worker reports"
# Virtual s between probes for the first forecast, until every worker has a timing estimate (a
# probe reads the engine's facts; the planner runs once they are all timed).
EARLY_PROBE_S = 0.05  # a cleanly stopped worker's bye, as hetd-worker says it


@dataclass
class SimRun:
    """A finished simulation: the result, plus the engine for tests that inspect it."""

    result: RunResult
    engine: Engine
    pushes: int
    virtual_s: float
    versions: list[tuple[float, int]]  # (virtual s, store version) whenever a batch moved it
    workers: list[EmuWorker]  # every emulated worker of the run, joiners included


class _Harness:
    """One run: the workers, the daemon, the heap and the record. Also the workers' links
    (:class:`~hetd.sim.server_model.Links`) for what the daemon sends."""

    def __init__(
        self,
        sc: Scenario,
        policy: PolicySpec,
        seed: int,
        lr: float,
        on_time: Callable[[float], None] | None,
        costs: CostProfile,
    ) -> None:
        self.sc, self.seed, self.lr, self.on_time, self.policy = sc, seed, lr, on_time, policy
        self.costs = costs
        data, model, self.compute = scenario_compute(sc, seed)
        init = model.init(jax.random.PRNGKey(seed), data.input_shape)
        self.clock = ev.VirtualClock()
        self.heap = ev.EventHeap()
        spec = engine_spec(sc, policy, seed, lr, init)
        self.server = ServerModel(spec, costs, self.clock, self.heap, self)
        self.engine = self.server.engine
        self.data, self.shapes = data, dict(self.server.store.shapes)
        # worker i at index i; joiners are appended at their events, which is their index order
        self.workers = [EmuWorker(i, sc, data, seed, self.shapes, costs=costs) for i in range(sc.n)]
        self.pending: list[StepWork] = []  # started steps whose update is not computed yet
        self.trace = Trace(timeline={str(i): [] for i in range(len(sc.all_workers))})
        self.first_forecast = 0.0  # virtual s of the first forecast; the others follow it
        # a policy's pipeline replicas, run as the daemon's replica driver runs them
        self.replicas = SimReplicas(
            self.engine,
            self.heap,
            self.clock,
            lambda: self.workers,
            lambda work: self.pending.append(work),
            self._computed,
            self.server.push,
        )

    def run(self) -> SimRun:
        sc = self.sc
        self.server.join_all(self.workers)
        # evaluations at k × interval, and always one at the budget (the final accuracy)
        n_evals = math.ceil(sc.budget_s / sc.eval_interval_s)
        times = [k * sc.eval_interval_s for k in range(n_evals)]
        for t in [t for t in times if t < sc.budget_s * (1 - 1e-12)] + [sc.budget_s]:
            self.heap.schedule(t, ev.Evaluate())
        self.heap.schedule(sc.tick_s, ev.Tick(1))
        if sc.plan_every_s > 0 and self.engine.host.policy.reads_forecasts:
            self.heap.schedule(min(EARLY_PROBE_S, sc.plan_every_s), ev.Forecast(0))
        for e in sc.events:
            self.heap.schedule(e.at_s, ev.Churn(e))
        while self.heap:
            t, event = self.heap.pop()
            if t > sc.budget_s:
                break
            self.clock.t = t
            self._handle(t, event)
        self.clock.t = sc.budget_s
        return SimRun(
            self._result(),
            self.engine,
            self.server.pushes,
            self.clock.t,
            self.server.versions,
            self.workers,
        )

    def _handle(self, t: float, event: ev.Event) -> None:
        server = self.server
        match event:
            case ev.Deliver(w, frames) if w.gone is not None:
                pass  # it is no longer there to take them
            case ev.Arrive(p) if p.worker.gone == "crash" and p.sent_at > p.worker.gone_at:
                pass  # it crashed before this push left: it never existed
            case ev.Profiled(w, _) | ev.Repull(w) if w.gone == "crash":
                pass
            case ev.Deliver(w, frames):
                if w.receive(frames):
                    self._try_start(w)
                else:  # a delta it cannot apply: ask for everything, as the client does
                    self.heap.schedule(t + w.spec.latency_s, ev.Repull(w))
            case ev.Arrive(p):
                self._arrive(p)
            case ev.Decoded(p, msg):
                server.decoded(p, msg)
            case ev.Profiled(w, result):
                server.message(cmd.ProfileResult(w.wid, result))
            case ev.Repull(w):
                server.message(cmd.Pull(w.wid, None))
            case ev.Wake(w):
                self._try_start(w)
            case ev.Tick(k):
                if self.sc.events:  # a timeout can fire: the live workers' heartbeats first
                    for w in self.workers:
                        if w.gone is None and w.wid:
                            server.message(cmd.Heartbeat(w.wid))
                server.tick()
                self.heap.schedule((k + 1) * self.sc.tick_s, ev.Tick(k + 1))
            case ev.Forecast(0):  # a probe for the first forecast
                if self._forecast():
                    self.first_forecast = t
                    self.heap.schedule(t + self.sc.plan_every_s, ev.Forecast(1))
                else:
                    self.heap.schedule(t + min(EARLY_PROBE_S, self.sc.plan_every_s), ev.Forecast(0))
            case ev.Forecast(k):
                self._forecast()
                self.heap.schedule(
                    self.first_forecast + (k + 1) * self.sc.plan_every_s, ev.Forecast(k + 1)
                )
            case ev.Free():
                server.serve()
            case ev.Record(loss, acc):
                server.recorded(loss, acc)
            case ev.Evaluate():
                self._evaluate()
            case ev.Churn(e):
                self._churn(t, e)
            case ev.Bye(w, reason):
                server.message(cmd.Leave(w.wid, reason or STOPPED))
            case ev.Later(run):
                run()

    def _churn(self, t: float, e: Join | Leave) -> None:
        """A worker arrives and says hello; or one is stopped (it sends what it computed, then
        its bye follows its last push on its link, as ``hetd-worker`` does on SIGTERM); or one
        crashes (nothing more leaves it, and the daemon finds out by the heartbeat timeout)."""
        if isinstance(e, Join):
            w = EmuWorker(e.worker, self.sc, self.data, self.seed, self.shapes, costs=self.costs)
            w.joined_at = w.idle_from = t
            self.workers.append(w)
            self.server.join(w)
            return
        w = self.workers[e.worker]
        w.gone, w.gone_at = e.how, t
        if e.how == "clean" and w.wid:
            self.heap.schedule(max(t + w.spec.latency_s, w.last_arrive), ev.Bye(w))

    # --- the links: what the daemon sends ----------------------------------------------------

    def reply(self, index: int, reply: Reply) -> None:
        """A control reply reaches its worker at once."""
        w = self.workers[index]
        if isinstance(reply, Welcome):
            w.welcome(reply)
        elif isinstance(reply, PlanUpdate):
            w.follow_plan(reply.plan)
        elif isinstance(reply, ProfileRequest):
            w.profile = reply
        elif isinstance(reply, Ack):  # no action: the next params frame is what it waits for
            w.answered.append(reply.id)

    def release(
        self, index: int, frames: list[Params], nbytes: int, depart: float, order: int
    ) -> None:
        """A release's frames reach their worker after the time they take on its link and to
        decode; the ``order``-th worker released in one batch is served that many staggers
        after the first."""
        w = self.workers[index]
        arrive = depart + order * self.costs.release_stagger_s + w.spec.latency_s
        arrive += nbytes / w.spec.bandwidth
        arrive += w.decode_s(frames)
        self.trace.timeline[str(index)].append((depart, arrive, "comm"))
        self.heap.schedule(arrive, ev.Deliver(w, frames))

    # --- steps --------------------------------------------------------------------------------

    def _try_start(self, w: EmuWorker) -> None:
        now = self.clock.t
        if not w.ready(now):
            return
        if not w.fits():  # the step fails at its first allocation, and the worker with it
            w.gone, w.gone_at = "clean", now
            self.heap.schedule(now + w.spec.latency_s, ev.Bye(w, OUT_OF_MEMORY))
            return
        started = w.start(now)
        p = started.push
        self.pending.append(p.work)
        line = self.trace.timeline[str(w.index)]
        if started.profile is not None:
            at, result = started.profile
            line.append((now, at - w.spec.latency_s, "compute"))
            self.heap.schedule(at, ev.Profiled(w, result))
        line.append((p.begin, p.begin + p.compute_s + p.encode_s, "compute"))
        line.append((p.sent_at, p.arrive, "comm"))
        self.heap.schedule(p.arrive, ev.Arrive(p))
        if w.busy_until < p.arrive:  # pipelined: it may start again before the push lands
            self.heap.schedule(w.busy_until, ev.Wake(w))

    def _computed(self, work: StepWork) -> None:
        """``work``'s update, computed now with every step pending."""
        if work.tensors is None:
            if work not in self.pending:
                self.pending.append(work)
            self.compute.run(self.pending)
            self.pending = []

    def _arrive(self, p: InFlight) -> None:
        """The push reaches the daemon: compute it (with everything pending) and encode it, then
        hand it over."""
        w = p.worker
        if p.frame is None:
            if p.work.tensors is None:
                self.compute.run(self.pending)
                self.pending = []
            extra = w.encode(p)
            p.work.params = {}  # let the old version go
            if extra:  # a value-dependent codec made it bigger than estimated: it lands later
                delay = extra / w.spec.bandwidth
                w.sending_until = max(w.sending_until, p.arrive - p.exchange_s + delay)
                p.arrive += delay
                w.last_arrive = max(w.last_arrive, p.arrive)
                self.heap.schedule(p.arrive, ev.Arrive(p))
                return
        w.delivered.append(p.id)
        self.server.receive(p)

    def _forecast(self) -> bool:
        """A planning round at its virtual time: the planner on the engine's view as it is now,
        at once (its CPU time not read: the run stays the same every time), and the forecast
        through the daemon's queue. False (nothing planned) while a worker has no timing
        estimate yet, or no worker is there."""
        engine = self.engine
        if not engine.host.policy.reads_forecasts or not engine.members.facts:
            return False
        view = snapshot(engine.view())
        if untimed(view):
            return False
        config = PlannerConfig.for_engine(engine.config, engine.store.n_params)
        planned = plan(view, candidates_of(engine.host.policy), config, _no_cpu)
        if planned.forecast.predictions:
            self.server.forecast(planned.forecast)
        return True

    def _evaluate(self) -> None:
        """An evaluation at its virtual time. Its accuracy reaches the engine through the
        daemon's queue, as the daemon's evaluation thread hands it back; the first and the last
        are recorded at their times (a real benchmark measures those two itself)."""
        loss, acc = self.compute.evaluate(self.engine.store.snapshot().tensors)
        if 0 < self.clock.t < self.sc.budget_s:
            self.server.evaluated(loss, acc)
        else:
            self.server.record_now(loss, acc)
        sizes = {
            str(w.index): f.batch_size
            for w in self.workers
            if (f := self.engine.members.facts.get(w.wid))
        }
        total = sum(sizes.values()) or 1
        self.trace.shares.append((self.clock.t, {w: b / total for w, b in sizes.items()}))
        if self.on_time is not None:
            self.on_time(self.clock.t)

    # --- the record -----------------------------------------------------------------------------

    def _result(self) -> RunResult:
        sc, engine = self.sc, self.engine
        curve = [[t, acc] for t, _, acc in engine.evaluations.evals]
        staleness = [s for w in self.workers for s in w.staleness]
        mean, p95 = staleness_stats(staleness)
        idle: dict[str, float] = {}
        samples = 0
        for w in self.workers:
            # The device's own idle time (as a real worker reports it with each push): before
            # every step it started, plus since its last step ended if that was within the
            # budget. Not the daemon's pull-to-release wait: a pipelined worker pulls while it
            # still computes, and was counted idle all that time. Churn: over the time it was
            # in the run.
            end = min(sc.budget_s, w.gone_at)
            open_idle = max(0.0, end - w.idle_from)
            present = max(end - w.joined_at, 1e-12)
            idle[str(w.index)] = min(1.0, (w.idle_total + open_idle) / present)
            # (a worker that left before any push of it was answered left no record)
            f = engine.members.facts.get(w.wid) or engine.members.departed.get(w.wid)
            samples += f.samples if f is not None else 0
        return RunResult(
            policy=self.policy.label,
            scenario=sc.name,
            seed=self.seed,
            lr=self.lr,
            tta_s=time_to_target(engine.evaluations.evals, sc.target_accuracy, sc.target_loss),
            final_accuracy=curve[-1][1],
            samples_per_s=samples / sc.budget_s,
            idle_fraction=idle,
            staleness_mean=mean,
            staleness_p95=p95,
            bytes_up=sum(s.bytes_in for s in engine.members.stats.values()),
            bytes_down=sum(s.bytes_out for s in engine.members.stats.values()),
            pushes=sum(s.pushes for s in engine.members.stats.values()),
            releases=sum(s.releases for s in engine.members.stats.values()),
            curve=curve,
            trace=self.trace,
            stages=[[t, st] for t, st in engine.host.stages],
            bytes_curve=self.server.bytes_marks,
        )


def _no_cpu() -> float:
    """The planner's CPU clock in the simulator: never read, so that a run does not depend on
    this machine (forecasts carry ``cost_s`` 0)."""
    return 0.0


def run_sim(
    sc: Scenario,
    policy: PolicySpec,
    seed: int = 0,
    lr: float | None = None,
    on_time: Callable[[float], None] | None = None,
    costs: CostProfile | None = None,
) -> SimRun:
    """Simulate ``policy`` on ``sc`` for ``sc.budget_s`` virtual seconds.

    ``lr`` overrides the scenario's learning rate; ``on_time(t)`` is called after each evaluation
    with the virtual time (for progress bars). ``costs``: the cost profile to charge (None: the
    scenario's ``costs`` file if it names one, else the default, which charges nothing).
    """
    if costs is None:
        costs = load_costs(sc.costs) if sc.costs else CostProfile()
    return _Harness(sc, policy, seed, sc.lr if lr is None else lr, on_time, costs).run()
