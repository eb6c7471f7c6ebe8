"""``hetd sim``: the real engine and policies driven by a virtual clock (a discrete-event loop).

Owns :class:`VirtualClock`, :class:`SimPeer` and :func:`run_sim`. The
:class:`~hetd.core.engine.Engine` gets the fields ``hetd.server.daemon.build_engine`` sets and is called
directly (``join``, ``push``, ``pull``, ``profile_result``, ``tick``, ``record_eval``). Emulated
workers (:mod:`hetd.sim.agent`) are in-memory peers: they get the engine's typed replies as they
are, and its real ``params`` frames (decoded with :func:`hetd.protocol.wire.decode`), and send
real hello and push frames, ingested as the daemon's sessions do (:mod:`hetd.core.ingest`). Time
charged (docs/benchmark.md)::

    pull  = latency + bytes of the release's params frames / bandwidth + worker decode
    step  = base_step_s × samples / base_batch × slowdown(t) × straggle   (samples = batch × k)
            + worker encode + worker_step_s
    push  = latency + len(push frame) / bandwidth + exchange_s   (the device is free meanwhile:
            a pipelined worker computes its next step, one without pipeline waits for the reply)

and, from the cost profile (:mod:`hetd.sim.costs`), the daemon's work: the engine is one *server*
in virtual time, as the daemon's engine is a single writer. Every engine command (a join, a push,
a pull, a profile result, a tick, an evaluation's result) waits for it; when it is free it takes
what is waiting (up to :data:`hetd.core.engine.BATCH` commands), runs them, then publishes as the
daemon does (:meth:`~hetd.core.engine.Engine.publish_batch`: the batch's updates go through one
optimizer step of their weighted sum, which differs from one step each only for a stateful
optimizer such as Adam or momentum, and every worker the batch released gets that one version), and
is busy for the batch's cost: each worker message's ``message_s`` (plus the push's decode when the
daemon decodes it on its loop; bigger frames are decoded in a thread before they queue), each
optimizer step (``apply_s``), each buffered push, and each new parameter frame (``publish``, once
per frame as the downlink shares it). The batch's parameter frames leave when it is done. An
evaluation's accuracy is recorded ``eval_s`` after its snapshot (it runs in a thread and stalls
nothing). With the default profile every cost is zero, nothing waits, and the results are exactly
those of the simulator before profiles (tests/golden).

Gradients are real and computed lazily in batches (:mod:`hetd.sim.compute`). Nothing sleeps and
nothing reads the wall clock: the same scenario, policy, lr, seed and cost profile give the same
:class:`~hetd.sim.results.RunResult`, curve included.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import jax

from hetd.config import TrainConfig
from hetd.core import commands as cmd
from hetd.core.assemble import EngineSpec, Optimizers, assemble, worker_setup
from hetd.core.downlink import DELTA_S_PER_PARAM
from hetd.core.engine import BATCH, Engine, EngineConfig
from hetd.core.ingest import decode_hello, decode_push
from hetd.core.store import Store, Tensors
from hetd.protocol import wire
from hetd.protocol.messages import PlanUpdate, ProfileRequest, Reply, Welcome
from hetd.sim.agent import EmuWorker, InFlight
from hetd.sim.compute import StepWork, scenario_compute
from hetd.sim.costs import CostProfile, load_costs
from hetd.sim.results import PolicySpec, RunResult, Trace, staleness_stats, time_to_target
from hetd.sim.scenario import Scenario

# event kinds (events at the same virtual time run in the order they were scheduled)
_DELIVER, _ARRIVE, _PROFILE, _PULL, _WAKE, _TICK, _EVAL, _DECODED, _FREE, _RECORD = range(10)


@dataclass(frozen=True, slots=True)
class Queued:
    """An engine command on the daemon's queue, with its own cost in seconds (before the
    optimizer steps and frames it causes, which the batch adds); a push also names its emulated
    worker and whether the daemon applies it as fused int8."""

    command: cmd.Command
    cost: float = 0.0
    worker: EmuWorker | None = None
    fused: bool = False


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

    def send_params(self, frame: bytes | memoryview, *, full: bool) -> None:
        """Queue one ``params`` frame for the worker."""
        self._inbox.append((self.worker, bytes(frame)))  # (the simulator's are bytes: no copy)

    def close(self, reason: str) -> None:
        """Remember why the engine ended the session."""
        self.closed = reason


class _RecordingStore(Store):
    """The store, noting each update queued (kind, tensors) so that its cost can be charged."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.queued: list[tuple[str, Tensors]] = []

    def apply(self, kind: str, tensors: Tensors, scale: float) -> int:
        self.queued.append((kind, tensors))
        return super().apply(kind, tensors, scale)


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
        costs: CostProfile,
    ) -> None:
        self.sc, self.seed, self.lr, self.on_time, self.policy = sc, seed, lr, on_time, policy
        self.costs = costs
        data, model, self.compute = scenario_compute(sc, seed)
        init = model.init(jax.random.PRNGKey(seed), data.input_shape)
        optimizers = Optimizers(
            sc.optimizer, lr, sc.inner_optimizer, sc.worker_lr, sc.outer_optimizer, workers=sc.n
        )
        defaults = TrainConfig()  # what the daemon uses unless configured
        spec = EngineSpec(
            params=init,
            policy=policy.name,
            policy_params=policy.build_params(),
            optimizers=optimizers,
            welcome=worker_setup(
                sc.model,
                sc.dataset,
                seed,
                optimizers,
                micro_batch=sc.micro_batch or sc.batch_per_worker,
                model_kwargs=sc.model_kwargs,
                dataset_kwargs=sc.dataset_kwargs,
            ),
            settings=EngineConfig(
                global_batch=sc.global_batch,
                batch_size=sc.batch_per_worker,
                codec=sc.codec,
                downlink=sc.downlink,
                # A fixed delta cost, not the measured one: a run must not depend on this CPU's
                # load.
                delta_s_per_param=DELTA_S_PER_PARAM,
                # Emulated workers verify nothing; frames as before keep the golden byte counts
                # (a full frame is 22 bytes shorter than the daemon's).
                param_hashes=False,
                heartbeat_s=1e9,
                heartbeat_timeout_s=math.inf,  # virtual time: a slow worker is never silent
                tick_s=sc.tick_s,
                eval_interval_s=sc.eval_interval_s,
                max_staleness=defaults.max_staleness_drop,
                profile_steps=defaults.profile_steps,  # every joiner is profiled, as by the daemon
                shards=sc.n,  # fixed, so that shards do not depend on how many have joined so far
            ),
            store_type=_RecordingStore,
        )
        parts = assemble(spec)
        store = parts.store
        assert isinstance(store, _RecordingStore)  # the spec names it
        self.store = store
        self.n_params = store.n_params
        self.clock = VirtualClock()
        # No evaluator: the loop evaluates at exact virtual times k × interval and hands the result
        # to engine.record_eval (the engine's own due-check compares differences of floats).
        self.engine = parts.engine(clock=self.clock)
        # as under the daemon: a batch's releases are published once, after the batch, and its
        # updates go through one optimizer step of their weighted sum (Store.combine)
        self.engine.defer_publishing()
        self.inbox: list[tuple[int, Reply | bytes]] = []
        self.workers = [
            EmuWorker(i, sc, data, seed, dict(store.shapes), costs=costs) for i in range(sc.n)
        ]
        self.heap: list[tuple[float, int, int, Any]] = []
        self.seq = 0
        self.pending: list[StepWork] = []  # started steps whose update is not computed yet
        self.trace = Trace(timeline={str(i): [] for i in range(sc.n)})
        self.bytes_marks: list[list[float]] = []  # [[t s, bytes up + down]] at each evaluation
        self.pushes = 0
        # the daemon as one server: commands waiting, and when it is free again
        self.waiting: deque[Queued] = deque()
        self.server_free = 0.0
        self._fused: list[Tensors] = []  # this batch's pushes that the daemon applies as int8
        self._encoded: set[tuple[Any, ...]] = set()  # parameter frames already paid for
        self._encoded_version = -1

    # --- events -------------------------------------------------------------------------------

    def schedule(self, t: float, kind: int, payload: Any = None) -> None:
        heapq.heappush(self.heap, (t, self.seq, kind, payload))
        self.seq += 1

    def run(self) -> SimRun:
        sc = self.sc
        for w in self.workers:
            self.waiting.append(self._join(w))
        self._serve()
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
            elif kind == _DECODED:
                pushed, msg = payload
                self._submit(self._push(pushed, msg, on_loop_s=0.0))
            elif kind == _PROFILE:
                self._submit(self._message(cmd.ProfileResult(payload[0].wid, payload[1])))
            elif kind == _PULL:
                self._submit(self._message(cmd.Pull(payload.wid, None)))
            elif kind == _WAKE:
                self._try_start(payload)
            elif kind == _TICK:
                self._submit(Queued(cmd.Tick()))
                self.schedule((payload + 1) * sc.tick_s, _TICK, payload + 1)
            elif kind == _FREE:
                self._serve()
            elif kind == _RECORD:
                self._submit(self._record(*payload))
            else:
                self._evaluate()
        self.clock.t = sc.budget_s
        return SimRun(self._result(), self.engine, self.pushes, self.clock.t)

    # --- the daemon: one server in virtual time -------------------------------------------------

    def _submit(self, command: Queued) -> None:
        """Queue an engine command; it runs now if the daemon is free."""
        self.waiting.append(command)
        self._serve()

    def _serve(self) -> None:
        """While the daemon is free and commands wait: run a batch of them (up to BATCH) at this
        time, and charge it: each command's own cost, each optimizer step and buffered push it
        caused, each new parameter frame. The batch's frames leave when it is done, and the
        daemon takes the next batch then."""
        while self.waiting and self.server_free <= self.clock.t:
            now = self.clock.t
            self.store.queued.clear()
            buffered = self._buffered() if self.costs.buffer_s_per_param else 0
            cost = 0.0
            for _ in range(min(len(self.waiting), BATCH)):
                cost += self._run(self.waiting.popleft())
            self.engine.publish_batch()
            for kind, tensors in self.store.queued:
                cost += self.costs.apply(kind, int8=any(tensors is f for f in self._fused))
            self.store.queued.clear()
            self._fused.clear()
            if self.costs.buffer_s_per_param:
                added = max(0, self._buffered() - buffered)
                cost += added * self.costs.buffer_s_per_param * self.n_params
            cost = self._drain(cost)
            self.server_free = now + cost
            if cost > 0:
                self.schedule(self.server_free, _FREE)

    def _buffered(self) -> int:
        return sum(s.buffered for s in self.engine.stats.values())

    def _run(self, q: Queued) -> float:
        """Run one queued command on the engine; what it cost the daemon."""
        c = q.command
        if isinstance(c, cmd.Push):
            assert q.worker is not None  # every queued push names its worker
            if q.fused:
                self._fused.append(c.push.tensors)
            q.worker.staleness.append(max(0, self.engine.store.version - c.push.base))
        self.engine.handle(c)
        if isinstance(c, cmd.Push):
            self.pushes += 1
        elif isinstance(c, cmd.EvalDone):
            t = self.engine.evals[-1][0]  # bytes to target: what crossed the links until now
            self.bytes_marks.append([t, self.engine.meters.bytes_in + self.engine.meters.bytes_out])
        return q.cost

    def _message(self, command: cmd.Command) -> Queued:
        """A worker message the engine handles (costs ``message_s``)."""
        return Queued(command, self.costs.message_s)

    def _join(self, w: EmuWorker) -> Queued:
        def got(wid: int) -> None:
            w.wid = wid

        hello = decode_hello(w.hello())
        return self._message(cmd.Join(hello, SimPeer(w.index, self.inbox), on_id=got))

    @staticmethod
    def _record(loss: float, acc: float) -> Queued:
        return Queued(cmd.EvalDone((loss, acc), None))

    def _push(self, p: InFlight, msg: wire.Message, on_loop_s: float) -> Queued:
        """The engine takes a decoded push (``on_loop_s``: its decode, when the daemon decodes it
        on the engine's loop)."""
        w = p.worker
        assert p.frame is not None  # encoded before it was queued
        push_in = decode_push(self.engine.store.shapes, w.wid, msg, len(p.frame))
        # the transfer time the engine would measure from the worker's stamp, in virtual time
        # (the link's: the round trip's exchange_s is not the bytes' time on the link)
        push_in = dataclasses.replace(push_in, transfer_s=p.arrive - p.exchange_s - p.sent_at)
        fused = bool(self.costs.apply_s) and _fused_int8(msg["tensors"])
        return Queued(cmd.Push(push_in), self.costs.message_s + on_loop_s, w, fused)

    def _frame_cost(self, msg: wire.Message, batch: set[tuple[Any, ...]]) -> float:
        """What encoding this ``params`` frame cost the daemon: once per frame (the downlink
        shares it), and once per batch for frames alike but for their version (the daemon
        publishes one snapshot per batch)."""
        tensors = msg["tensors"]
        if not tensors:
            return 0.0
        codec = str(next(iter(tensors.values()))["codec"])
        key = (bool(msg["full"]), codec, None if msg["full"] else msg.get("base"))
        version = int(msg["version"])
        if version != self._encoded_version:
            self._encoded, self._encoded_version = set(), version
        if key in batch or key in self._encoded:
            return 0.0
        batch.add(key)
        self._encoded.add(key)
        return self.costs.publish(codec, self.n_params)

    def _drain(self, cost: float = 0.0) -> float:
        """Hand what the engine sent to its workers: replies at once, each release's ``params``
        frames when the daemon is done (``cost`` s from now, plus the cost of encoding them,
        which this returns with ``cost``) and after the time they take on the worker's link
        and to decode; the k-th worker released in one batch ``k × release_stagger_s`` later."""
        while self.inbox:
            batch, self.inbox[:] = list(self.inbox), []
            releases: dict[int, tuple[list[wire.Message], int]] = {}
            for index, item in batch:
                w = self.workers[index]
                if isinstance(item, bytes):
                    frames, nbytes = releases.get(index, ([], 0))
                    releases[index] = ([*frames, wire.decode(item)], nbytes + len(item))
                elif isinstance(item, Welcome):
                    w.welcome(item)
                elif isinstance(item, PlanUpdate):
                    w.follow_plan(item.plan)
                elif isinstance(item, ProfileRequest):
                    w.profile = item.spec()
                # acks need no action: the next params frame is what a worker waits for
            if self.costs.publish_s_per_param:
                alike: set[tuple[Any, ...]] = set()
                for frames, _ in releases.values():
                    cost += sum(self._frame_cost(msg, alike) for msg in frames)
            depart = self.clock.t + cost
            stagger = self.costs.release_stagger_s
            for k, (index, (frames, nbytes)) in enumerate(releases.items()):
                w = self.workers[index]
                # the k-th worker released in one batch is served k staggers after the first
                arrive = depart + k * stagger + w.spec.latency_s + nbytes / w.spec.bandwidth
                arrive += w.decode_s(frames)
                self.trace.timeline[str(index)].append((depart, arrive, "comm"))
                self.schedule(arrive, _DELIVER, (w, frames))
        return cost

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
        line.append((p.begin, p.begin + p.compute_s + p.encode_s, "compute"))
        line.append((p.sent_at, p.arrive, "comm"))
        self.schedule(p.arrive, _ARRIVE, p)
        if w.busy_until < p.arrive:  # pipelined: it may start again before the push lands
            self.schedule(w.busy_until, _WAKE, w)

    def _arrive(self, p: InFlight) -> None:
        """The push reaches the daemon: compute it (with everything pending), encode, and queue it
        for the engine (once decoded, when the daemon decodes it in a thread)."""
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
                self.schedule(p.arrive, _ARRIVE, p)
                return
        assert p.frame is not None  # encoded above
        msg = wire.decode(p.frame)
        tensors = msg["tensors"]
        codec = str(next(iter(tensors.values()))["codec"]) if tensors else "none"
        decode_s = self.costs.push_decode(codec, self.n_params)
        if decode_s > 0 and len(p.frame) > self.costs.off_loop_bytes:
            self.schedule(self.clock.t + decode_s, _DECODED, (p, msg))  # in a thread: no queue
            return
        self._submit(self._push(p, msg, on_loop_s=decode_s))

    def _evaluate(self) -> None:
        """An evaluation at its virtual time. Its accuracy reaches the engine ``eval_s`` later,
        through the daemon's queue, as the daemon's evaluation thread hands it back; the first
        and the last are recorded at their times (a real benchmark measures those two itself)."""
        loss, acc = self.compute.evaluate(self.engine.store.snapshot().tensors)
        t = self.clock.t
        if 0 < t < self.sc.budget_s:
            if self.costs.eval_s > 0:
                self.schedule(t + self.costs.eval_s, _RECORD, (loss, acc))
            else:
                self._submit(self._record(loss, acc))
        else:
            self._run(self._record(loss, acc))
            self.engine.publish_batch()
            self._drain()
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
            bytes_curve=self.bytes_marks,
        )


def _fused_int8(tensors: Mapping[str, Any]) -> bool:
    """Whether the daemon applies this push as int8 inside its jitted step (every tensor int8
    with one scale, as :func:`hetd.core.ingest.decode_push` with ``fused`` keeps it)."""
    return bool(tensors) and all(
        isinstance(t, Mapping) and t.get("codec") == "int8" and t.get("block") == 0
        for t in tensors.values()
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
    return _Sim(sc, policy, seed, sc.lr if lr is None else lr, on_time, costs).run()
