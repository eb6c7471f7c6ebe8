"""A worker's side of a pipeline replica (docs/policies.md §11): the stage the daemon assigned it
(``stage``), the replica step it runs (``step``), the activations and gradients it exchanges with
its neighbours through the daemon's relay (``act``/``gact``), and the push of its gradient slice.

:class:`StageHost` is pure compute and bookkeeping: messages in, frames to send out. It never
talks to the network (``workers.client`` does). The model must be block-structured
(:func:`hetd.zoo.blocks.blocks_for`); stage 0 reads the step's inputs and the last stage its
labels from the same sample indices of the training set (every worker loads the whole data set),
so no sample travels.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from hetd.codecs import registry as codecs
from hetd.protocol.frames import Abort, Act, Gact, Pipeline, Pull, Push, StageOrder, StepOrder
from hetd.protocol.params import Held
from hetd.zoo.blocks import blocks_for
from hetd.zoo.data import Dataset
from hetd.zoo.stages import Stage, StageRunner

log = logging.getLogger("hetd.worker.stage")


class StageError(ValueError):
    """A pipeline message this worker cannot act on (no block model, no assignment, ...)."""


@dataclass
class _Step:
    msg: StepOrder
    runner: StageRunner | None = None  # None until the parameters of its base are held
    started: float = 0.0


class StageHost:
    """One worker's pipeline stage and its current step."""

    def __init__(self, model: dict[str, Any], data: Dataset, push_id: Callable[[], int]) -> None:
        """``model``: the welcome's model setup (``spec``, ``kwargs``); ``data``: the data set;
        ``push_id``: the request id of the next push (the worker's own sequence)."""
        self.model = model
        self.push_id = push_id
        self.data = data
        self.assignment: StageOrder | None = None
        self.stage: Stage | None = None
        self.step: _Step | None = None
        self.pushed = 0  # slices pushed
        self.dropped = 0  # steps given up (aborted, or their base no longer held)

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
        old = self.stage
        if old is None or (old.lo, old.hi, old.index, old.of) != key:
            self.stage = Stage(bm, lo, hi, msg.stage, msg.of)
        self.assignment = msg
        self.step = None
        log.info(
            "stage %d of %d in replica %d gen %d: blocks [%d, %d)",
            msg.stage,
            msg.of,
            msg.replica,
            msg.gen,
            lo,
            hi,
        )

    def _ours(self, msg: StepOrder | Abort | Act, step: bool = True) -> bool:
        a = self.assignment
        if a is None or (msg.replica, msg.gen) != (a.replica, a.gen):
            return False
        return not step or (self.step is not None and self.step.msg.step == msg.step)

    def begin(self, msg: StepOrder, held: Held | None) -> list[bytes]:
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

    def params(self, held: Held | None) -> list[bytes]:
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
        s.runner = StageRunner(
            stage,
            held.tensors,
            big_m,
            a.inflight,
            inputs=inputs if stage.index == 0 else None,
            labels=labels if stage.is_last else None,
        )
        s.started = time.perf_counter()
        return self._frames(s.runner.start())

    def offer(self, msg: Act) -> list[bytes]:
        """An ``act`` or ``gact`` arrived through the relay; the frames to send."""
        s = self.step
        if s is None or s.runner is None or not self._ours(msg):
            raise StageError(
                f"{msg.type} for step {msg.step} of replica {msg.replica} gen {msg.gen},"
                " which this worker is not running"
            )
        array = codecs.decode_tensor(msg.tensor, f"{msg.type}[{msg.mb}]")
        try:
            out = s.runner.offer(msg.type, msg.mb, array)
        except Exception as exc:  # a wrong shape or a message for the wrong side: the runner
            self.step = None  # may be half-way through it, so the step is given up
            self.dropped += 1
            raise StageError(f"{msg.type} {msg.mb}: {exc}; step given up") from None
        return self._frames(out)

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

    def _frames(self, out: list[tuple[str, int, np.ndarray]]) -> list[bytes]:
        s = self.step
        assert s is not None and s.runner is not None  # called while running a step
        m = s.msg
        none = codecs.get_codec("none")
        frames = [
            (Act if kind == "act" else Gact)(
                m.replica, m.gen, m.step, mb, none.encode(np.asarray(x, np.float32), None)
            ).encode()
            for kind, mb, x in out
        ]
        if s.runner.done:
            frames.append(self._push(s))
            self.step = None
        return frames

    def _push(self, s: _Step) -> bytes:
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
            compute_s=time.perf_counter() - s.started,
            loss=s.runner.loss if self.stage.is_last else None,
            replica=m.replica,
            gen=m.gen,
            step=m.step,
            stage=self.stage.index,
        ).encode()


async def handle(
    host: StageHost,
    msg: Pipeline,
    held: Held | None,
    send: Callable[[bytes], Awaitable[None]],
) -> None:
    """Give ``host`` one pipeline message (the compute off the event loop) and send what it
    answers; a step whose base version is not held asks the daemon for its parameters. A message
    the host cannot act on is logged and forgotten (the daemon aborts what it cannot finish)."""
    try:
        if isinstance(msg, StageOrder):
            await asyncio.to_thread(host.assign, msg)
            frames: list[bytes] = []
        elif isinstance(msg, StepOrder):
            frames = await asyncio.to_thread(host.begin, msg, held)
        elif isinstance(msg, Abort):
            host.abort(msg)
            frames = []
        else:
            frames = await asyncio.to_thread(host.offer, msg)
    except (StageError, codecs.CodecError) as exc:
        log.warning("%s refused: %s", msg.type, exc)
        return
    for frame in frames:
        await send(frame)
    wanted = host.waiting_for()
    if isinstance(msg, StepOrder) and wanted is not None:
        await send(Pull(None).encode())


async def new_params(host: StageHost, held: Held, send: Callable[[bytes], Awaitable[None]]) -> None:
    """Parameters arrived: start the step that waited for their version."""
    if host.waiting_for() is None:
        return
    for frame in await asyncio.to_thread(host.params, held):
        await send(frame)
