"""The worker's receive side: every frame the daemon sends (welcome, plan, params whole, in chunks
or as a reference into shared memory, pipeline stages, acks, errors), handed to the compute loop
through the :class:`workers.inbox.Inbox`."""

from __future__ import annotations

import asyncio
import logging
import time
from functools import partial

import aiohttp
import jax

from hetd.protocol import shm, wire
from hetd.protocol.frames import (
    Abort,
    Act,
    Chunk,
    Params,
    ParamsAt,
    ParamsRef,
    Pull,
    ShmOffer,
    StageOrder,
    StepOrder,
    decode,
)
from hetd.protocol.messages import (
    Ack,
    ErrorReply,
    PlanUpdate,
    ProfileRequest,
    ShardUpdate,
    Welcome,
)
from hetd.protocol.params import Held, apply_params, hash_matches
from hetd.zoo.task import Bound, TaskError
from workers.errors import FatalError
from workers.imports import Allowed, ImportRefused
from workers.inbox import Inbox
from workers.loop import Core, TaskMismatch, Trainer
from workers.parts import PartsError, PartsSender
from workers.prepare import prepared
from workers.pulls import Puller, SliceMismatch
from workers.push import send
from workers.shm import ShmLink
from workers.stage import Outbox, StageHost, handle, new_params
from workers.state import HELLO_ID, MAX_REFUSED, WorkerOptions, WorkerState

log = logging.getLogger("hetd.worker")


