"""The worker's push side: one step to an encoded ``push`` frame, the frame sent (over the
emulated link, in chunks, or as a reference into shared memory), kept frames sent again, and the
heartbeats."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time

import aiohttp
import numpy as np

from hetd.codecs import registry as codecs
from hetd.codecs.feedback import encode_with_feedback
from hetd.protocol import wire
from hetd.protocol.frames import Heartbeat, Push, decode
from hetd.protocol.params import Held
from hetd.protocol.plan import codec_for, local_steps_for
from hetd.zoo.task import TaskError
from workers.errors import FatalError
from workers.loop import host_free_memory
from workers.state import Frame, WorkerOptions, WorkerState


async def compute(msg: Held, opts: WorkerOptions, state: WorkerState, idle_s: float) -> Frame:
    """One step from a ``params`` message to an encoded ``push`` frame. ``idle_s`` is how long the
    device sat idle since its last step ended (waiting for parameters and for the last push).

    The push is packed as segments (:func:`hetd.protocol.wire.pack_parts`, byte for byte what
    :func:`hetd.protocol.wire.encode` gives): the update's bytes are not copied into a packer's
    buffer, so over shared memory they are copied once, into the ring, where a msgpack frame cost
    a copy into fresh pages first (at 5.8M parameters 18 ms of a step's ≈ 50 ms of CPU)."""
    if state.trainer is None:
        raise ConnectionError("params before welcome")
    params = msg.tensors
    trainer = state.trainer
    opts.emulation.check_whole_step(trainer.bound.layout.shapes, trainer.core.micro_batch)
    plan = dataclasses.replace(
        state.plan, local_steps=local_steps_for(state.plan, state.local_step_s)
    )
    t0 = time.perf_counter()
    try:
        update = await asyncio.to_thread(state.trainer.step, params, plan)
    except TaskError as exc:  # the task's data or loss is wrong: retrying will not help
        raise FatalError(str(exc)) from None
    compute_s = time.perf_counter() - t0
    emulated = opts.emulation.step_seconds(compute_s, update.samples)
    if emulated > compute_s:
        await asyncio.sleep(emulated - compute_s)
    per_step = emulated / max(1, update.steps)
    old = state.local_step_s
    state.local_step_s = per_step if old is None else 0.5 * per_step + 0.5 * old
    codec = codec_for(state.plan)
    free = opts.emulation.memory if opts.emulation.memory is not None else host_free_memory()
    state.steps += 1
    state.push_id += 1
    tensors = encode_with_feedback(state.feedback, update.tensors, codec, state.rng)
    if opts.emulation.corrupt_push():  # after encoding: the residual stays clean
        first = next(iter(update.tensors))
        bad = np.full(update.tensors[first].shape, np.nan, np.float32)
        tensors[first] = codecs.get_codec("none").encode(bad, None)
    push = Push(
        state.push_id,
        base=msg.version,
        kind=update.kind,
        tensors=tensors,
        samples=update.samples,
        steps=update.steps,
        compute_s=emulated,
        loss=update.loss,
        free_mem=free,
        sent_at=time.time(),
        idle_s=idle_s,
    )
    return wire.pack_parts(push.type, push.id, **push.fields())


def frame_size(frame: Frame) -> int:
    """A push frame's size in bytes."""
    return len(frame) if isinstance(frame, bytes) else frame.nbytes


def joined(frame: Frame) -> bytes:
    """A push frame as one ``bytes`` (one copy of :class:`hetd.protocol.wire.Parts`)."""
    return frame if isinstance(frame, bytes) else frame.join()


def restamped(frame: Frame) -> bytes:
    """A kept push frame to send again: the same request id and update, without the ``sent_at``
    stamp (the daemon would take the time since the first send for the link's)."""
    data = joined(frame)
    push = decode(data, max_size=len(data))
    if not isinstance(push, Push):
        raise TypeError(f"a kept push frame holds a {push.type} message")
    return dataclasses.replace(push, sent_at=None).encode()


async def send(
    ws: aiohttp.ClientWebSocketResponse,
    frame: Frame,
    opts: WorkerOptions,
    ref: bytes | None = None,
    link: bool = True,
    size: int | None = None,
) -> None:
    """Send a push, first waiting out the emulated link's transfer time; over the frame cap, in
    ``chunk`` messages (the daemon joins them); ``ref``: its ``push_ref`` (the push itself is
    in shared memory); ``link`` False: the caller emulated the link (:class:`workers.stage.Outbox`);
    ``size``: the bytes the link carries for it (default the frame's; a header's push, the whole
    update's, which its parts carry)."""
    nbytes = frame_size(frame) if size is None else size
    delay = opts.emulation.transfer_seconds(nbytes) if link else 0.0
    if delay:
        await asyncio.sleep(delay)
    if ref is not None:
        await ws.send_bytes(ref)
        return
    for piece in wire.chunks(joined(frame), opts.max_frame_bytes):
        await ws.send_bytes(piece)


async def heartbeats(ws: aiohttp.ClientWebSocketResponse, every_s: float) -> None:
    frame = Heartbeat().encode()
    while not ws.closed:
        await asyncio.sleep(every_s)
        with contextlib.suppress(ConnectionError, RuntimeError):
            await ws.send_bytes(frame)
