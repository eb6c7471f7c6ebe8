"""The daemon's profile request: a few timed steps, one encode, and the link's round trip."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping

import aiohttp

from hetd.codecs import registry as codecs
from hetd.protocol.messages import ProfileRequest
from hetd.protocol.params import Held
from hetd.protocol.plan import Plan, codec_for
from hetd.zoo.task import TaskError
from workers.emulate import Emulation
from workers.errors import FatalError
from workers.inbox import Inbox
from workers.state import WorkerOptions, WorkerState


async def profile(
    msg: Held, asked: ProfileRequest, opts: WorkerOptions, state: WorkerState
) -> dict[str, float]:
    """The daemon's profile request: time a few steps, one encode, and the link (emulated)."""
    if state.trainer is None:
        raise ConnectionError("profile before welcome")
    trainer = state.trainer
    opts.emulation.check_whole_step(trainer.bound.layout.shapes, trainer.core.micro_batch)
    params = msg.tensors
    steps = max(1, min(20, asked.steps or 3))  # (0: the daemon named none)
    plan = Plan(batch_size=asked.batch_size or 32, local_steps=1)
    per_sample = []
    update = None
    for _ in range(steps):
        t0 = time.perf_counter()
        try:
            update = await asyncio.to_thread(trainer.step, params, plan)
        except TaskError as exc:  # the task's data or loss is wrong: retrying will not help
            raise FatalError(str(exc)) from None
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


async def link_rtt(ws: aiohttp.ClientWebSocketResponse, inbox: Inbox, welcome_rtt: float) -> float:
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
