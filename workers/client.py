"""The worker's connection: hello/welcome, then params -> compute -> push, heartbeats beside it;
reconnects with backoff when the daemon goes away and resumes as the same worker."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import random
import ssl
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import aiohttp
import jax
import numpy as np

from hetd.codecs import registry as codecs
from hetd.codecs.feedback import ErrorFeedback, encode_with_feedback
from hetd.protocol import shm, wire
from hetd.protocol.params import Held, apply_params, hash_matches
from hetd.protocol.plan import Plan, codec_for, local_steps_for
from workers.emulate import Emulation
from workers.loop import Core, Trainer, device_info, host_free_memory
from workers.prepare import prepared, start_preparing
from workers.shm import ShmLink, wanted
from workers.stage import PIPELINE_TYPES, StageHost, handle, new_params

log = logging.getLogger("hetd.worker")

MAX_REFUSED = 5  # pushes refused in a row before the worker gives up (a diverging worker)
MAX_UNACKED = 8  # unanswered pushes kept to send again after a reconnect (the oldest go first)

Frame = bytes | wire.Parts
"""A push as packed: ``bytes``, or :class:`hetd.protocol.wire.Parts` whose big segments are the
update's own arrays (never written again), joined only when the push goes over the socket."""


class FatalError(RuntimeError):
    """Retrying will not help (wrong token, refused codec): the worker exits."""


@dataclass
class WorkerOptions:
    """Everything ``hetd-worker`` takes."""

    url: str
    token: str = ""
    name: str = "worker"
    device: jax.Device | None = None
    emulation: Emulation = field(default_factory=Emulation)
    max_frame_bytes: int = wire.DEFAULT_MAX_FRAME
    max_steps: int = 0  # 0: run until stopped
    max_retries: int = -1  # -1: retry forever
    backoff_s: float = 0.5
    backoff_max_s: float = 10.0
    # wss:// URLs: verify the daemon's certificate with this (None: the system's trust store)
    ssl_context: ssl.SSLContext | None = None
    shm: bool = True  # take shared memory when the daemon offers it (same host only)


@dataclass
class WorkerState:
    """What survives a reconnect."""

    worker_id: int | None = None
    secret: str | None = None  # the welcome's: shown to resume worker_id after a reconnect
    steps: int = 0
    hash_mismatches: int = 0  # full pulls whose parameters did not match the frame's hash
    hash_checked: bool = False  # a verified full pull was logged (since the last mismatch)
    trainer: Trainer | None = None
    trainer_key: str = ""
    # the daemon refused our hello's ``features`` (a daemon from before that field): say none
    plain_hello: bool = False
    # the core being built from the daemon's /v1/prepare while it starts (workers.prepare)
    preparing: asyncio.Task[Core | None] | None = None
    plan: Plan = field(default_factory=Plan)  # the daemon's latest plan for this worker
    heartbeat_s: float = 2.0
    feedback: ErrorFeedback = field(default_factory=ErrorFeedback)  # what lossy pushes still owe
    rng: np.random.Generator = field(default_factory=lambda: np.random.default_rng(0))
    rtt_s: float = 0.0  # s from hello to welcome (the daemon's join work included)
    profile_bytes: tuple[int, int] = (0, 0)  # the profile's push and parameter frame sizes
    local_step_s: float | None = None  # s per local step as charged (emulation included), EWMA
    # Exactly-once pushes: request ids increase for the whole process (a reconnect resumes the
    # same worker, whose daemon acks an id it has seen as ``duplicate`` and never applies it
    # twice), and pushes not yet answered are kept, in id order, to be sent again after a
    # reconnect: one the daemon did not see is not lost, one it did see is not applied twice.
    push_id: int = 0  # the request id of the last push made
    unacked: dict[int, Frame] = field(default_factory=dict)  # request id -> push frame
    model_setup: dict[str, Any] = field(default_factory=dict)  # the welcome's ``model``
    stage_host: StageHost | None = None  # the pipeline stage the daemon assigned, if any

    def next_push_id(self) -> int:
        """A fresh request id for a push."""
        self.push_id += 1
        return self.push_id

    def keep_unacked(self, push_id: int, frame: Frame) -> None:
        """Remember a push until the daemon answers it (at most :data:`MAX_UNACKED`)."""
        self.unacked[push_id] = frame
        while len(self.unacked) > MAX_UNACKED:
            oldest = min(self.unacked)
            del self.unacked[oldest]
            log.warning("push %d still unanswered: no longer kept for a resend", oldest)