async def read(
    ws: aiohttp.ClientWebSocketResponse,
    opts: WorkerOptions,
    state: WorkerState,
    inbox: Inbox,
    device: jax.Device,
    hello_at: float,
) -> None:
    """Read every frame the daemon sends; hand parameters to the compute loop."""
    parts = wire.Reassembler(wire.MAX_MESSAGE)  # what the daemon sends over the cap, in chunks
    # pipeline frames cross the emulated link in flight (the outbox's), not in the send
    outbox = Outbox(partial(send, ws, opts=opts, link=False), opts.emulation)
    try:
        async for frame in ws:
            if frame.type == aiohttp.WSMsgType.PING:
                await ws.pong(frame.data)
                continue
            if frame.type == aiohttp.WSMsgType.PONG:
                inbox.pong.set()
                continue
            if frame.type != aiohttp.WSMsgType.BINARY:
                break
            data: bytes = frame.data
            size = len(data)
            try:
                msg = decode(data, opts.max_frame_bytes)
                if isinstance(msg, Chunk):
                    whole = parts.feed(msg.message())
                    if whole is None:
                        continue
                    data, size = whole, len(whole)
                    msg = await asyncio.to_thread(decode, data, parts.max_bytes)
            except wire.ProtocolError as exc:  # the daemon's frames are its own: not a glitch
                raise FatalError(unreadable(exc)) from None
            if isinstance(msg, ParamsRef):  # a params frame in the daemon's shared memory
                ref = msg
                try:
                    if inbox.shm is None:
                        raise shm.ShmError("unexpected", "params_ref without shared memory")
                    size, msg = await asyncio.to_thread(inbox.shm.read_params, ref)
                except (shm.ShmError, wire.ProtocolError) as exc:
                    log.info("params_ref %d not read (%s): pulling again", ref.version, exc)
                    await ws.send_bytes(Pull(None).encode())
                    continue
            if isinstance(msg, ShmOffer):
                if opts.shm and inbox.shm is None:
                    accepted = await asyncio.to_thread(ShmLink.accept, msg.segment)  # maps it all
                    if accepted is not None:
                        inbox.shm, ready = accepted
                        await ws.send_bytes(ready)
            elif isinstance(msg, Welcome):
                state.rtt_s = time.perf_counter() - hello_at
                state.heartbeat_s = msg.heartbeat_s
                inbox.joined.set()
                core = await prepared(state.preparing)
                state.preparing = None
                try:
                    await asyncio.to_thread(
                        welcome, msg, state, device, core, opts.task, opts.allowed
                    )
                except (TaskMismatch, TaskError, ImportRefused) as exc:  # retrying will not help
                    raise FatalError(str(exc)) from None
                inbox.welcomed.set()
            elif isinstance(msg, ProfileRequest):
                inbox.profile = msg
            elif isinstance(msg, PlanUpdate):  # the whole plan, every time
                if state.plan.pipeline and not msg.plan.pipeline:
                    inbox.unpipeline()
                state.plan = msg.plan
            elif isinstance(msg, ShardUpdate):  # the data was cut again (a worker came or went)
                if state.trainer is not None:
                    state.trainer.reshard(msg.index, msg.count)
                    log.info("now reading shard %d of %d", msg.index, msg.count)
            elif isinstance(msg, Params):
                delay = opts.emulation.transfer_seconds(size)
                if delay:  # the emulated link carries parameters too, as the simulator charges
                    await asyncio.sleep(delay)
                held = await asyncio.to_thread(apply_params, inbox.params, msg)
                if held is not None and msg.full and msg.hash is not None:
                    if not await asyncio.to_thread(hash_matches, held, msg):
                        # Never train on parameters known to be wrong: ask for all of them again.
                        state.hash_mismatches += 1
                        log.warning(
                            "params hash mismatch: version %d is not what the daemon published "
                            "(hash_mismatches=%d); pulling again",
                            msg.version,
                            state.hash_mismatches,
                        )
                        held = None
                        state.hash_checked = False  # log the next verified pull: recovered
                    elif not state.hash_checked:
                        state.hash_checked = True
                        log.info(
                            "params hash verified: version %d (hash_mismatches=%d)",
                            msg.version,
                            state.hash_mismatches,
                        )
                if held is None:  # a delta against parameters we do not hold: ask for all
                    await ws.send_bytes(Pull(None).encode())
                else:
                    inbox.deliver(held)
                    if state.stage_host is not None:
                        await new_params(state.stage_host, held, outbox)
            elif isinstance(msg, ParamsAt):  # a full release, pulled from the pservers
                pulled = await pull(msg, opts, state)
                if pulled is None:
                    await ws.send_bytes(Pull(None).encode())
                else:
                    inbox.deliver(pulled)
                    if state.stage_host is not None:
                        await new_params(state.stage_host, pulled, outbox)
            elif isinstance(msg, StageOrder | StepOrder | Abort | Act):
                dataset = state.trainer.data if state.trainer is not None else None
                if state.stage_host is None and dataset is not None:
                    assert state.trainer is not None  # the data set is its
                    state.stage_host = StageHost(
                        state.model_setup,
                        dataset,
                        state.next_push_id,
                        opts.emulation,
                        state.trainer.bound.layout.shapes,
                    )
                if state.stage_host is not None:
                    was_staged, inbox.staged = inbox.staged, True  # no data-parallel step now
                    await handle(state.stage_host, msg, inbox.params, outbox)
                    if state.stage_host.assignment is None:  # dissolved (or never assigned)
                        if was_staged:  # a stage holds its blocks' slice: pull the whole set
                            inbox.params = None
                            await ws.send_bytes(Pull(None).encode())
                        inbox.staged = False
                        inbox.in_flight = 0
                        inbox.changed.set()
            elif isinstance(msg, Ack):
                state.unacked.pop(msg.id, None)
                if state.parts is not None:
                    state.parts.done(msg.id)
                inbox.answered(msg.id, msg.status)
                if msg.status in ("dropped", "duplicate"):
                    log.info("push %d %s: %s", msg.id, msg.status, msg.reason)
            elif isinstance(msg, ErrorReply):
                log.warning("daemon error %s: %s", msg.code, msg.text)
                if msg.code == "no_codec":
                    raise FatalError(msg.text)
                if msg.id == HELLO_ID and not inbox.joined.is_set():
                    raise FatalError(refused_hello(msg))
                state.unacked.pop(msg.id, None)  # a refused push is not sent again
                if state.parts is not None:
                    state.parts.done(msg.id)
                if inbox.refused(msg.id) and inbox.rejected_in_a_row >= MAX_REFUSED:
                    # Leaving frees every barrier this worker holds; the operator sees why.
                    raise FatalError(
                        f"the daemon refused {MAX_REFUSED} pushes in a row; last: "
                        f"{msg.code}: {msg.text}"
                    )
        raise ConnectionError(f"daemon closed the connection (code {ws.close_code})")
    except BaseException as exc:
        inbox.closed = exc
        inbox.changed.set()
        raise
    finally:
        await outbox.close()


