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

import aiohttp
import jax

from hetd.codecs import registry as codecs
from hetd.protocol import wire
from hetd.protocol.messages import EMULATED_LINK
from workers.inbox import Inbox
from workers.loop import device_info
from workers.prepare import start_preparing
from workers.profiling import link_profile, link_rtt, profile
from workers.push import compute, heartbeats, restamped, send
from workers.receive import read
from workers.shm import wanted
from workers.state import FatalError, WorkerOptions, WorkerState

__all__ = ["FatalError", "Inbox", "WorkerOptions", "WorkerState", "run_worker"]

log = logging.getLogger("hetd.worker")


async def run_worker(opts: WorkerOptions) -> int:
    """Connect, train, reconnect; returns the number of pushes made."""
    state = WorkerState()
    failures = 0
    async with aiohttp.ClientSession() as http:
        while opts.max_steps == 0 or state.steps < opts.max_steps:
            if state.trainer is None and state.preparing is None:  # until one is built
                state.preparing = await start_preparing(
                    http, opts.url, opts.token, opts.ssl_context, opts.device, opts.task
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


async def _session(http: aiohttp.ClientSession, opts: WorkerOptions, state: WorkerState) -> None:
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
        if exc.status == 401:
            raise FatalError("the daemon refused our token (401): set HETD_WORKER_TOKEN") from None
        raise
    device = opts.device or jax.devices()[0]
    info = device_info(device)
    if opts.emulation.memory is not None:
        info["free_memory"] = opts.emulation.memory
    if opts.emulation.bandwidth is not None:  # on loopback it stands for a remote worker
        info[EMULATED_LINK] = opts.emulation.bandwidth
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
        reader = asyncio.create_task(read(ws, opts, state, inbox, device, hello_at))
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
                    beat = asyncio.create_task(heartbeats(ws, state.heartbeat_s))
            for push_id in sorted(state.unacked):  # what the last session left unanswered
                inbox.resent.add(push_id)
                await send(ws, restamped(state.unacked[push_id]), opts)
            if state.unacked:
                log.info("sent %d unanswered pushes again", len(state.unacked))
            sending: asyncio.Task[None] | None = None
            idle_from = time.perf_counter()
            while not opts.max_steps or state.steps < opts.max_steps:
                pipeline = bool(state.plan.pipeline)
                msg = await inbox.take(1 if pipeline else 0)
                if inbox.profile is not None:
                    spec, inbox.profile = inbox.profile, None
                    result = await profile(msg, spec, opts, state)
                    rtt = await link_rtt(ws, inbox, state.rtt_s)
                    result = link_profile(result, rtt, opts.emulation, state)
                    await ws.send_bytes(wire.encode("profile_result", 0, result=result))
                start = time.perf_counter()
                frame = await compute(msg, opts, state, idle_s=start - idle_from)
                idle_from = time.perf_counter()
                if sending is not None:  # pushes leave in order
                    await sending
                inbox.in_flight += 1
                inbox.pushes.add(state.push_id)  # the push's request id
                state.keep_unacked(state.push_id, frame)
                ref = None
                if inbox.shm is not None:  # the push in shared memory, a reference on the socket
                    ref = inbox.shm.push_ref(frame, state.push_id, state.unacked)
                sending = asyncio.create_task(send(ws, frame, opts, ref=ref))
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