async def run_worker(opts: WorkerOptions) -> int:
    """Connect, train, reconnect; returns the number of pushes made."""
    state = WorkerState()
    failures = 0
    async with aiohttp.ClientSession() as http:
        while opts.max_steps == 0 or state.steps < opts.max_steps:
            if state.trainer is None and state.preparing is None:  # until one is built
                state.preparing = await start_preparing(
                    http, opts.url, opts.token, opts.ssl_context, opts.device
                )
            try:
                await _session(http, opts, state)
                failures = 0
            except FatalError:
                raise
            except (TimeoutError, aiohttp.ClientError, ConnectionError) as exc:
                failures += 1
                if 0 <= opts.max_retries < failures:
                    raise FatalError(
                        f"daemon unreachable after {failures - 1} retries: {exc}"
                    ) from exc
                delay = min(opts.backoff_max_s, opts.backoff_s * 2 ** min(failures - 1, 10))
                delay *= 0.5 + random.random() / 2
                log.warning("connection lost (%s); retrying in %.1fs", exc, delay)
                await asyncio.sleep(delay)
    return state.steps


class Inbox:
    """What the reader task hands the compute loop: the newest parameters and how many pushes are
    still unanswered. A worker computes when it has parameters and at most ``depth`` pushes in
    flight (0, or 1 when its plan says ``pipeline``: the next step overlaps the last push)."""

    def __init__(self) -> None:
        self.params: Held | None = None
        self.in_flight = 0
        self.changed = asyncio.Event()
        self.joined = asyncio.Event()  # the welcome arrived: heartbeats start
        self.welcomed = asyncio.Event()  # ... and the trainer is built
        self.profile: dict[str, Any] | None = None  # a pending ``profile`` request
        self.closed: BaseException | None = None
        self.pushes: set[int] = set()  # request ids of pushes the daemon has not answered
        self.resent: set[int] = set()  # ... of earlier sessions' pushes sent again (not in flight)
        self.shm: ShmLink | None = None  # shared memory with a same-host daemon, once agreed
        self.rejected_in_a_row = 0  # pushes the daemon refused with ``error`` since one went in
        self.staged = False  # a pipeline stage is assigned: only replica steps run
        self.pong = asyncio.Event()  # a websocket pong arrived (a link round trip, see _link_rtt)

    def deliver(self, held: Held) -> None:
        """New parameters arrived."""
        self.params = held
        self.in_flight = max(0, self.in_flight - 1)
        self.changed.set()

    def unpipeline(self) -> None:
        """The plan stopped pipelining. A pipelined worker computes on while its pushes wait, so
        it may count two unanswered where the daemon, which answers each wait for parameters with
        one release however many pushes came in it, owes it one or none; waiting for all of them
        now would wait forever (a hot swap from hps to any policy did). So the next step starts
        from the parameters held, and every release after it answers one push again."""
        self.in_flight = 0
        self.changed.set()

    def answered(self, push_id: int, status: str = "applied") -> None:
        """The daemon acknowledged push ``push_id`` (applied, buffered, dropped or duplicate). No
        parameters follow a ``duplicate`` of a push in flight: the next step may start."""
        if push_id in self.pushes and status == "duplicate":
            self.in_flight = max(0, self.in_flight - 1)
            self.changed.set()
        self.pushes.discard(push_id)
        self.resent.discard(push_id)
        self.rejected_in_a_row = 0

    def refused(self, push_id: int) -> bool:
        """The daemon refused push ``push_id`` with an ``error``: nothing of it counts and no
        parameters follow, so the next step starts from the parameters held. False when the id
        is no push of ours in flight."""
        if push_id in self.resent:  # sent again after a reconnect: never counted in flight
            self.resent.discard(push_id)
            self.rejected_in_a_row += 1
            return True
        if push_id not in self.pushes:
            return False
        self.pushes.discard(push_id)
        self.in_flight = max(0, self.in_flight - 1)
        self.rejected_in_a_row += 1
        self.changed.set()
        return True

    async def take(self, depth: int) -> Held:
        """Wait until a step may start; the parameters to start it from."""
        while True:
            if isinstance(self.closed, FatalError):
                raise self.closed
            if self.closed is not None:
                raise ConnectionError(f"daemon connection ended: {self.closed}")
            if self.params is not None and self.in_flight <= depth and not self.staged:
                return self.params
            self.changed.clear()
            await self.changed.wait()