async def pull(msg: ParamsAt, opts: WorkerOptions, state: WorkerState) -> Held | None:
    """The release ``msg`` names, from the pservers, checked; None: ask the daemon again (a
    pserver no longer holds it, or a slice was not what the daemon named)."""
    if state.pulls is None:  # (a daemon names positions only to a worker it gave pservers)
        raise FatalError("the daemon sent params_at without naming its pservers")
    try:
        got = await state.pulls.fetch(msg)
    except SliceMismatch as exc:
        state.hash_mismatches += 1  # never train on parameters known to be wrong
        log.warning(
            "params hash mismatch: %s is not what the daemon published for version %d "
            "(hash_mismatches=%d); pulling again",
            exc,
            msg.version,
            state.hash_mismatches,
        )
        state.hash_checked = False
        return None
    if got is None:
        log.info(
            "release %d at position %d no longer held: pulling again", msg.version, msg.position
        )
        return None
    held, size = got
    delay = opts.emulation.transfer_seconds(size)
    if delay:  # the emulated link carries the slices too
        await asyncio.sleep(delay)
    if not state.hash_checked:  # (every slice was checked against its hash)
        state.hash_checked = True
        log.info(
            "params hash verified: version %d, %d slices (hash_mismatches=%d)",
            msg.version,
            len(msg.slices),
            state.hash_mismatches,
        )
    return held


def unreadable(exc: wire.ProtocolError) -> str:
    """Why the worker leaves when a daemon's frame does not decode here."""
    return (
        f"the daemon sent a frame this worker cannot read ({exc.code}: {exc.message}); run a "
        "hetd-worker of the daemon's release (docs/design.md, Compatibility across 0.x)"
    )


def refused_hello(err: ErrorReply) -> str:
    """Why the worker leaves when the daemon refuses its hello: saying it again would not help."""
    return (
        f"the daemon refused this worker's hello ({err.code}: {err.text}); run a hetd-worker "
        "of the daemon's release (docs/design.md, Compatibility across 0.x)"
    )


def welcome(
    w: Welcome,
    state: WorkerState,
    device: jax.Device,
    core: Core | None = None,
    task: Bound | None = None,
    allowed: Allowed | None = None,
) -> None:
    """Take the welcome; the trainer reuses ``core`` (a prepared one) or the last trainer's core
    when they were built for the same model, data and settings. ``task``: this worker's own
    Task (``--task``), checked against the daemon's; :class:`TaskMismatch` when they differ.
    ``allowed``: the plug-ins this worker's operator named (:mod:`workers.imports`)."""
    setup = {**w.setup, "shard": {"index": w.shard, "count": w.shards}}
    state.worker_id = w.worker_id
    pservers = setup.get("pservers")
    if pservers is not None:  # its pushes' parts go to them (workers.parts)
        try:
            if state.parts is None:
                state.parts = PartsSender(pservers)
                state.pulls = Puller(pservers)
            else:
                state.parts.update(pservers)
                if state.pulls is not None:
                    state.pulls.update(pservers)
        except PartsError as exc:  # the daemon's own field: retrying will not help
            raise FatalError(str(exc)) from None
    state.model_setup = dict(setup["model"])
    state.secret = w.secret
    state.plan = w.plan
    state.heartbeat_s = w.heartbeat_s
    key = repr((setup["model"], setup["dataset"], setup["shard"], setup["train"]))
    if state.trainer is None or state.trainer_key != key:
        reuse = core if core is not None or state.trainer is None else state.trainer.core
        state.trainer = Trainer(setup, device, reuse, task, allowed)
        state.trainer_key = key
    log.info(
        "joined as worker %d, plan %s%s",
        state.worker_id,
        state.plan.to_wire(),
        " (model prepared before the welcome)"
        if core is not None and state.trainer.core is core
        else "",
    )
