"""The worker's connection: hello/welcome, then params -> compute -> push, heartbeats beside it;
reconnects with backoff when the daemon goes away and resumes as the same worker.

The receive side is :mod:`workers.receive`, the push side :mod:`workers.push`, the profile
:mod:`workers.profiling`, what survives a reconnect :mod:`workers.state`."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import Mapping
from typing import Any

import aiohttp
import jax

from hetd.codecs import registry as codecs
from hetd.protocol import wire
from hetd.protocol.endpoints import ADMIN_ENDPOINT, ADMIN_REALM, ENDPOINT_HEADER
from hetd.protocol.frames import Hello, ProfileResult
from hetd.protocol.messages import EMULATED_LINK, Bye
from hetd.protocol.plan import local_steps_for
from workers.dial import plain_port_message, tls_port_message
from workers.emulate import Emulation
from workers.errors import FatalError
from workers.inbox import Inbox, Stopped
from workers.loop import device_info
from workers.prepare import start_preparing
from workers.profiling import link_profile, link_rtt, profile
from workers.progress import Progress
from workers.push import compute, frame_size, heartbeats, joined, restamped, send
from workers.receive import read
from workers.shm import wanted
from workers.state import HELLO_ID, WorkerOptions, WorkerState

__all__ = ["FatalError", "Inbox", "WorkerOptions", "WorkerState", "run_worker"]

log = logging.getLogger("hetd.worker")

MAX_REASON = 500  # characters of a bye's reason (a traceback's last line, not all of it)
STOP_GRACE_S = 10.0  # s a stopping worker may take to finish its step, send it and say bye
STOPPED = "stopped (SIGTERM)"  # the bye's reason when asked to stop
BYE_WAIT_S = 5.0  # s a leaving worker waits for the daemon's close after its bye
LAST_BYE_S = 3.0  # ... and one cancelled while stopping (past its grace, or before it trained)
WAITING_FOR_CLOSE = "waiting for the daemon to close"  # logged after the bye


async def run_worker(
    opts: WorkerOptions, progress_s: float = 30.0, stop: asyncio.Event | None = None
) -> int:
    """Connect, train, reconnect; returns the number of pushes made. A progress line is logged
    every ``progress_s`` seconds (:mod:`workers.progress`; 0: none).

    ``stop`` set (``hetd-worker`` sets it on SIGTERM): a worker in its training loop starts no
    more steps, sends the push it is computing, says ``bye`` and returns, so the daemon hears at
    once that it left and loses nothing it computed; one that is not training yet (connecting,
    building its model) is cancelled at once, as is one that takes over ``STOP_GRACE_S``."""
    state = WorkerState()
    progress = Progress(opts.url)
    ticker = asyncio.create_task(progress.run(progress_s), name="hetd-worker-progress")
    main = asyncio.current_task()
    stopper = None
    if stop is not None and main is not None:
        stopper = asyncio.create_task(_stop_on(stop, state, main), name="hetd-worker-stop")
    try:
        return await _run(opts, state, progress)
    finally:
        if state.parts is not None:
            await state.parts.close()
        if state.pulls is not None:
            log.info(
                "releases pulled from the pservers: %d (%d no longer held, asked again)",
                state.pulls.pulled,
                state.pulls.gone,
            )
            state.pulls.close()
        for task in (ticker, stopper):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task


async def _stop_on(stop: asyncio.Event, state: WorkerState, main: asyncio.Task[Any]) -> None:
    """When ``stop`` is set: stop the training loop (``state.inbox``) and give it
    ``STOP_GRACE_S``; cancel ``main`` when there is none, or past the grace."""
    await stop.wait()
    state.stopping = True
    if state.inbox is not None:
        state.inbox.stop()
        await asyncio.sleep(STOP_GRACE_S)
    main.cancel()


async def _run(opts: WorkerOptions, state: WorkerState, progress: Progress) -> int:
    failures = 0
    async with aiohttp.ClientSession() as http:
        while (opts.max_steps == 0 or state.steps < opts.max_steps) and not state.stopping:
            if state.trainer is None and state.preparing is None:  # until one is built
                state.preparing = await start_preparing(
                    http,
                    opts.url,
                    opts.token,
                    opts.ssl_context,
                    opts.device,
                    opts.task,
                    opts.allowed,
                )
            if state.worker_id is None:  # a scenario's joiner connects at its time
                await _until_join(opts.emulation)
            try:
                await _session(http, opts, state, progress)
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


async def _until_join(emulation: Emulation) -> None:
    """Wait for ``emulation``'s join time (``--emulate-join-at``), while the trainer is built."""
    while (left := emulation.join_wait_s()) is None or left > 0:
        await asyncio.sleep(0.05 if left is None else min(left, 0.5))


