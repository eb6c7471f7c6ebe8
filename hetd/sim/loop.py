"""``hetd sim``: the real engine and policies driven by a virtual clock (a discrete-event loop).

Owns :class:`VirtualClock`, :class:`SimPeer` and :func:`run_sim`. The
:class:`~hetd.core.engine.Engine` gets the fields ``hetd.server.daemon.build_engine`` sets and is called
directly (``join``, ``push``, ``pull``, ``profile_result``, ``tick``, ``record_eval``). Emulated
workers (:mod:`hetd.sim.agent`) are in-memory peers: they get the engine's typed replies as they
are, and its real ``params`` frames (decoded with :func:`hetd.protocol.wire.decode`), and send
real hello and push frames, ingested as the daemon's sessions do (:mod:`hetd.core.ingest`). Time
charged (docs/benchmark.md)::

    pull  = latency + bytes of the release's params frames / bandwidth
    step  = base_step_s × samples / base_batch × slowdown(t) × straggle   (samples = batch × k)
    push  = latency + len(push frame) / bandwidth

Gradients are real and computed lazily in batches (:mod:`hetd.sim.compute`). Nothing sleeps and
nothing reads the wall clock: the same scenario, policy, lr and seed give the same
:class:`~hetd.sim.results.RunResult`, curve included.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax

from hetd import config as config_mod
from hetd.config import TrainConfig
from hetd.core.downlink import DELTA_S_PER_PARAM
from hetd.core.engine import Engine, EngineConfig
from hetd.core.ingest import decode_hello, decode_push
from hetd.core.store import Store, make_optimizer, make_outer
from hetd.protocol import wire
from hetd.protocol.messages import PlanUpdate, ProfileRequest, Reply, Welcome
from hetd.sim.agent import EmuWorker, InFlight
from hetd.sim.compute import StepWork, scenario_compute
from hetd.sim.results import PolicySpec, RunResult, Trace, first_reach, staleness_stats
from hetd.sim.scenario import Scenario
from policies import make_policy

# event kinds, in the order they win a tie at the same virtual time
_DELIVER, _ARRIVE, _PROFILE, _PULL, _WAKE, _TICK, _EVAL = range(7)


class VirtualClock:
    """The engine's clock in the simulator: seconds of virtual time, moved by the event loop."""

    def __init__(self) -> None:
        self.t = 0.0

    def now(self) -> float:
        return self.t


class SimPeer:
    """An emulated worker's outbox as the engine sees it: typed replies and encoded parameter
    frames go to the simulator's queue."""

    def __init__(self, worker: int, inbox: list[tuple[int, Reply | bytes]]) -> None:
        self.worker = worker
        self._inbox = inbox
        self.closed: str | None = None

    def send(self, reply: Reply) -> None:
        """Queue a control reply for the worker."""
        self._inbox.append((self.worker, reply))

    def send_params(self, frame: bytes, *, full: bool) -> None:
        """Queue one ``params`` frame for the worker."""
        self._inbox.append((self.worker, frame))

    def close(self, reason: str) -> None:
        """Remember why the engine ended the session."""
        self.closed = reason


@dataclass
class SimRun:
    """A finished simulation: the result, plus the engine for tests that inspect it."""

    result: RunResult
    engine: Engine
    pushes: int
    virtual_s: float


