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
from hetd.protocol.messages import (
    Ack,
    ErrorReply,
    PlanUpdate,
    ProfileRequest,
    ShardUpdate,
    Welcome,
    read_reply,
)
from hetd.protocol.params import apply_params, hash_matches
from hetd.zoo.task import Bound, TaskError
from workers.imports import Allowed, ImportRefused
from workers.inbox import Inbox
from workers.loop import Core, TaskMismatch, Trainer
from workers.prepare import prepared
from workers.push import send
from workers.shm import ShmLink
from workers.stage import PIPELINE_TYPES, StageHost, handle, new_params
from workers.state import HELLO_ID, MAX_REFUSED, FatalError, WorkerOptions, WorkerState

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
            msg = wire.decode(data, opts.max_frame_bytes)
            if msg.type == "chunk":
                whole = parts.feed(msg)
                if whole is None:
                    continue
                data, size = whole, len(whole)
                msg = await asyncio.to_thread(wire.decode, data, parts.max_bytes)
            if msg.type == "params_ref":  # a params frame in the daemon's shared memory
                try:
                    if inbox.shm is None:
                        raise shm.ShmError("unexpected", "params_ref without shared memory")
                    size, msg = await asyncio.to_thread(inbox.shm.read_params, msg)
                except (shm.ShmError, wire.ProtocolError) as exc:
                    log.info("params_ref %d not read (%s): pulling again", msg["version"], exc)
                    await ws.send_bytes(wire.encode("pull", 0, have=None))
                    continue
            if msg.type == "shm_offer" and opts.shm and inbox.shm is None:
                accepted = await asyncio.to_thread(ShmLink.accept, msg["segment"])  # maps it all
                if accepted is not None:
                    inbox.shm, ready = accepted
                    await ws.send_bytes(ready)
            elif msg.type == "welcome":
                state.rtt_s = time.perf_counter() - hello_at
                state.heartbeat_s = float(msg["heartbeat_s"])
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
            elif isinstance(reply := read_reply(msg), ProfileRequest):
                inbox.profile = reply.spec()
            elif isinstance(reply, PlanUpdate):  # the whole plan, every time
                if state.plan.pipeline and not reply.plan.pipeline:
                    inbox.unpipeline()
                state.plan = reply.plan
            elif isinstance(reply, ShardUpdate):  # the data was cut again (a worker came or went)
                if state.trainer is not None:
                    state.trainer.reshard(reply.index, reply.count)
                    log.info("now reading shard %d of %d", reply.index, reply.count)
            elif msg.type == "params":
                delay = opts.emulation.transfer_seconds(size)
                if delay:  # the emulated link carries parameters too, as the simulator charges
                    await asyncio.sleep(delay)
                held = await asyncio.to_thread(apply_params, inbox.params, msg)
                if held is not None and msg["full"] and msg.get("hash") is not None:
                    if not await asyncio.to_thread(hash_matches, held, msg):
                        # Never train on parameters known to be wrong: ask for all of them again.
                        state.hash_mismatches += 1
                        log.warning(
                            "params hash mismatch: version %d is not what the daemon published "
                            "(hash_mismatches=%d); pulling again",
                            msg["version"],
                            state.hash_mismatches,
                        )
                        held = None
                        state.hash_checked = False  # log the next verified pull: recovered
                    elif not state.hash_checked:
                        state.hash_checked = True
                        log.info(
                            "params hash verified: version %d (hash_mismatches=%d)",
                            msg["version"],
                            state.hash_mismatches,
                        )
                if held is None:  # a delta against parameters we do not hold: ask for all
                    await ws.send_bytes(wire.encode("pull", 0, have=None))
                else:
                    inbox.deliver(held)
                    if state.stage_host is not None:
                        await new_params(state.stage_host, held, partial(send, ws, opts=opts))
            elif msg.type in PIPELINE_TYPES:
                dataset = state.trainer.data if state.trainer is not None else None
                if state.stage_host is None and dataset is not None:
                    state.stage_host = StageHost(state.model_setup, dataset, state.next_push_id)
                if state.stage_host is not None:
                    was_staged, inbox.staged = inbox.staged, True  # no data-parallel step now
                    answer = partial(send, ws, opts=opts)
                    await handle(state.stage_host, msg, inbox.params, answer)
                    if state.stage_host.assignment is None:  # dissolved (or never assigned)
                        if was_staged:  # a stage holds its blocks' slice: pull the whole set
                            inbox.params = None
                            await ws.send_bytes(wire.encode("pull", 0, have=None))
                        inbox.staged = False
                        inbox.in_flight = 0
                        inbox.changed.set()
            elif isinstance(reply, Ack):
                state.unacked.pop(reply.id, None)
                inbox.answered(reply.id, reply.status)
                if reply.status in ("dropped", "duplicate"):
                    log.info("push %d %s: %s", reply.id, reply.status, reply.reason)
            elif isinstance(reply, ErrorReply):
                log.warning("daemon error %s: %s", reply.code, reply.text)
                if reply.code == "no_codec":
                    raise FatalError(reply.text)
                if (
                    reply.code == "malformed"
                    and reply.id == HELLO_ID
                    and not state.plain_hello
                    and not inbox.joined.is_set()
                ):
                    # Our hello itself was refused: a daemon from before hello's ``features``
                    # (the one optional field of a hello it could not know). Once without them.
                    state.plain_hello = True
                    raise ConnectionError("the daemon takes no hello features; saying hello again")
                state.unacked.pop(reply.id, None)  # a refused push is not sent again
                if inbox.refused(reply.id) and inbox.rejected_in_a_row >= MAX_REFUSED:
                    # Leaving frees every barrier this worker holds; the operator sees why.
                    raise FatalError(
                        f"the daemon refused {MAX_REFUSED} pushes in a row; last: "
                        f"{reply.code}: {reply.text}"
                    )
        raise ConnectionError(f"daemon closed the connection (code {ws.close_code})")
    except BaseException as exc:
        inbox.closed = exc
        inbox.changed.set()
        raise


def welcome(
    msg: wire.Message,
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
    w = read_reply(msg)
    assert isinstance(w, Welcome)  # (called for a welcome, which wire.decode checked)
    setup = {**w.setup, "shard": {"index": w.shard, "count": w.shards}}
    state.worker_id = w.worker_id
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
