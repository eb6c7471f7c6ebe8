"""The daemon in the simulator: the real engine as one *server* in virtual time, driven by queued
commands and charged what the daemon's own work costs (docs/benchmark.md).

Owns :class:`ServerModel`, the engine's in-memory peers (:class:`SimPeer`) and the engine a
scenario describes (:func:`engine_spec`, assembled as the daemon's is, :mod:`hetd.core.assemble`).
The engine is a single writer under the daemon, and so here: every engine command (a join, a
push, a pull, a profile result, a tick, an evaluation's result) waits for it; when it is free it
takes what is waiting (up to :data:`hetd.core.engine.BATCH` commands), runs them, then publishes
as the daemon does (:meth:`~hetd.core.engine.Engine.publish_batch`: the batch's updates go through
one optimizer step of their weighted sum, which differs from one step each only for a stateful
optimizer such as Adam or momentum, and every worker the batch released gets that one version),
and is busy for the batch's cost, from the cost profile (:mod:`hetd.sim.costs`): each worker
message's ``message_s`` (plus the push's decode when the daemon decodes it on its loop; bigger
frames are decoded in a thread before they queue), each optimizer step (``apply_s``), each
buffered push, and each new parameter frame (``publish``, once per frame as the downlink shares
it). The batch's parameter frames leave when it is done; the harness (:mod:`hetd.sim.loop`)
carries them over the workers' links (:class:`Links`). An evaluation's result is recorded
``eval_s`` after its snapshot (it runs in a thread and stalls nothing).
"""

from __future__ import annotations

import dataclasses
import math
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from hetd.config import TrainConfig
from hetd.core import commands as cmd
from hetd.core.assemble import EngineSpec, Optimizers, assemble, worker_setup
from hetd.core.downlink import DELTA_S_PER_PARAM
from hetd.core.entries import EngineConfig
from hetd.core.ingest import decode_hello, decode_push
from hetd.core.queue import BATCH
from hetd.core.store import Store, Tensors
from hetd.protocol import wire
from hetd.protocol.frames import Params, as_params
from hetd.protocol.messages import PushIn, Reply
from hetd.sim import events as ev
from hetd.sim.agent import EmuWorker, InFlight
from hetd.sim.costs import CostProfile
from hetd.sim.results import PolicySpec
from hetd.sim.scenario import Scenario
from policies.types import Forecast


@dataclass(frozen=True, slots=True)
class Queued:
    """An engine command on the daemon's queue, with its own cost in seconds (before the
    optimizer steps and frames it causes, which the batch adds); a push also names its emulated
    worker and whether the daemon applies it as fused int8."""

    command: cmd.Command
    cost: float = 0.0
    worker: EmuWorker | None = None
    fused: bool = False


class SimPeer:
    """An emulated worker's outbox as the engine sees it: typed replies and encoded parameter
    frames go to the server model's inbox."""

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


class Links(Protocol):
    """The workers' side of what the engine sends, as the harness carries it."""

    def reply(self, index: int, reply: Reply) -> None:
        """Worker ``index`` takes a control reply (at once)."""

    def release(
        self, index: int, frames: list[Params], nbytes: int, depart: float, order: int
    ) -> None:
        """A release's ``params`` frames (``nbytes`` in all) leave for worker ``index`` at
        ``depart``; it is the ``order``-th worker its batch released."""


def engine_spec(
    sc: Scenario, policy: PolicySpec, seed: int, lr: float, params: Mapping[str, Any]
) -> EngineSpec:
    """The engine a scenario runs, as the daemon would build it for the same training, with the
    settings virtual time needs."""
    optimizers = Optimizers(
        sc.optimizer, lr, sc.inner_optimizer, sc.worker_lr, sc.outer_optimizer, workers=sc.n
    )
    defaults = TrainConfig()  # what the daemon uses unless configured
    return EngineSpec(
        params=params,
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
            # A fixed delta cost, not the measured one: a run must not depend on this CPU's load.
            delta_s_per_param=DELTA_S_PER_PARAM,
            # Emulated workers verify nothing; frames as before keep the golden byte counts
            # (a full frame is 22 bytes shorter than the daemon's).
            param_hashes=False,
            heartbeat_s=1e9,
            # virtual time: a slow worker is never silent, but a crashed one is (churn; the
            # harness then sends every live worker's heartbeats)
            heartbeat_timeout_s=sc.heartbeat_timeout_s if sc.events else math.inf,
            tick_s=sc.tick_s,
            eval_interval_s=sc.eval_interval_s,
            max_staleness=defaults.max_staleness_drop,
            profile_steps=defaults.profile_steps,  # every joiner is profiled, as by the daemon
            shards=sc.n,  # fixed, so that shards do not depend on how many have joined so far
        ),
    )