async def _session(http: aiohttp.ClientSession, opts: WorkerOptions, state: WorkerState) -> None:
    headers = {"Authorization": f"Bearer {opts.token}"} if opts.token else {}
    try:
        ws = await http.ws_connect(
            opts.url.rstrip("/") + "/v1/ws",
            headers=headers,
            max_msg_size=opts.max_frame_bytes,
            compress=0,
            autoping=False,  # _read answers pings and times our own (_link_rtt)
            ssl=opts.ssl_context if opts.ssl_context is not None else True,
        )
    except aiohttp.ClientConnectorCertificateError as exc:  # retrying will not help
        raise FatalError(
            f"the daemon's TLS certificate was not accepted: {exc.certificate_error} "
            "(pass --ca FILE with the CA that signed it)"
        ) from None
    except aiohttp.WSServerHandshakeError as exc:
        if exc.status == 401:
            raise FatalError("the daemon refused our token (401): set HETD_WORKER_TOKEN") from None
        raise
    device = opts.device or jax.devices()[0]
    info = device_info(device)
    if opts.emulation.memory is not None:
        info["free_memory"] = opts.emulation.memory
    inbox = Inbox()
    async with ws:
        resume = (
            {"worker_id": state.worker_id, "secret": state.secret}
            if state.worker_id is not None
            else None
        )
        # Named features only to a daemon that takes the field (an older one refuses it).
        features = [*wire.WORKER_FEATURES, *wanted(opts.shm)]
        extra = {} if state.plain_hello else {"features": features}
        await ws.send_bytes(
            wire.encode(
                "hello",
                1,
                name=opts.name,
                device=info,
                codecs=codecs.names(),
                resume=resume,
                **extra,
            )
        )
        hello_at = time.perf_counter()
        reader = asyncio.create_task(_read(ws, opts, state, inbox, device, hello_at))
        beat: asyncio.Task[None] | None = None
        try:
            # Heartbeats start with the welcome, not after the trainer is built (loading data and
            # compiling can outlast the daemon's heartbeat timeout).
            for event in (inbox.joined, inbox.welcomed):
                waiter = asyncio.create_task(event.wait())
                await asyncio.wait({reader, waiter}, return_when=asyncio.FIRST_COMPLETED)
                waiter.cancel()
                if reader.done():
                    reader.result()  # raises what ended it
                    raise ConnectionError("daemon closed the connection before welcome")
                if beat is None:
                    beat = asyncio.create_task(_heartbeats(ws, state.heartbeat_s))
            for push_id in sorted(state.unacked):  # what the last session left unanswered
                inbox.resent.add(push_id)
                await _send(ws, _restamped(state.unacked[push_id]), opts)
            if state.unacked:
                log.info("sent %d unanswered pushes again", len(state.unacked))
            sending: asyncio.Task[None] | None = None
            idle_from = time.perf_counter()
            while not opts.max_steps or state.steps < opts.max_steps:
                pipeline = bool(state.plan.pipeline)
                msg = await inbox.take(1 if pipeline else 0)
                if inbox.profile is not None:
                    spec, inbox.profile = inbox.profile, None
                    result = await _profile(msg, spec, opts, state)
                    rtt = await _link_rtt(ws, inbox, state.rtt_s)
                    result = link_profile(result, rtt, opts.emulation, state)
                    await ws.send_bytes(wire.encode("profile_result", 0, result=result))
                start = time.perf_counter()
                frame = await _compute(msg, opts, state, idle_s=start - idle_from)
                idle_from = time.perf_counter()
                if sending is not None:  # pushes leave in order
                    await sending
                inbox.in_flight += 1
                inbox.pushes.add(state.push_id)  # the push's request id
                state.keep_unacked(state.push_id, frame)
                ref = None
                if inbox.shm is not None:  # the push in shared memory, a reference on the socket
                    ref = inbox.shm.push_ref(frame, state.push_id, state.unacked)
                sending = asyncio.create_task(_send(ws, frame, opts, ref=ref))
                if not pipeline:  # the device waits while the push travels
                    await sending
            if sending is not None:
                await sending
            await ws.send_bytes(wire.encode("bye", 0, reason="max steps reached"))
        finally:
            for task in (beat, reader):
                if task is not None:
                    task.cancel()
                    with contextlib.suppress(asyncio.CancelledError, Exception):
                        await task
            if inbox.shm is not None:
                inbox.shm.close()
                inbox.shm = None


