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
from hetd.protocol.frames import Params
from hetd.protocol.messages import PlanUpdate, ProfileRequest, Reply, Welcome
from hetd.sim import events as ev
from hetd.sim.agent import EmuWorker, InFlight
from hetd.sim.compute import StepWork, scenario_compute
from hetd.sim.costs import CostProfile, load_costs
from hetd.sim.results import PolicySpec, RunResult, Trace, staleness_stats, time_to_target
from hetd.sim.scenario import Scenario
from hetd.sim.server_model import ServerModel, engine_spec


@dataclass
class SimRun:
    """A finished simulation: the result, plus the engine for tests that inspect it."""

    result: RunResult
    engine: Engine
    pushes: int
    virtual_s: float


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
        shapes = dict(self.server.store.shapes)
        self.workers = [EmuWorker(i, sc, data, seed, shapes, costs=costs) for i in range(sc.n)]
        self.pending: list[StepWork] = []  # started steps whose update is not computed yet
        self.trace = Trace(timeline={str(i): [] for i in range(sc.n)})

    def run(self) -> SimRun:
        sc = self.sc
        self.server.join_all(self.workers)
        # evaluations at k × interval, and always one at the budget (the final accuracy)
        n_evals = math.ceil(sc.budget_s / sc.eval_interval_s)
        times = [k * sc.eval_interval_s for k in range(n_evals)]
        for t in [t for t in times if t < sc.budget_s * (1 - 1e-12)] + [sc.budget_s]:
            self.heap.schedule(t, ev.Evaluate())
        self.heap.schedule(sc.tick_s, ev.Tick(1))
        while self.heap:
            t, event = self.heap.pop()
            if t > sc.budget_s:
                break
            self.clock.t = t
            self._handle(t, event)
        self.clock.t = sc.budget_s
        return SimRun(self._result(), self.engine, self.server.pushes, self.clock.t)

    def _handle(self, t: float, event: ev.Event) -> None:
        server = self.server
        match event:
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
                server.tick()
                self.heap.schedule((k + 1) * self.sc.tick_s, ev.Tick(k + 1))
            case ev.Free():
                server.serve()
            case ev.Record(loss, acc):
                server.recorded(loss, acc)
            case ev.Evaluate():
                self._evaluate()

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
        # acks need no action: the next params frame is what a worker waits for

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
                self.heap.schedule(p.arrive, ev.Arrive(p))
                return
        self.server.receive(p)

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
            str(w.index): f.batch_size for w in self.workers if (f := self.engine.facts.get(w.wid))
        }
        total = sum(sizes.values()) or 1
        self.trace.shares.append((self.clock.t, {w: b / total for w, b in sizes.items()}))
        if self.on_time is not None:
            self.on_time(self.clock.t)

    # --- the record -----------------------------------------------------------------------------

    def _result(self) -> RunResult:
        sc, engine = self.sc, self.engine
        curve = [[t, acc] for t, _, acc in engine.evals]
        staleness = [s for w in self.workers for s in w.staleness]
        mean, p95 = staleness_stats(staleness)
        idle: dict[str, float] = {}
        samples = 0
        for w in self.workers:
            f = engine.facts.get(w.wid) or engine.departed[w.wid]
            # The device's own idle time (as a real worker reports it with each push): before
            # every step it started, plus since its last step ended if that was within the
            # budget. Not the daemon's pull-to-release wait: a pipelined worker pulls while it
            # still computes, and was counted idle all that time.
            open_idle = max(0.0, sc.budget_s - w.idle_from)
            idle[str(w.index)] = min(1.0, (w.idle_total + open_idle) / sc.budget_s)
            samples += f.samples
        return RunResult(
            policy=self.policy.label,
            scenario=sc.name,
            seed=self.seed,
            lr=self.lr,
            tta_s=time_to_target(engine.evals, sc.target_accuracy, sc.target_loss),
            final_accuracy=curve[-1][1],
            samples_per_s=samples / sc.budget_s,
            idle_fraction=idle,
            staleness_mean=mean,
            staleness_p95=p95,
            bytes_up=sum(s.bytes_in for s in engine.stats.values()),
            bytes_down=sum(s.bytes_out for s in engine.stats.values()),
            pushes=sum(s.pushes for s in engine.stats.values()),
            releases=sum(s.releases for s in engine.stats.values()),
            curve=curve,
            trace=self.trace,
            stages=[[t, st] for t, st in engine.stages],
            bytes_curve=self.server.bytes_marks,
        )


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