class ServerModel:
    """The daemon as one server in virtual time: the commands waiting for it, when it is free
    again, and what its batches cost. One instance per run."""

    def __init__(
        self,
        spec: EngineSpec,
        costs: CostProfile,
        clock: ev.VirtualClock,
        heap: ev.EventHeap,
        links: Links,
    ) -> None:
        self.costs, self.clock, self.heap, self.links = costs, clock, heap, links
        parts = assemble(dataclasses.replace(spec, store_type=_RecordingStore))
        store = parts.store
        assert isinstance(store, _RecordingStore)  # the spec names it
        self.store = store
        self.n_params = store.n_params
        # No evaluator: the harness evaluates at exact virtual times k × interval and hands the
        # result to the engine (the engine's own due-check compares differences of floats).
        self.engine = parts.engine(clock=clock)
        # as under the daemon: a batch's releases are published once, after the batch, and its
        # updates go through one optimizer step of their weighted sum (Store.combine)
        self.engine.defer_publishing()
        self.inbox: list[tuple[int, Reply | bytes]] = []
        self.pushes = 0
        self.bytes_marks: list[list[float]] = []  # [[t s, bytes up + down]] at each evaluation
        self.versions: list[tuple[float, int]] = []  # (t s, version) after each batch moving it
        self.waiting: deque[Queued] = deque()
        self.free_at = 0.0  # s: when the daemon is done with its batch
        self._fused: list[Tensors] = []  # this batch's pushes that the daemon applies as int8
        self._encoded: set[tuple[Any, ...]] = set()  # parameter frames already paid for
        self._encoded_version = -1

    # --- what reaches the daemon ---------------------------------------------------------------

    def join_all(self, workers: list[EmuWorker]) -> None:
        """Every worker's hello, queued at the start, then served."""
        for w in workers:
            self.waiting.append(self._join(w))
        self.serve()

    def join(self, w: EmuWorker) -> None:
        """A worker that arrives while the run goes on says hello (churn)."""
        self._submit(self._join(w))

    def message(self, command: cmd.Command) -> None:
        """A worker message for the engine (it costs ``message_s``)."""
        self._submit(Queued(command, self.costs.message_s))

    def tick(self) -> None:
        """The engine's periodic tick (no worker message: free)."""
        self._submit(Queued(cmd.Tick()))

    def forecast(self, forecast: Forecast) -> None:
        """A planner's forecast joins the queue. Free: the daemon plans in a thread, off the
        engine's task, within 5 % of one core, so nothing of it is charged here."""
        self._submit(Queued(cmd.Forecast(forecast)))

    def receive(self, p: InFlight) -> None:
        """An encoded push reaches the daemon: decoded on the engine's loop (its decode added to
        its cost) or, past ``off_loop_bytes``, in a thread that hands it over when done."""
        assert p.frame is not None  # encoded before it is sent
        msg = wire.decode(p.frame)
        tensors = msg["tensors"]
        codec = str(next(iter(tensors.values()))["codec"]) if tensors else "none"
        decode_s = self.costs.push_decode(codec, self.n_params)
        if decode_s > 0 and len(p.frame) > self.costs.off_loop_bytes:
            self.heap.schedule(self.clock.t + decode_s, ev.Decoded(p, msg))  # in a thread
            return
        self._submit(self._push(p, msg, on_loop_s=decode_s))

    def push(self, push: PushIn, worker: EmuWorker) -> None:
        """A push made here rather than on a link (a pipeline replica's assembled step, as
        the daemon's replica driver hands it to the engine): a worker message's cost."""
        self._submit(Queued(cmd.Push(push), self.costs.message_s, worker))

    def decoded(self, p: InFlight, msg: wire.Message) -> None:
        """A push decoded in a thread joins the engine's queue."""
        self._submit(self._push(p, msg, on_loop_s=0.0))

    def evaluated(self, loss: float, acc: float) -> None:
        """An evaluation's result goes back through the daemon's queue, ``eval_s`` after its
        snapshot, as the daemon's evaluation thread hands it back."""
        if self.costs.eval_s > 0:
            self.heap.schedule(self.clock.t + self.costs.eval_s, ev.Record(loss, acc))
        else:
            self.recorded(loss, acc)

    def recorded(self, loss: float, acc: float) -> None:
        """An evaluation's result joins the engine's queue."""
        self._submit(Queued(cmd.EvalDone((loss, acc), None)))

    def record_now(self, loss: float, acc: float) -> None:
        """An evaluation's result recorded at once, past the queue (the first and the last: a
        real benchmark measures those two itself)."""
        self._run(Queued(cmd.EvalDone((loss, acc), None)))
        self.engine.publish_batch()
        self._drain()

    # --- the server ------------------------------------------------------------------------------

    def _submit(self, command: Queued) -> None:
        """Queue an engine command; it runs now if the daemon is free."""
        self.waiting.append(command)
        self.serve()

    def serve(self) -> None:
        """While the daemon is free and commands wait: run a batch of them (up to BATCH) at this
        time, and charge it: each command's own cost, each optimizer step and buffered push it
        caused, each new parameter frame. The batch's frames leave when it is done, and the
        daemon takes the next batch then."""
        while self.waiting and self.free_at <= self.clock.t:
            now, version = self.clock.t, self.store.version
            self.store.queued.clear()
            buffered = self._buffered() if self.costs.buffer_s_per_param else 0
            cost = 0.0
            for _ in range(min(len(self.waiting), BATCH)):
                cost += self._run(self.waiting.popleft())
            self.engine.publish_batch()
            if self.store.version != version:
                self.versions.append((now, self.store.version))
            for kind, tensors in self.store.queued:
                cost += self.costs.apply(kind, int8=any(tensors is f for f in self._fused))
            self.store.queued.clear()
            self._fused.clear()
            if self.costs.buffer_s_per_param:
                added = max(0, self._buffered() - buffered)
                cost += added * self.costs.buffer_s_per_param * self.n_params
            cost = self._drain(cost)
            self.free_at = now + cost
            if cost > 0:
                self.heap.schedule(self.free_at, ev.Free())

    def _buffered(self) -> int:
        return sum(s.buffered for s in self.engine.members.stats.values())

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
            t = self.engine.evaluations.evals[-1][
                0
            ]  # bytes to target: what crossed the links until now
            self.bytes_marks.append([t, self.engine.meters.bytes_in + self.engine.meters.bytes_out])
        return q.cost

    def _join(self, w: EmuWorker) -> Queued:
        def got(wid: int) -> None:
            w.wid = wid

        hello = decode_hello(w.hello())
        join = cmd.Join(hello, SimPeer(w.index, self.inbox), on_id=got)
        return Queued(join, self.costs.message_s)

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

    # --- what leaves the daemon ------------------------------------------------------------------

    def _frame_cost(self, msg: Params, batch: set[tuple[Any, ...]]) -> float:
        """What encoding this ``params`` frame cost the daemon: once per frame (the downlink
        shares it), and once per batch for frames alike but for their version (the daemon
        publishes one snapshot per batch)."""
        if not msg.tensors:
            return 0.0
        codec = str(next(iter(msg.tensors.values()))["codec"])
        key = (msg.full, codec, None if msg.full else msg.base)
        version = msg.version
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
        which this returns with ``cost``)."""
        while self.inbox:
            batch, self.inbox[:] = list(self.inbox), []
            releases: dict[int, tuple[list[Params], int]] = {}
            for index, item in batch:
                if isinstance(item, bytes):
                    frames, nbytes = releases.get(index, ([], 0))
                    typed = as_params(wire.decode(item))
                    releases[index] = ([*frames, typed], nbytes + len(item))
                else:
                    self.links.reply(index, item)
            if self.costs.publish_s_per_param:
                alike: set[tuple[Any, ...]] = set()
                for frames, _ in releases.values():
                    cost += sum(self._frame_cost(msg, alike) for msg in frames)
            depart = self.clock.t + cost
            for k, (index, (frames, nbytes)) in enumerate(releases.items()):
                self.links.release(index, frames, nbytes, depart, k)
        return cost


def _fused_int8(tensors: Mapping[str, Any]) -> bool:
    """Whether the daemon applies this push as int8 inside its jitted step (every tensor int8
    with one scale, as :func:`hetd.core.ingest.decode_push` with ``fused`` keeps it)."""
    return bool(tensors) and all(
        isinstance(t, Mapping) and t.get("codec") == "int8" and t.get("block") == 0
        for t in tensors.values()
    )
