"""A worker's side of a pipeline replica (docs/policies.md §11): the stage the daemon assigned it
(``stage``), the replica step it runs (``step``), the activations and gradients it exchanges with
its neighbours through the daemon's relay (``act``/``gact``), and the push of its gradient slice.

:class:`StageHost` is pure compute and bookkeeping: messages in, frames to send out. It never
talks to the network (``workers.client`` does). The model must be block-structured
(:func:`hetd.zoo.blocks.blocks_for`); stage 0 reads the step's inputs and the last stage its
labels from the same sample indices of the training set (every worker loads the whole data set),
so no sample travels.

With an :class:`~workers.emulate.Emulation` a stage works at the emulated device's pace: each
frame it sends is due once the emulated time of the work before it has passed (the stage's share
of the model's compute, a third for a forward and two for a backward,
:meth:`~workers.emulate.Emulation.stage_seconds`; the host's own compute is a floor). The
emulated link carries every frame both ways as a real one would, with its latency in flight:
an arriving activation or gradient is ready once it has crossed the worker's downlink (its
bytes over the bandwidth after the frames before it, then the latency), and the work it starts
is timed from then, while the frames after it keep arriving; the :class:`Outbox` puts each frame
it sends on the uplink when due, and sends it once it has crossed (the uplink busy for its bytes,
the latency overlapping the next frames').

A new stage shape compiles ahead: on its ``stage`` message the worker compiles the stage's
kernels for the assigned micro-batch in a thread (running them once on zeros) while the
parameters and the step come in, and the step waits only for what is left of it. A worker keeps
the stages it built, so a return to a shape it ran before compiles nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import threading
import time
from collections import deque
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from hetd.codecs import registry as codecs
from hetd.protocol.frames import Abort, Act, Gact, Pipeline, Pull, Push, StageOrder, StepOrder
from hetd.protocol.params import Held
from hetd.zoo.blocks import blocks_for
from hetd.zoo.data import Dataset
from hetd.zoo.stages import Stage, StageRunner, input_shapes, prefix
from workers.emulate import Emulation

log = logging.getLogger("hetd.worker.stage")


class StageError(ValueError):
    """A pipeline message this worker cannot act on (no block model, no assignment, ...)."""


Timed = tuple[float, bytes]  # a frame and the time.perf_counter() reading it may leave at


@dataclass
class _Step:
    msg: StepOrder
    runner: StageRunner | None = None  # None until the parameters of its base are held
    started: float = 0.0


def stage_share(shapes: Mapping[str, Sequence[int]], lo: int, hi: int) -> float:
    """Blocks ``[lo, hi)``'s share of a block-structured model's compute: their parameters over
    all (the planner's and the simulator's rule, :func:`hetd.zoo.shapes.block_facts`)."""
    heads = tuple(prefix(j) + "/" for j in range(lo, hi))
    total = sum(math.prod(s) for s in shapes.values())
    mine = sum(math.prod(s) for k, s in shapes.items() if k.startswith(heads))
    return mine / total if total > 0 else 1.0


def task_weights(
    trace: Sequence[tuple[str, int]], last: bool, first: bool
) -> list[tuple[float, bool]]:
    """Each task of a runner's ``trace`` as (its part of one micro-batch's stage work, whether
    it sends a message): a forward a third (it sends its activation, but on the last stage), a
    backward two thirds (it sends its input's gradient, but on stage 0); the last stage's
    forward and backward are one task (it sends the gradient, but when it is stage 0 too)."""
    out: list[tuple[float, bool]] = []
    for kind, _ in trace:
        if last:
            if kind == "F":
                out.append((1.0, not first))
        elif kind == "F":
            out.append((1 / 3, True))
        else:
            out.append((2 / 3, not first))
    return out


class StageHost:
    """One worker's pipeline stage and its current step."""

    def __init__(
        self,
        model: dict[str, Any],
        data: Dataset,
        push_id: Callable[[], int],
        emulation: Emulation | None = None,
        shapes: Mapping[str, Sequence[int]] | None = None,
    ) -> None:
        """``model``: the welcome's model setup (``spec``, ``kwargs``); ``data``: the data set;
        ``push_id``: the request id of the next push (the worker's own sequence);
        ``emulation``: the worker's (None: the host's own pace); ``shapes``: the whole model's
        parameter shapes (a stage's share of the compute; needed with ``emulation``)."""
        self.model = model
        self.push_id = push_id
        self.data = data
        self.emulation = emulation
        self.shapes = shapes
        self.share = 1.0  # the stage's part of the model's compute
        self.free_at = 0.0  # time.perf_counter() when the emulated device finishes its work
        self.assignment: StageOrder | None = None
        self.stage: Stage | None = None
        self.step: _Step | None = None
        self.pushed = 0  # slices pushed
        self.dropped = 0  # steps given up (aborted, or their base no longer held)
        self.stages: dict[tuple[int, int, int, int], Stage] = {}  # (lo, hi, stage, of) -> built
        self.warmed: set[tuple[int, int, int, int, int]] = set()  # ... and micro, compiled
        self.compile_s: float | None = None  # s the last compile ahead took
        self._warming: threading.Thread | None = None
        self.in_free = 0.0  # time.perf_counter() when the emulated downlink is free again

    def assign(self, msg: StageOrder) -> None:
        """Take a ``stage`` message: build the stage (reused when its blocks did not change)."""
        bm = blocks_for(
            self.model["spec"], self.data.num_classes, **dict(self.model.get("kwargs", {}))
        )
        if bm is None:
            raise StageError(f"model {self.model['spec']!r} is not block-structured")
        lo, hi = msg.blocks
        if hi > len(bm.blocks):
            raise StageError(f"stage blocks [{lo}, {hi}) beyond the model's {len(bm.blocks)}")
        key = (lo, hi, msg.stage, msg.of)
        self.wait_warm()  # one compile at a time: the last shape's is done before this one's
        stage = self.stages.get(key)
        if stage is None:
            stage = self.stages[key] = Stage(bm, lo, hi, msg.stage, msg.of)
        self.stage = stage
        if self.shapes is not None:
            self.share = stage_share(self.shapes, lo, hi)
        self.assignment = msg
        self.step = None
        if (*key, msg.micro) not in self.warmed and self.shapes is not None:
            self.warmed.add((*key, msg.micro))
            example = tuple(self.data.x_train.shape[1:])
            h = input_shapes(bm, example)[lo]
            y = np.asarray(self.data.y_train[np.arange(msg.micro) % len(self.data.y_train)])
            self._warming = threading.Thread(
                target=self._warm,
                args=(stage, dict(self.shapes), h, y),
                name=f"compile stage {msg.stage} [{lo}, {hi})",
                daemon=True,  # nothing to hand back: a worker that leaves need not wait for it
            )
            self._warming.start()
        log.info(
            "stage %d of %d in replica %d gen %d: blocks [%d, %d)",
            msg.stage,
            msg.of,
            msg.replica,
            msg.gen,
            lo,
            hi,
        )

    def _warm(
        self,
        stage: Stage,
        shapes: Mapping[str, Sequence[int]],
        h: tuple[int, ...],
        y: np.ndarray,
    ) -> None:
        """Compile ``stage``'s kernels for micro-batches of ``len(y)`` samples: run each once
        on zeros of the shapes a step gives them (its slice, its input, the gradient of its
        output), which fills the kernels' caches as the step's own first calls would."""
        began = time.perf_counter()
        try:
            p: dict[str, Any] = {
                k: np.zeros(tuple(v), np.float32) for k, v in stage.slice(shapes).items()
            }
            x = np.zeros((len(y), *h), np.float32)
            if stage.is_last:
                _, g_p, _ = stage.loss_grad(p, x, y, 1.0 / len(y))
            else:
                out, vjp = stage.forward(p, x)
                g_p, _ = stage.backward(vjp, np.zeros(out.shape, np.float32))
            np.asarray(next(iter(stage.add(g_p, g_p).values())))  # waits for the work
        except Exception:  # the step compiles what is missing, as it did before
            log.exception("stage %d: compile ahead failed", stage.index)
            return
        self.compile_s = time.perf_counter() - began
        log.info(
            "stage %d [%d, %d) compiled ahead for micro-batches of %d in %.2f s",
            stage.index,
            stage.lo,
            stage.hi,
            len(y),
            self.compile_s,
        )

    def wait_warm(self) -> None:
        """Wait for the compile ahead under way, if one is (a step's first kernels would
        compile the same again beside it)."""
        t = self._warming
        if t is not None:
            t.join()
            self._warming = None

    def arrive(self, nbytes: int) -> float:
        """A frame of ``nbytes`` reached this worker now: the time.perf_counter() it has
        crossed the emulated downlink (after the frames before it, then the link's latency;
        now without an emulation)."""
        now = time.perf_counter()
        emu = self.emulation
        if emu is None:
            return now
        start = max(now, self.in_free)
        self.in_free = start + _wire_s(emu, nbytes)
        return self.in_free + emu.latency_s

    def _ours(self, msg: StepOrder | Abort | Act, step: bool = True) -> bool:
        a = self.assignment
        if a is None or (msg.replica, msg.gen) != (a.replica, a.gen):
            return False
        return not step or (self.step is not None and self.step.msg.step == msg.step)

    def begin(self, msg: StepOrder, held: Held | None) -> list[Timed]:
        """Take a ``step`` message; the frames to send (none until its base version is held:
        then :meth:`params` starts it)."""
        if self.assignment is None or self.stage is None or not self._ours(msg, step=False):
            raise StageError(
                f"step {msg.step} for replica {msg.replica} gen {msg.gen}, "
                "which this worker holds no stage of"
            )
        if self.step is not None and self.step.runner is not None and not self.step.runner.done:
            log.warning("step %d replaces unfinished step %d", msg.step, self.step.msg.step)
            self.dropped += 1
        self.step = _Step(msg)
        return self.params(held)

    def waiting_for(self) -> int | None:
        """The base version the current step waits for, if it waits."""
        s = self.step
        return None if s is None or s.runner is not None else s.msg.base

    def params(self, held: Held | None) -> list[Timed]:
        """New parameters are held: start a step waiting for exactly this version."""
        s, stage = self.step, self.stage
        if s is None or s.runner is not None or held is None or stage is None:
            return []
        base = s.msg.base
        if held.version > base:
            log.warning(
                "step %d: base %d is gone (hold %d); dropped", s.msg.step, base, held.version
            )
            self.step = None
            self.dropped += 1
            return []
        if held.version < base:
            return []
        m, big_m, off = s.msg.micro, s.msg.micro_batches, s.msg.offset
        n = len(self.data.y_train)

        def rows(mb: int) -> np.ndarray:
            out: np.ndarray = (off + mb * m + np.arange(m)) % n
            return out

        def inputs(mb: int) -> np.ndarray:
            return np.asarray(self.data.x_train[rows(mb)], np.float32)

        def labels(mb: int) -> np.ndarray:
            return np.asarray(self.data.y_train[rows(mb)])

        a = self.assignment
        assert a is not None  # set with the stage
        self.wait_warm()
        s.runner = StageRunner(
            stage,
            held.tensors,
            big_m,
            a.inflight,
            inputs=inputs if stage.index == 0 else None,
            labels=labels if stage.is_last else None,
        )
        s.started = time.perf_counter()
        return self._timed(s.runner.start)

    def offer(self, msg: Act, ready: float = 0.0) -> list[Timed]:
        """An ``act`` or ``gact`` arrived through the relay, there at time.perf_counter()
        ``ready`` (:meth:`arrive`); the frames to send."""
        s = self.step
        if s is None or s.runner is None or not self._ours(msg):
            raise StageError(
                f"{msg.type} for step {msg.step} of replica {msg.replica} gen {msg.gen},"
                " which this worker is not running"
            )
        array = codecs.decode_tensor(msg.tensor, f"{msg.type}[{msg.mb}]")
        runner = s.runner
        try:
            return self._timed(lambda: runner.offer(msg.type, msg.mb, array), ready)
        except StageError:
            raise
        except Exception as exc:  # a wrong shape or a message for the wrong side: the runner
            self.step = None  # may be half-way through it, so the step is given up
            self.dropped += 1
            raise StageError(f"{msg.type} {msg.mb}: {exc}; step given up") from None

    def abort(self, msg: Abort) -> bool:
        """Take an ``abort``: forget the step it names; with ``dissolve``, the assignment too.
        True when this worker is no stage any more."""
        if self._ours(msg):
            self.step = None
            self.dropped += 1
        if msg.dissolve and self._ours(msg, step=False):
            self.assignment = None
            self.step = None
            log.info(
                "replica %d gen %d dissolved: back to data-parallel steps",
                msg.replica,
                msg.gen,
            )
        return self.assignment is None

    def _timed(
        self, work: Callable[[], list[tuple[str, int, np.ndarray]]], ready: float = 0.0
    ) -> list[Timed]:
        """Run ``work`` (the runner's next tasks, whose input is there at ``ready``) and time
        the frames it sends: each may leave once the emulated time of the tasks up to the one
        that made it has passed since the work began (at once without an emulation)."""
        s = self.step
        assert s is not None and s.runner is not None  # called while running a step
        runner = s.runner
        before = len(runner.trace)
        began = time.perf_counter()
        out = work()
        real = time.perf_counter() - began
        # the emulated device starts this work once its input is in and it finished the last
        t0 = max(began, self.free_at, ready)
        stage = self.stage
        assert stage is not None  # set with the assignment
        due = [t0] * len(out)
        emu = self.emulation
        if emu is not None:
            tasks = task_weights(runner.trace[before:], stage.is_last, stage.index == 0)
            total = sum(w for w, _ in tasks)
            unit = s.msg.micro * self.share  # whole-model samples of one micro-batch's work
            seconds = emu.stage_seconds(real, unit * total) if total > 0 else real
            done, due = 0.0, []
            for w, sends in tasks:
                done += w
                if sends:
                    due.append(t0 + seconds * done / total)
            if len(due) != len(out):  # a runner that sends otherwise: all at the end
                due = [t0 + seconds] * len(out)
            end = t0 + seconds
        else:
            end = t0 + real
        self.free_at = end
        m = s.msg
        none = codecs.get_codec("none")
        frames = [
            (
                at,
                (Act if kind == "act" else Gact)(
                    m.replica, m.gen, m.step, mb, none.encode(np.asarray(x, np.float32), None)
                ).encode(),
            )
            for at, (kind, mb, x) in zip(due, out, strict=True)
        ]
        if runner.done:
            frames.append((end, self._push(s, end)))
            self.step = None
        return frames

    def _push(self, s: _Step, end: float) -> bytes:
        assert s.runner is not None and self.stage is not None
        self.pushed += 1
        m = s.msg
        grads = s.runner.grads()
        return Push(
            self.push_id(),
            base=m.base,
            kind="grad",
            tensors=codecs.encode_tree(grads, codecs.get_codec("none")),
            samples=m.micro * m.micro_batches,
            steps=1,
            compute_s=max(time.perf_counter(), end) - s.started,
            loss=s.runner.loss if self.stage.is_last else None,
            replica=m.replica,
            gen=m.gen,
            step=m.step,
            stage=self.stage.index,
        ).encode()


class Outbox:
    """A worker's pipeline frames on their way to the daemon, each on the emulated uplink from
    the time it is due (:meth:`StageHost._timed`): the link is busy for its bytes over the
    bandwidth after the frames before it, and the frame is sent once its latency has passed as
    well; the latency is in flight, so the next frame's does not wait for it. Owned by the
    connection's reader (:func:`workers.receive.read`), which closes it."""

    def __init__(self, send: Callable[[bytes], Awaitable[None]], emulation: Emulation) -> None:
        """``send``: the connection's, with no link emulation of its own."""
        self._send = send
        self.emulation = emulation
        self._queue: deque[Timed] = deque()
        self._free = 0.0  # time.perf_counter() when the emulated uplink is free again
        self._task: asyncio.Task[None] | None = None

    def put(self, frames: Sequence[Timed]) -> list[float]:
        """Send ``frames`` (each with the time it is due), in order, once each has crossed;
        the time.perf_counter() each is sent at."""
        emu = self.emulation
        at = []
        for due, frame in frames:
            start = max(due, self._free)
            self._free = start + _wire_s(emu, len(frame))
            at.append(self._free + emu.latency_s)
            self._queue.append((at[-1], frame))
        if self._queue and (self._task is None or self._task.done()):
            self._task = asyncio.get_running_loop().create_task(self._drain())
            self._task.add_done_callback(_logged)
        return at

    async def _drain(self) -> None:
        while self._queue:
            at, frame = self._queue[0]
            wait = at - time.perf_counter()
            if wait > 0:
                await asyncio.sleep(wait)
            self._queue.popleft()
            await self._send(frame)

    async def close(self) -> None:
        """Stop sending (the connection is gone): what is still queued is dropped."""
        self._queue.clear()
        task, self._task = self._task, None
        if task is not None and not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


def _logged(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and (exc := task.exception()) is not None:
        log.info("pipeline frames not sent: %s", exc)  # the connection ended; the reader says why


async def handle(host: StageHost, msg: Pipeline, held: Held | None, out: Outbox) -> None:
    """Give ``host`` one pipeline message (the compute off the event loop) and put what it
    answers in ``out``; a step whose base version is not held asks the daemon for its
    parameters. A message the host cannot act on is logged and forgotten (the daemon aborts
    what it cannot finish). An activation or gradient is worked on at once, its emulated work
    timed from when it has crossed the emulated link (:meth:`StageHost.arrive`)."""
    try:
        if isinstance(msg, StageOrder):
            await asyncio.to_thread(host.assign, msg)
            frames: list[Timed] = []
        elif isinstance(msg, StepOrder):
            frames = await asyncio.to_thread(host.begin, msg, held)
        elif isinstance(msg, Abort):
            host.abort(msg)
            frames = []
        else:
            ready = host.arrive(_tensor_bytes(msg.tensor))
            frames = await asyncio.to_thread(host.offer, msg, ready)
    except (StageError, codecs.CodecError) as exc:
        log.warning("%s refused: %s", msg.type, exc)
        return
    out.put(frames)
    wanted = host.waiting_for()
    if isinstance(msg, StepOrder) and wanted is not None:
        out.put([(time.perf_counter(), Pull(None).encode())])


async def new_params(host: StageHost, held: Held, out: Outbox) -> None:
    """Parameters arrived: start the step that waited for their version."""
    if host.waiting_for() is None:
        return
    out.put(await asyncio.to_thread(host.params, held))


def _wire_s(emu: Emulation, nbytes: int) -> float:
    """Seconds ``nbytes`` hold the emulated link (its bandwidth; its latency is in flight)."""
    return 0.0 if emu.bandwidth is None else nbytes / emu.bandwidth


def _tensor_bytes(tensor: Any) -> int:
    """The bytes of an encoded tensor (its ``data``; 0 when it has none)."""
    data = tensor.get("data") if isinstance(tensor, Mapping) else None
    return len(data) if isinstance(data, bytes | bytearray | memoryview) else 0