class _Sim:
    """The event loop. One instance per run."""

    def __init__(
        self,
        sc: Scenario,
        policy: PolicySpec,
        seed: int,
        lr: float,
        on_time: Callable[[float], None] | None,
    ) -> None:
        self.sc, self.seed, self.lr, self.on_time, self.policy = sc, seed, lr, on_time, policy
        data, model, self.compute = scenario_compute(sc, seed)
        init = model.init(jax.random.PRNGKey(seed), data.input_shape)
        daemon_opt, inner_opt, outer_opt = config_mod.optimizers(
            sc.optimizer, lr, sc.inner_optimizer, sc.worker_lr, sc.outer_optimizer
        )
        store = Store(init, make_optimizer(daemon_opt), outer=make_outer(outer_opt))
        self.clock = VirtualClock()
        defaults = TrainConfig()  # what the daemon uses unless configured
        config = EngineConfig(
            global_batch=sc.global_batch,
            batch_size=sc.batch_per_worker,
            codec=sc.codec,
            downlink=sc.downlink,
            # A fixed delta cost, not the measured one: a run must not depend on this CPU's load.
            delta_s_per_param=DELTA_S_PER_PARAM,
            heartbeat_s=1e9,
            heartbeat_timeout_s=math.inf,  # virtual time: a slow worker is never silent
            tick_s=sc.tick_s,
            eval_interval_s=sc.eval_interval_s,
            max_staleness=defaults.max_staleness_drop,
            profile_steps=defaults.profile_steps,  # every joiner is profiled, as by the daemon
            shards=sc.n,  # fixed, so that shards do not depend on how many have joined so far
            welcome={
                "model": {"spec": sc.model, "kwargs": dict(sc.model_kwargs)},
                "dataset": {"spec": sc.dataset, "kwargs": dict(sc.dataset_kwargs), "seed": seed},
                "train": {
                    "worker_lr": sc.worker_lr or lr,
                    "seed": seed,
                    "inner_optimizer": inner_opt,
                    "micro_batch": sc.micro_batch or sc.batch_per_worker,
                },
            },
        )
        # No evaluator: the loop evaluates at exact virtual times k × interval and hands the result
        # to engine.record_eval (the engine's own due-check compares differences of floats).
        self.engine = Engine(
            store, make_policy(policy.name, policy.build_params()), config, clock=self.clock
        )
        self.inbox: list[tuple[int, Reply | bytes]] = []
        self.workers = [EmuWorker(i, sc, data, seed, dict(store.shapes)) for i in range(sc.n)]
        self.heap: list[tuple[float, int, int, Any]] = []
        self.seq = 0
        self.pending: list[StepWork] = []  # started steps whose update is not computed yet
        self.trace = Trace(timeline={str(i): [] for i in range(sc.n)})
        self.pushes = 0

    # --- events -------------------------------------------------------------------------------

    def schedule(self, t: float, kind: int, payload: Any = None) -> None:
        heapq.heappush(self.heap, (t, self.seq, kind, payload))
        self.seq += 1

    def run(self) -> SimRun:
        sc = self.sc
        for w in self.workers:
            w.wid = self.engine.join(decode_hello(w.hello()), SimPeer(w.index, self.inbox))
        self._drain()
        # evaluations at k × interval, and always one at the budget (the final accuracy)
        n_evals = math.ceil(sc.budget_s / sc.eval_interval_s)
        times = [k * sc.eval_interval_s for k in range(n_evals)]
        for t in [t for t in times if t < sc.budget_s * (1 - 1e-12)] + [sc.budget_s]:
            self.schedule(t, _EVAL)
        self.schedule(sc.tick_s, _TICK, 1)
        while self.heap:
            t, _, kind, payload = heapq.heappop(self.heap)
            if t > sc.budget_s:
                break
            self.clock.t = t
            if kind == _DELIVER:
                w, frames = payload
                if w.receive(frames):
                    self._try_start(w)
                else:  # a delta it cannot apply: ask for everything, as the client does
                    self.schedule(t + w.spec.latency_s, _PULL, w)
            elif kind == _ARRIVE:
                self._arrive(payload)
            elif kind == _PROFILE:
                self.engine.profile_result(payload[0].wid, payload[1])
            elif kind == _PULL:
                self.engine.pull(payload.wid, None)
            elif kind == _WAKE:
                self._try_start(payload)
            elif kind == _TICK:
                self.engine.tick()
                self.schedule((payload + 1) * sc.tick_s, _TICK, payload + 1)
            else:
                self._evaluate()
            self._drain()
        self.clock.t = sc.budget_s
        return SimRun(self._result(), self.engine, self.pushes, self.clock.t)

    def _drain(self) -> None:
        """Hand what the engine sent to its workers: replies at once, each release's ``params``
        frames after the time they take on the worker's link."""
        while self.inbox:
            batch, self.inbox[:] = list(self.inbox), []
            releases: dict[int, tuple[list[wire.Message], int]] = {}
            for index, item in batch:
                w = self.workers[index]
                if isinstance(item, bytes):
                    frames, nbytes = releases.get(index, ([], 0))
                    releases[index] = ([*frames, wire.decode(item)], nbytes + len(item))
                elif isinstance(item, Welcome):
                    w.welcome(item.message())
                elif isinstance(item, PlanUpdate):
                    w.follow_plan(item.plan.to_wire())
                elif isinstance(item, ProfileRequest):
                    w.profile = item.spec()
                # acks need no action: the next params frame is what a worker waits for
            now = self.clock.t
            for index, (frames, nbytes) in releases.items():
                w = self.workers[index]
                arrive = now + w.spec.latency_s + nbytes / w.spec.bandwidth
                self.trace.timeline[str(index)].append((now, arrive, "comm"))
                self.schedule(arrive, _DELIVER, (w, frames))

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
            self.schedule(at, _PROFILE, (w, result))
        line.append((p.begin, p.begin + p.compute_s, "compute"))
        line.append((p.sent_at, p.arrive, "comm"))
        self.schedule(p.arrive, _ARRIVE, p)
        if w.busy_until < p.arrive:  # pipelined: it may start again before the push lands
            self.schedule(w.busy_until, _WAKE, w)

    def _arrive(self, p: InFlight) -> None:
        """The push reaches the daemon: compute it (with everything pending), encode, deliver."""
        w = p.worker
        if p.frame is None:
            if p.work.tensors is None:
                self.compute.run(self.pending)
                self.pending = []
            extra = w.encode(p)
            p.work.params = {}  # let the old version go
            if extra:  # a value-dependent codec made it bigger than estimated: it lands later
                delay = extra / w.spec.bandwidth
                w.sending_until = max(w.sending_until, p.arrive + delay)
                p.arrive += delay
                self.schedule(p.arrive, _ARRIVE, p)
                return
        assert p.frame is not None  # encoded above
        shapes = self.engine.store.shapes
        push_in = decode_push(shapes, w.wid, wire.decode(p.frame), len(p.frame))
        # the transfer time the engine would measure from the worker's stamp, in virtual time
        push_in = dataclasses.replace(push_in, transfer_s=p.arrive - p.sent_at)
        w.staleness.append(max(0, self.engine.store.version - p.base))
        self.engine.push(push_in)
        self.pushes += 1

    def _evaluate(self) -> None:
        loss, acc = self.compute.evaluate(self.engine.store.snapshot().tensors)
        self.engine.record_eval(loss, acc)
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
            # waits ended by a release, plus the one still open at the end of the budget
            since = f.waiting_since if f.waiting else None
            open_wait = 0.0 if since is None else sc.budget_s - since
            idle[str(w.index)] = min(1.0, (f.idle_s + max(0.0, open_wait)) / sc.budget_s)
            samples += f.samples
        return RunResult(
            policy=self.policy.label,
            scenario=sc.name,
            seed=self.seed,
            lr=self.lr,
            tta_s=first_reach(curve, sc.target_accuracy),
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
        )


def run_sim(
    sc: Scenario,
    policy: PolicySpec,
    seed: int = 0,
    lr: float | None = None,
    on_time: Callable[[float], None] | None = None,
) -> SimRun:
    """Simulate ``policy`` on ``sc`` for ``sc.budget_s`` virtual seconds.

    ``lr`` overrides the scenario's learning rate; ``on_time(t)`` is called after each evaluation
    with the virtual time (for progress bars).
    """
    return _Sim(sc, policy, seed, sc.lr if lr is None else lr, on_time).run()