async def _read(
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
                await asyncio.to_thread(_welcome, msg, state, device, core)
                inbox.welcomed.set()
            elif msg.type == "profile":
                inbox.profile = dict(msg["spec"])
            elif msg.type == "plan":  # the whole plan, every time
                plan = Plan.from_wire(msg["plan"])
                if state.plan.pipeline and not plan.pipeline:
                    inbox.unpipeline()
                state.plan = plan
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
                        await new_params(state.stage_host, held, partial(_send, ws, opts=opts))
            elif msg.type in PIPELINE_TYPES:
                if state.stage_host is None and state.trainer is not None:
                    state.stage_host = StageHost(
                        state.model_setup, state.trainer.data, state.next_push_id
                    )
                if state.stage_host is not None:
                    was_staged, inbox.staged = inbox.staged, True  # no data-parallel step now
                    send = partial(_send, ws, opts=opts)
                    await handle(state.stage_host, msg, inbox.params, send)
                    if state.stage_host.assignment is None:  # dissolved (or never assigned)
                        if was_staged:  # a stage holds its blocks' slice: pull the whole set
                            inbox.params = None
                            await ws.send_bytes(wire.encode("pull", 0, have=None))
                        inbox.staged = False
                        inbox.in_flight = 0
                        inbox.changed.set()
            elif msg.type == "ack":
                state.unacked.pop(msg.id, None)
                inbox.answered(msg.id, msg["status"])
                if msg["status"] in ("dropped", "duplicate"):
                    log.info("push %d %s: %s", msg.id, msg["status"], msg.get("reason"))
            elif msg.type == "error":
                log.warning("daemon error %s: %s", msg["code"], msg["message"])
                if msg["code"] == "no_codec":
                    raise FatalError(msg["message"])
                if (
                    msg["code"] == "malformed"
                    and "features" in msg["message"]
                    and not state.plain_hello
                    and not inbox.joined.is_set()
                ):
                    # A daemon from before hello's ``features``: say hello again without them.
                    state.plain_hello = True
                    raise ConnectionError("the daemon takes no hello features; saying hello again")
                state.unacked.pop(msg.id, None)  # a refused push is not sent again
                if inbox.refused(msg.id) and inbox.rejected_in_a_row >= MAX_REFUSED:
                    # Leaving frees every barrier this worker holds; the operator sees why.
                    raise FatalError(
                        f"the daemon refused {MAX_REFUSED} pushes in a row; last: "
                        f"{msg['code']}: {msg['message']}"
                    )
        raise ConnectionError(f"daemon closed the connection (code {ws.close_code})")
    except BaseException as exc:
        inbox.closed = exc
        inbox.changed.set()
        raise


def _welcome(
    msg: wire.Message, state: WorkerState, device: jax.Device, core: Core | None = None
) -> None:
    """Take the welcome; the trainer reuses ``core`` (a prepared one) or the last trainer's core
    when they were built for the same model, data and settings."""
    state.worker_id = msg["worker_id"]
    state.model_setup = dict(msg["model"])
    state.secret = msg.get("secret")
    state.plan = Plan.from_wire(msg["plan"])
    state.heartbeat_s = float(msg["heartbeat_s"])
    key = repr((msg["model"], msg["dataset"], msg["shard"], msg["train"]))
    if state.trainer is None or state.trainer_key != key:
        reuse = core if core is not None or state.trainer is None else state.trainer.core
        state.trainer = Trainer(msg.body, device, reuse)
        state.trainer_key = key
    log.info(
        "joined as worker %d, plan %s%s",
        state.worker_id,
        state.plan.to_wire(),
        " (model prepared before the welcome)"
        if core is not None and state.trainer.core is core
        else "",
    )


async def _compute(msg: Held, opts: WorkerOptions, state: WorkerState, idle_s: float) -> Frame:
    """One step from a ``params`` message to an encoded ``push`` frame. ``idle_s`` is how long the
    device sat idle since its last step ended (waiting for parameters and for the last push).

    The push is packed as segments (:func:`hetd.protocol.wire.pack_parts`, byte for byte what
    :func:`hetd.protocol.wire.encode` gives): the update's bytes are not copied into a packer's
    buffer, so over shared memory they are copied once, into the ring, where a msgpack frame cost
    a copy into fresh pages first (at 5.8M parameters 18 ms of a step's ≈ 50 ms of CPU)."""
    if state.trainer is None:
        raise ConnectionError("params before welcome")
    params = msg.tensors
    plan = dataclasses.replace(
        state.plan, local_steps=local_steps_for(state.plan, state.local_step_s)
    )
    t0 = time.perf_counter()
    update = await asyncio.to_thread(state.trainer.step, params, plan)
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
    return wire.pack_parts(
        "push",
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


def frame_size(frame: Frame) -> int:
    """A push frame's size in bytes."""
    return len(frame) if isinstance(frame, bytes) else frame.nbytes


def _joined(frame: Frame) -> bytes:
    """A push frame as one ``bytes`` (one copy of :class:`hetd.protocol.wire.Parts`)."""
    return frame if isinstance(frame, bytes) else frame.join()


def _restamped(frame: Frame) -> bytes:
    """A kept push frame to send again: the same request id and update, without the ``sent_at``
    stamp (the daemon would take the time since the first send for the link's)."""
    data = _joined(frame)
    msg = wire.decode(data, max_size=len(data))
    fields = {k: v for k, v in msg.body.items() if k != "sent_at"}
    return wire.encode("push", msg.id, **fields)


async def _profile(
    msg: Held, spec: Mapping[str, Any], opts: WorkerOptions, state: WorkerState
) -> dict[str, float]:
    """The daemon's profile request: time a few steps, one encode, and the link (emulated)."""
    if state.trainer is None:
        raise ConnectionError("profile before welcome")
    trainer = state.trainer
    params = msg.tensors
    steps = max(1, min(20, int(spec.get("steps", 3))))
    plan = Plan(batch_size=int(spec.get("batch_size", 32)), local_steps=1)
    per_sample = []
    update = None
    for _ in range(steps):
        t0 = time.perf_counter()
        update = await asyncio.to_thread(trainer.step, params, plan)
        real = time.perf_counter() - t0
        emulated = opts.emulation.step_seconds(real, update.samples)
        per_sample.append(emulated / max(1, update.samples))
    assert update is not None  # steps >= 1
    t0 = time.perf_counter()
    encoded = codecs.encode_tree(update.tensors, codec_for(state.plan))
    compress_s = time.perf_counter() - t0
    nbytes = sum(len(t["data"]) for t in encoded.values())
    full = sum(4 * v.size for v in params.values())
    # The first step compiles: drop the slowest. Of the rest, the fastest: the host's load (other
    # workers compiling while this one joins) only ever makes a step look slower.
    kept = sorted(per_sample)[: max(1, len(per_sample) - 1)]
    state.profile_bytes = (nbytes, full)
    return {"sample_s": min(kept), "compress_s": compress_s}


PINGS = 5  # round trips timed for the profile's link (the fastest counts)
PONG_TIMEOUT_S = 0.5


async def _link_rtt(ws: aiohttp.ClientWebSocketResponse, inbox: Inbox, welcome_rtt: float) -> float:
    """The link's round trip: the fastest of :data:`PINGS` websocket pings (answered by the
    daemon's reader, no engine work in them) and the welcome's. The welcome alone read the
    daemon's join work and the host's load (2.5-35 ms on loopback at load 1, against 0.2 ms
    links), and adsp's first period, ``period_steps`` x (step + push + pull), grew with it."""
    best = welcome_rtt if welcome_rtt > 0 else float("inf")
    for i in range(PINGS):
        inbox.pong.clear()
        t0 = time.perf_counter()
        await ws.ping(b"hetd-rtt-%d" % i)
        try:
            await asyncio.wait_for(inbox.pong.wait(), PONG_TIMEOUT_S)
        except TimeoutError:
            break  # no pong (a proxy that eats them): what we have
        best = min(best, time.perf_counter() - t0)
    return 0.0 if best == float("inf") else best


def link_profile(
    result: Mapping[str, float], rtt_s: float, emulation: Emulation, state: WorkerState
) -> dict[str, float]:
    """The profile with its link times: half the round trip ``rtt_s`` plus the emulated link's
    time for one push (``nbytes``) and one parameter frame (``full``), the simulator's
    ``latency + bytes / bandwidth`` on an emulated link."""
    nbytes, full = state.profile_bytes
    half = rtt_s / 2
    return {
        **result,
        "push_s": half + emulation.transfer_seconds(nbytes),
        "pull_s": half + emulation.transfer_seconds(full),
    }


async def _send(
    ws: aiohttp.ClientWebSocketResponse,
    frame: Frame,
    opts: WorkerOptions,
    ref: bytes | None = None,
) -> None:
    """Send a push, first waiting out the emulated link's transfer time; over the frame cap, in
    ``chunk`` messages (the daemon joins them); ``ref``: its ``push_ref`` (the push itself is
    in shared memory)."""
    delay = opts.emulation.transfer_seconds(frame_size(frame))
    if delay:
        await asyncio.sleep(delay)
    if ref is not None:
        await ws.send_bytes(ref)
        return
    for piece in wire.chunks(_joined(frame), opts.max_frame_bytes):
        await ws.send_bytes(piece)


async def _heartbeats(ws: aiohttp.ClientWebSocketResponse, every_s: float) -> None:
    frame = wire.encode("heartbeat", 0)
    while not ws.closed:
        await asyncio.sleep(every_s)
        with contextlib.suppress(ConnectionError, RuntimeError):
            await ws.send_bytes(frame)