def handshake_refusal(
    url: str, status: int, headers: Mapping[str, str] | None, sent_token: bool
) -> str | None:
    """Why a refused websocket handshake will not get better by retrying, for the operator; None
    when it may (a daemon restarting, a proxy in between)."""
    headers = headers or {}
    endpoint = headers.get(ENDPOINT_HEADER)
    if endpoint == ADMIN_ENDPOINT or ADMIN_REALM in headers.get("WWW-Authenticate", ""):
        return (
            f"{url} is the daemon's admin API (and dashboard), not its worker endpoint: point "
            "hetd-worker at the worker port, [server] port (7070 unless configured), e.g. "
            "ws://HEAD:7070"
        )
    if status != 401:
        return None
    if not sent_token:
        return (
            "the daemon requires a worker token and this worker has none (401): set "
            "HETD_WORKER_TOKEN (or [worker] token in --config) to the daemon's worker token"
        )
    return (
        "the daemon refused our worker token (401): the token in HETD_WORKER_TOKEN (or [worker] "
        "token in --config) is not the daemon's [server] worker_token"
    )


async def _session(
    http: aiohttp.ClientSession, opts: WorkerOptions, state: WorkerState, progress: Progress
) -> None:
    headers = {"Authorization": f"Bearer {opts.token}"} if opts.token else {}
    try:
        ws = await http.ws_connect(
            opts.url.rstrip("/") + "/v1/ws",
            headers=headers,
            max_msg_size=opts.max_frame_bytes,
            compress=0,
            autoping=False,  # _read answers pings and times our own (link_rtt)
            ssl=opts.ssl_context if opts.ssl_context is not None else True,
        )
    except aiohttp.ClientConnectorCertificateError as exc:  # retrying will not help
        raise FatalError(
            f"the daemon's TLS certificate was not accepted: {exc.certificate_error} "
            "(pass --ca FILE with the CA that signed it)"
        ) from None
    except aiohttp.WSServerHandshakeError as exc:
        refused = handshake_refusal(opts.url, exc.status, exc.headers, bool(opts.token))
        if refused is not None:  # retrying will not help
            raise FatalError(refused) from None
        raise
    except aiohttp.ClientError as exc:  # a URL of the wrong scheme for the port: say which
        wrong = plain_port_message(opts.url, exc) or await tls_port_message(opts.url, exc)
        if wrong is not None:
            raise FatalError(wrong) from None
        raise
    device = opts.device or jax.devices()[0]
    info = device_info(device)
    if opts.emulation.memory is not None:
        info["free_memory"] = opts.emulation.memory
    if opts.emulation.bandwidth is not None:  # on loopback it stands for a remote worker
        info[EMULATED_LINK] = opts.emulation.bandwidth
    inbox = Inbox()
    async with ws:
        await _converse(ws, opts, state, device, info, inbox, progress)


async def _answered(state: WorkerState, timeout_s: float) -> None:
    """Wait (at most ``timeout_s``) until the daemon answered every push sent."""
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(timeout_s):
            while state.unacked:
                await asyncio.sleep(0.02)


async def _leave(ws: aiohttp.ClientWebSocketResponse, reason: str, timeout_s: float) -> None:
    """Say bye with ``reason``, then close the websocket with its closing handshake, within
    ``timeout_s`` (past it, or on a socket that cannot take the bye, it is closed without).

    The daemon closes a session once it has read its bye, so the worker keeps its connection
    until the daemon's close comes. Closed at once, it could lose the bye and the push before it:
    a daemon that had not read them yet (a busy loop) and wrote to the worker (new parameters)
    found the connection gone, and asyncio ends a connection that fails a write without reading
    what is still in its buffer; the daemon heard a crash. The reader task must still be running
    (or have ended by itself): cancelling it inside aiohttp's ``receive()`` marks the socket
    closed abnormally, and aiohttp's close then drops the connection without the handshake."""
    with contextlib.suppress(Exception):
        async with asyncio.timeout(timeout_s):
            await ws.send_bytes(Bye(reason).encode())
            log.info("said bye (%s); %s", reason, WAITING_FOR_CLOSE)
            await ws.close()
            log.debug("the daemon closed (code %s)", ws.close_code)


def leaving_reason(exc: BaseException) -> str:
    """The ``bye`` reason of a worker that gives up: what it will print itself (a plug-in that
    does not import here, a task that is not the daemon's, too many refused pushes)."""
    text = str(exc) if isinstance(exc, FatalError) else f"{type(exc).__name__}: {exc}"
    return f"worker error: {text}"[:MAX_REASON]


async def _converse(
    ws: aiohttp.ClientWebSocketResponse,
    opts: WorkerOptions,
    state: WorkerState,
    device: jax.Device,
    info: dict[str, Any],
    inbox: Inbox,
    progress: Progress,
) -> None:
    """One session's conversation: hello, welcome, then steps and pushes until it ends."""
    resume = (
        {"worker_id": state.worker_id, "secret": state.secret}
        if state.worker_id is not None
        else None
    )
    features = (*wire.WORKER_FEATURES, *wanted(opts.shm))
    hello = Hello(HELLO_ID, opts.name, info, tuple(codecs.names()), features, resume)
    await ws.send_bytes(hello.encode())
    hello_at = time.perf_counter()
    reader = asyncio.create_task(read(ws, opts, state, inbox, device, hello_at))
    beat: asyncio.Task[None] | None = None
    left = False  # said bye (the reader runs until the daemon's close: _leave)
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
                beat = asyncio.create_task(heartbeats(ws, state.heartbeat_s))
        shard = getattr(state.trainer, "shard", None)
        progress.joined(state.worker_id, opts.name, shard)
        for push_id in sorted(state.unacked):  # what the last session left unanswered
            inbox.resent.add(push_id)
            await send(ws, restamped(state.unacked[push_id]), opts)
        if state.unacked:
            log.info("sent %d unanswered pushes again", len(state.unacked))
        sending: asyncio.Task[None] | None = None
        idle_from = time.perf_counter()
        state.inbox = inbox  # from here a stop ends the loop, not the task (run_worker)
        if state.stopping:
            inbox.stop()
        while not opts.max_steps or state.steps < opts.max_steps:
            pipeline = bool(state.plan.pipeline)
            try:
                msg = await inbox.take(1 if pipeline else 0)
            except Stopped:
                break
            plan = state.plan
            progress.took(msg.version, plan, "shared memory" if inbox.shm else "websocket")
            if inbox.profile is not None:
                spec, inbox.profile = inbox.profile, None
                result = await profile(msg, spec, opts, state)
                rtt = await link_rtt(ws, inbox, state.rtt_s)
                result = link_profile(result, rtt, opts.emulation, state)
                await ws.send_bytes(ProfileResult(result).encode())
            start = time.perf_counter()
            frame = await compute(msg, opts, state, idle_s=start - idle_from)
            size = frame_size(frame)  # (what the emulated link carries: the whole update)
            if state.parts is not None and state.worker_id is not None:  # beside the push
                header = await state.parts.send(state.worker_id, joined(frame))
                if header is not None:  # the daemon takes the header, the pservers the rest
                    frame = header
            steps = local_steps_for(plan, state.local_step_s)
            progress.pushed(plan.batch_size * steps, plan.batch_size)
            idle_from = time.perf_counter()
            if sending is not None:  # pushes leave in order
                await sending
            inbox.in_flight += 1
            inbox.pushes.add(state.push_id)  # the push's request id
            state.keep_unacked(state.push_id, frame)
            ref = None
            if inbox.shm is not None:  # the push in shared memory, a reference on the socket
                ref = inbox.shm.push_ref(frame, state.push_id, state.unacked)
            sending = asyncio.create_task(send(ws, frame, opts, ref=ref, size=size))
            if not pipeline:  # the device waits while the push travels
                await sending
        if sending is not None:
            await sending
        if state.parts is not None:  # the daemon decides a push once its parts are all in:
            await state.parts.drain(STOP_GRACE_S)  # leaving first would lose the last ones
            await _answered(state, STOP_GRACE_S)
        left = True
        await _leave(ws, STOPPED if inbox.stopping else "max steps reached", BYE_WAIT_S)
    except asyncio.CancelledError:
        if state.stopping and not left:  # stopped past its grace (a step that outlasted it, or
            left = True  # before it trained): the daemon still hears why it left
            await _leave(ws, STOPPED, LAST_BYE_S)
        raise
    except (TimeoutError, aiohttp.ClientError, ConnectionError):
        raise  # retried: the worker comes back
    except Exception as exc:  # the worker leaves for good: the daemon logs why
        if not left:
            left = True
            await _leave(ws, leaving_reason(exc), BYE_WAIT_S)
        raise
    finally:
        state.inbox = None
        for task in (beat, reader):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
        if inbox.shm is not None:
            inbox.shm.close()
            inbox.shm = None
