"""System benchmark: the real daemon against the physical limit, side by side (docs/benchmark.md).

Owns ``hetd bench --suite system``: it writes ``OUT/system.json`` (schema in :func:`check_system`)
and ``OUT/system.md``.

* **Throughput** — for each synthetic model size x codec x sender count, ``k`` no-compute senders
  (:mod:`hetd.bench.system_peers`, each in its own process) push a ready-made gradient to the real
  daemon (:class:`hetd.server.daemon.Daemon`, ASP, SGD) as fast as it releases them, over real websockets
  on loopback, and each receives the parameters back. Right after, the same ``k`` processes run the
  *limit*: a bare aiohttp websocket exchange of the same frame sizes
  (:class:`hetd.bench.system_limit.BareServer`). Both servers run in this process's event loop and
  both are counted on the server side over the same window length, so
  ``fraction_of_limit = updates_per_s / limit_updates_per_s`` is a ratio measured side by side.
* **Engine latency** — p50 / p99 of the time the engine takes per event (from taking a command off
  its queue to its replies being queued, awaited off-loop work included) with many connected
  workers, most idle (heartbeats only), a few pushing.
* **Start-up** — seconds from launching ``hetd serve`` and N ``hetd-worker`` processes to the first
  applied update (:func:`hetd.bench.system_limit.measure_startup`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import platform
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from hetd.bench.system_limit import BareServer, measure_startup
from hetd.bench.system_options import PARTS, add_options
from hetd.bench.system_peers import Job, PeerPool, Report, Shapes
from hetd.bench.system_pservers import (
    BACKENDS,
    HEADS,
    Served,
    Variant,
    pserver_cpu_s,
    start_served,
    state_dir,
    stop_served,
    variants,
)
from hetd.bench.system_targets import judge, targets_md
from hetd.core.rates import MB, LatencyRecorder
from hetd.protocol import shm, wire

if TYPE_CHECKING:  # JAX loads only where a daemon is built: spawned peers re-import this module
    from hetd.core.engine import Engine
    from hetd.server.daemon import Daemon

PARAMS: tuple[int, ...] = (200_000, 1_000_000, 10_000_000)
CODECS: tuple[str, ...] = ("none", "bf16", "int8")
SENDERS: tuple[int, ...] = (1, 4, 8)
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "1073741824", "MALLOC_TRIM_THRESHOLD_": "4294967296"}
ROUNDS = 2  # alternating hetd / limit windows per cell
VARIANT_ROUNDS = 4  # ... when several daemons (the pservers axis) share the cell's windows
BIG_PARAMS = 100_000_000  # the big-model rows (part "big")
BIG_CODECS: tuple[str, ...] = ("int8", "none")
BIG_SECONDS = 8.0  # their windows at least (an update of 100M parameters takes ~1 s here)
IDLE_PER_PROCESS = 128  # idle websockets one peer process holds in the latency run


@dataclass(frozen=True)
class SystemOptions:
    """What ``hetd bench --suite system`` takes; the defaults run the full grid in a few minutes."""

    out: Path
    params: tuple[int, ...] = PARAMS
    codecs: tuple[str, ...] = CODECS
    senders: tuple[int, ...] = SENDERS
    seconds: float = 2.0  # measured window of each hetd run and of each limit run
    warmup_s: float = 0.3  # exchanges before a window opens
    latency_workers: int = 256  # connected workers in the latency run (0: skip it)
    latency_pushers: int = 4  # of which pushing
    latency_params: int = 200_000
    latency_codec: str = "int8"
    latency_seconds: float = 4.0
    startup_workers: int = 4  # 0: skip the start-up run
    big_params: int = BIG_PARAMS  # the big-model rows (part "big"): one sender, int8 and none
    parts: tuple[str, ...] = PARTS
    quiet: bool = False
    # the senders' paths, each a row: "ws" (websocket frames) and "shm" (shared memory, which
    # the daemon offers same-host workers; --no-shm leaves it out)
    transports: tuple[str, ...] = ("ws", "shm")
    # the pservers axis: 1, the daemon alone (today's); S >= 2, a daemon with S pserver
    # processes, started by each of pserver_backends ("local", "ray")
    pservers: tuple[int, ...] = (1,)
    pserver_backends: tuple[str, ...] = ("local",)
    # what the daemon takes of each push at S >= 2: "whole" (it applies it too), "headers"
    pserver_heads: tuple[str, ...] = ("whole",)


def synthetic_shapes(n: int) -> Shapes:
    """A two-layer model of about ``n`` float32 parameters: one big kernel and three small
    tensors, so the per-tensor paths of the wire are exercised as an MLP's would be."""
    width, classes = 1000, 10
    rows = max(1, (n - width - width * classes - classes) // width)
    return (
        ("body/kernel", (rows, width)),
        ("body/bias", (width,)),
        ("head/kernel", (width, classes)),
        ("head/bias", (classes,)),
    )


def n_params(shapes: Shapes) -> int:
    """Scalar parameters of a model."""
    return sum(math.prod(shape) for _, shape in shapes)


def _frame_cap(n: int) -> int:
    """max_msg_size for a model: a float32 frame with room for its envelope."""
    return max(64 * 1024 * 1024, 4 * n + (1 << 20))


def make_daemon(
    shapes: Shapes,
    codec: str,
    servers: int = 1,
    backend: str = "local",
    state_dir: str = "",
    headers: bool = False,
) -> Daemon:
    """A real daemon (ASP, SGD) for a synthetic model, workers on a free loopback port;
    ``servers`` >= 2: with that many pserver processes started by ``backend`` ("local" or "ray"),
    their slices under ``state_dir`` (the daemon's state directory, no timed checkpoints);
    ``headers``: the daemon takes each push's header only, its pservers hold the parameters."""
    from hetd import config as config_mod
    from hetd.core.assemble import EngineSpec, Optimizers, assemble
    from hetd.core.entries import EngineConfig
    from hetd.core.ledger import LedgerStore
    from hetd.server.build import Head
    from hetd.server.daemon import Daemon

    cap = wire.DEFAULT_MAX_FRAME  # the default: bigger messages go in chunks
    cfg = config_mod.replace(
        config_mod.Config(),
        "server",
        host="127.0.0.1",
        port=0,
        admin_port=-1,
        max_frame_bytes=cap,
        heartbeat_s=2.0,
        heartbeat_timeout_s=60.0,
        open_workers=True,  # the senders carry no token (loopback only)
        # its hundreds of peers connect at once from one address: the flood caps would close
        # the connections still on their way to their first request
        max_pending=4096,
        max_pending_per_address=4096,
    )
    decisions = None
    if servers > 1:
        if not state_dir:
            raise ValueError("a daemon with pservers needs a state directory")
        from hetd.pserver.log import DecisionLog

        decisions = DecisionLog()
        cfg = config_mod.replace(cfg, "store", dir=state_dir, interval_s=0.0)
        cfg = config_mod.replace(
            cfg, "pservers", log=True, servers=servers, port=0, backend=backend, headers=headers
        )
    rng = np.random.default_rng(0)
    params = {p: rng.standard_normal(s, dtype=np.float32) * np.float32(0.01) for p, s in shapes}
    optimizers = Optimizers("sgd", 0.01)
    spec = EngineSpec(
        params=params,
        policy="asp",
        optimizers=optimizers,
        welcome={  # what a worker would build from; the no-compute senders ignore it
            "model": {"spec": "synthetic", "kwargs": {"params": n_params(shapes)}},
            "dataset": {"spec": "none", "kwargs": {}, "seed": 0},
            "train": {"worker_lr": 0.0, "seed": 0},
        },
        settings=EngineConfig(
            codec=codec, profile_steps=0, heartbeat_s=2.0, heartbeat_timeout_s=60.0
        ),
        store_type=LedgerStore if headers and decisions is not None else None,
    )
    head = Head(optimizers.specs()[0], params) if decisions is not None else None
    return Daemon(cfg, assemble(spec).engine(decisions=decisions), head)


class Tally(NamedTuple):
    """What a server did over measured windows (summed over rounds)."""

    seconds: float = 0.0
    updates: int = 0  # updates applied (hetd) or exchanges answered (limit)
    bytes_in: int = 0
    bytes_out: int = 0
    cpu_s: float = 0.0  # CPU of this process (every thread), s
    publishes: int = 0  # hetd: batches the engine published (updates / publishes: batch size)
    ps_cpu_s: float = 0.0  # CPU of the daemon's pserver processes, s (none: 0)
    rss_peak: int = 0  # bytes: this process's largest resident set seen in the window(s)

    def __add__(self, other: tuple[Any, ...]) -> Tally:
        sums = [a + b for a, b in zip(self[:-1], other[:-1], strict=True)]
        return Tally._make([*sums, max(self.rss_peak, other[-1])])  # a peak, not a sum

    def rates(self) -> dict[str, float]:
        """updates/s, MB/s in and out, and CPU ms per update."""
        dt = max(1e-9, self.seconds)
        return {
            "updates_per_s": self.updates / dt,
            "mb_in_per_s": self.bytes_in / dt / MB,
            "mb_out_per_s": self.bytes_out / dt / MB,
            "cpu_ms_per_update": self.cpu_s / max(1, self.updates) * 1e3,
            "updates_per_publish": self.updates / max(1, self.publishes),
            "ps_cpu_ms_per_update": self.ps_cpu_s / max(1, self.updates) * 1e3,
        }


async def _measure(
    counters: Any, seconds: float, other_cpu: Callable[[], float] = lambda: 0.0
) -> Tally:
    """Sample ``counters() -> (updates, bytes in, bytes out, publishes)`` around a window of
    ``seconds``; the wall and process CPU time (and ``other_cpu()``, other processes' CPU
    seconds) are read at the same moments."""
    s0 = other_cpu()
    t0, c0, (u0, i0, o0, p0) = time.monotonic(), time.process_time(), counters()
    peak = rss_bytes()
    end = t0 + seconds
    while (left := end - time.monotonic()) > 0:
        await asyncio.sleep(min(0.05, left))
        peak = max(peak, rss_bytes())
    t1, c1, (u1, i1, o1, p1) = time.monotonic(), time.process_time(), counters()
    return Tally(t1 - t0, u1 - u0, i1 - i0, o1 - o0, c1 - c0, p1 - p0, other_cpu() - s0, peak)


def rss_bytes() -> int:
    """This process's resident set now (Linux ``/proc``; 0 elsewhere)."""
    try:
        with open("/proc/self/statm") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def _engine_counters(engine: Engine) -> Any:
    return lambda: (
        engine.applier.updates_applied,
        engine.meters.bytes_in,
        engine.meters.bytes_out,
        engine.meters.publishes,
    )


async def _until(predicate: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


def _check_reports(reports: Sequence[Report], what: str) -> None:
    errors = [r.error for r in reports if r.error]
    if errors:
        raise RuntimeError(f"{what}: a peer failed: {errors[0]}")


async def hetd_cell(
    daemon: Daemon,
    pool: PeerPool,
    shapes: Shapes,
    codec: str,
    k: int,
    opts: SystemOptions,
    seconds: float | None = None,
    shm: bool = False,
) -> tuple[Tally, list[Report]]:
    """``k`` no-compute senders against the daemon: what it did over the window, their reports;
    ``shm``: the senders take the daemon's shared memory (an error if it was not used)."""
    engine = daemon.engine
    url = f"ws://127.0.0.1:{daemon.port}/v1/ws"
    cap, chunk = _frame_cap(n_params(shapes)), daemon.cfg.server.max_frame_bytes
    jobs = [
        Job("hetd", url, codec=codec, shapes=shapes, cap=cap, frame_cap=chunk, seed=i, shm=shm)
        for i in range(k)
    ]
    # (a big model: each sender first takes its full parameters, seconds per 100 MB here)
    await pool.start(jobs, timeout=60.0 + 3.0 * n_params(shapes) / 1e6)
    # Windows open once a step was published: the daemon compiles its steps in a thread while it
    # starts (seconds for 10M parameters under load), which is start-up, not throughput.
    await _until(
        lambda: any(f.version > 0 for f in engine.members.facts.values()), 300.0, "a first step"
    )
    await asyncio.sleep(opts.warmup_s)
    ps_cpu = partial(pserver_cpu_s, daemon)
    tally = await _measure(_engine_counters(engine), seconds or opts.seconds, ps_cpu)
    reports = await pool.stop(k)
    _check_reports(reports, f"hetd {n_params(shapes)} {codec} x{k}")
    if any(r.extra.get("shm") != shm for r in reports):
        raise RuntimeError(f"hetd {n_params(shapes)} {codec} x{k}: shared memory {shm} not kept")
    await _until(lambda: not engine.members.facts, 10.0, "the senders to leave")
    return tally, reports


async def limit_cell(
    server: BareServer,
    pool: PeerPool,
    k: int,
    push_bytes: int,
    replies: Sequence[int],
    cap: int,
    opts: SystemOptions,
    seconds: float | None = None,
) -> Tally:
    """``k`` bare clients exchanging frames of the hetd run's sizes: what the server did."""
    server.set_replies(replies)
    url = f"ws://127.0.0.1:{server.port}/bare"
    jobs = [Job("bare", url, push_bytes=push_bytes, replies=len(replies), cap=cap)] * k
    await pool.start(jobs)
    await asyncio.sleep(opts.warmup_s)
    tally = await _measure(
        lambda: (server.exchanges, server.bytes_in, server.bytes_out, 0), seconds or opts.seconds
    )
    _check_reports(await pool.stop(k), f"limit x{k}")
    return tally


async def startup_cold_and_warm(workers: int) -> dict[str, Any]:
    """Start-up twice against one fresh compilation cache: the first start compiles everything
    (cold), the second loads it (warm, what a restart or a re-run sees). The warm run is the
    record's ``seconds_to_first_update``; the cold one is reported beside it."""
    saved = os.environ.get("JAX_COMPILATION_CACHE_DIR")
    with tempfile.TemporaryDirectory(prefix="hetd-jax-cache-") as cache:
        os.environ["JAX_COMPILATION_CACHE_DIR"] = cache  # the launched processes inherit it
        try:
            cold = await measure_startup(workers)
            warm = await measure_startup(workers)
        finally:
            if saved is None:
                os.environ.pop("JAX_COMPILATION_CACHE_DIR", None)
            else:
                os.environ["JAX_COMPILATION_CACHE_DIR"] = saved
    return {
        **warm,
        "cold_seconds_to_first_update": cold["seconds_to_first_update"],
        "cold_seconds_to_listening": cold.get("seconds_to_listening"),
    }


def _say(opts: SystemOptions, text: str) -> None:
    if not opts.quiet:
        print(text, file=sys.stderr, flush=True)


async def run_throughput(pool: PeerPool, opts: SystemOptions) -> list[dict[str, Any]]:
    """The throughput grid; one record per (params, codec, senders)."""
    rows = []
    server = BareServer(_frame_cap(max(opts.params)))
    await server.start()
    try:
        for size in opts.params:
            shapes = synthetic_shapes(size)
            for codec in opts.codecs:
                async with _serving(shapes, codec, opts) as served:
                    for k in opts.senders:
                        rounds = ROUNDS if len(served) == 1 else VARIANT_ROUNDS
                        rows += await _one_cell(
                            served, server, pool, shapes, codec, k, opts, rounds
                        )
    finally:
        await server.stop()
    return rows


async def run_big(pool: PeerPool, opts: SystemOptions) -> list[dict[str, Any]]:
    """The big-model rows: ``big_params`` parameters, one sender, each of :data:`BIG_CODECS`; one
    hetd window then one limit window each (an exchange takes seconds), with the peak RSS. Run
    before the grid, so that the process's RSS holds little besides this daemon."""
    rows = []
    shapes = synthetic_shapes(opts.big_params)
    server = BareServer(_frame_cap(opts.big_params))
    await server.start()
    try:
        for codec in BIG_CODECS:
            async with _serving(shapes, codec, opts) as served:
                seconds = max(opts.seconds, BIG_SECONDS * min(1.0, opts.big_params / BIG_PARAMS))
                rows += await _one_cell(served, server, pool, shapes, codec, 1, opts, 1, seconds)
    finally:
        await server.stop()
    return rows


async def serve(shapes: Shapes, codec: str, v: Variant) -> Served:
    """A started daemon of variant ``v`` for the synthetic model, its pservers connected."""
    state = state_dir(v)
    daemon = make_daemon(shapes, codec, v.servers, v.backend, str(state or ""), v.headers)
    served = Served(v, daemon, state)
    await start_served(served)
    return served


@contextlib.asynccontextmanager
async def _serving(shapes: Shapes, codec: str, opts: SystemOptions) -> AsyncIterator[list[Served]]:
    """A started daemon per variant of the ``--pservers`` axis (all alive at once, so that their
    windows alternate), stopped at the end."""
    served: list[Served] = []
    try:
        for v in variants(opts.pservers, opts.pserver_backends, opts.pserver_heads):
            if v.servers > 1:
                _say(opts, f"  starting a daemon with {v.label()} pservers ...")
            served.append(await serve(shapes, codec, v))
        yield served
    finally:
        for one in reversed(served):
            await stop_served(one)


async def _one_cell(
    served: Sequence[Served],
    server: BareServer,
    pool: PeerPool,
    shapes: Shapes,
    codec: str,
    k: int,
    opts: SystemOptions,
    rounds: int = ROUNDS,
    seconds: float | None = None,
) -> list[dict[str, Any]]:
    # hetd (each transport, each variant of the pservers axis) and the limit alternate, ROUNDS
    # windows each, so that load from other processes (the machine is shared) falls on all
    # alike; the limit copies the first hetd window's sizes (a whole update's push, also where
    # it went as a header). The runs go in reverse order every other round: what a window leaves
    # behind (the kernel writing back a pserver's parts file) falls on the next one, and each
    # run then follows each other one as often. With pservers each window also starts once the
    # kernel has written back what the last one left (os.sync, outside the windows).
    window = (seconds or opts.seconds) / rounds
    cap = _frame_cap(n_params(shapes))  # the bare exchange sends every message whole
    runs = [(t, one) for t in opts.transports for one in served]
    tallies = {(t, one.variant): Tally() for t, one in runs}
    pushes_s: dict[tuple[str, Variant], list[float]] = {(t, one.variant): [] for t, one in runs}
    limit_tally = Tally()
    push, replies = 0, (0, 0)
    written = any(one.variant.servers > 1 for one in served)  # pservers write parts files
    for n in range(rounds):
        for transport, one in runs if n % 2 == 0 else runs[::-1]:
            if written:
                await asyncio.to_thread(os.sync)
            tally, reports = await hetd_cell(
                one.daemon, pool, shapes, codec, k, opts, window, shm=transport == "shm"
            )
            tallies[(transport, one.variant)] += tally
            for r in reports:
                pushes_s[(transport, one.variant)] += r.extra.get("push_s", [])
            if not push:
                push = max(r.update_bytes or r.push_frame_bytes for r in reports)
                frames = sum(r.params_frames for r in reports)
                params_bytes = round(sum(r.params_bytes for r in reports) / max(1, frames))
                replies = (max(r.ack_bytes for r in reports), params_bytes)
        limit_tally += await limit_cell(server, pool, k, push, replies, cap, opts, window)
    return [
        _row(
            (shapes, codec, k),
            (t, one.variant),
            tallies[(t, one.variant)],
            limit_tally,
            (push, replies[1]),
            pushes_s[(t, one.variant)],
            opts,
        )
        for t, one in runs
    ]


def _row(
    cell: tuple[Shapes, str, int],
    run: tuple[str, Variant],
    hetd_tally: Tally,
    limit_tally: Tally,
    frames: tuple[int, int],
    pushes_s: Sequence[float],
    opts: SystemOptions,
) -> dict[str, Any]:
    """One row: cell (shapes, codec, senders) x run (transport, pservers variant)."""
    (shapes, codec, k), (transport, variant) = cell, run
    got, limit = hetd_tally.rates(), limit_tally.rates()
    lat = np.asarray(pushes_s, dtype=np.float64) * 1e3
    row = {
        "params": n_params(shapes),
        "codec": codec,
        "workers": k,
        "transport": transport,
        "pservers": variant.servers,
        "pserver_backend": variant.backend,
        "pserver_headers": variant.headers,
        "updates_per_s": round(got["updates_per_s"], 2),
        "mb_in_per_s": round(got["mb_in_per_s"], 2),
        "mb_out_per_s": round(got["mb_out_per_s"], 2),
        "limit_updates_per_s": round(limit["updates_per_s"], 2),
        "fraction_of_limit": round(got["updates_per_s"] / max(1e-9, limit["updates_per_s"]), 3),
        "limit_mb_in_per_s": round(limit["mb_in_per_s"], 2),
        "limit_mb_out_per_s": round(limit["mb_out_per_s"], 2),
        "push_frame_bytes": frames[0],
        "params_frame_bytes": frames[1],
        "server_cpu_ms_per_update": round(got["cpu_ms_per_update"], 3),
        "limit_server_cpu_ms_per_update": round(limit["cpu_ms_per_update"], 3),
        "pserver_cpu_ms_per_update": round(got["ps_cpu_ms_per_update"], 3),
        "push_p50_ms": round(float(np.quantile(lat, 0.5)), 2) if lat.size else 0.0,
        "push_p90_ms": round(float(np.quantile(lat, 0.9)), 2) if lat.size else 0.0,
        "updates_per_publish": round(got["updates_per_publish"], 2),
        "rss_mb": round(hetd_tally.rss_peak / MB),
    }
    pservers = (
        ""
        if variant.servers == 1
        else f" + pservers {row['pserver_cpu_ms_per_update']:.2f} ms/update"
    )
    _say(
        opts,
        f"  {row['params']:>10,} {codec:<5} x{k} {transport:<3} S={variant.label():<7}: "
        f"{row['updates_per_s']:8.1f} updates/s, "
        f"limit {row['limit_updates_per_s']:8.1f} -> {row['fraction_of_limit']:.2f}; server CPU "
        f"{row['server_cpu_ms_per_update']:.2f} vs {row['limit_server_cpu_ms_per_update']:.2f} "
        f"ms/update{pservers}; push p50 {row['push_p50_ms']:.1f} ms; "
        f"{row['updates_per_publish']:.1f} updates/publish",
    )
    return row


async def run_latency(pool: PeerPool, opts: SystemOptions) -> dict[str, Any]:
    """Engine latency per event with ``latency_workers`` connected, ``latency_pushers`` pushing."""
    shapes = synthetic_shapes(opts.latency_params)
    daemon = make_daemon(shapes, opts.latency_codec)
    await daemon.start()
    engine = daemon.engine
    url = f"ws://127.0.0.1:{daemon.port}/v1/ws"
    cap = daemon.cfg.server.max_frame_bytes
    pushers = min(opts.latency_pushers, opts.latency_workers)
    idle = opts.latency_workers - pushers
    jobs = []
    for i in range(0, idle, IDLE_PER_PROCESS):
        count = min(IDLE_PER_PROCESS, idle - i)
        jobs.append(
            Job("idle", url, codec=opts.latency_codec, connections=count, cap=cap, seed=100 + i)
        )
    jobs += [
        Job("hetd", url, codec=opts.latency_codec, shapes=shapes, cap=cap, seed=i)
        for i in range(pushers)
    ]
    try:
        await pool.start(jobs, timeout=120.0)
        await asyncio.sleep(opts.warmup_s)
        connected = await engine.queue.call(lambda: len(engine.members.facts))
        recorders = (engine.meters.latency, engine.meters.publish_latency, engine.meters.wait)
        await engine.queue.call(partial(_reset, recorders))
        rates = (await _measure(_engine_counters(engine), opts.latency_seconds)).rates()
        decide, publish, wait = await engine.queue.call(lambda: [r.summary() for r in recorders])
        connected = min(connected, await engine.queue.call(lambda: len(engine.members.facts)))
        _check_reports(await pool.stop(len(jobs)), "latency run")
    finally:
        await daemon.stop(final_checkpoint=False)
    return {
        "connected": connected,
        "pushing": pushers,
        "params": n_params(shapes),
        "codec": opts.latency_codec,
        "events": decide["events"],
        "p50_ms": decide["p50_ms"],
        "p99_ms": decide["p99_ms"],
        "max_ms": decide["max_ms"],
        "publishes": publish["events"],
        "publish_p50_ms": publish["p50_ms"],
        "publish_p99_ms": publish["p99_ms"],
        "queue_wait_p50_ms": wait["p50_ms"],
        "queue_wait_p99_ms": wait["p99_ms"],
        "updates_per_s": round(rates["updates_per_s"], 2),
    }


def _reset(recorders: Sequence[LatencyRecorder]) -> None:
    for r in recorders:
        r.reset()


def _setup(opts: SystemOptions) -> dict[str, Any]:
    return {
        "machine": {"cores": os.cpu_count(), "python": platform.python_version()},
        "senders": "one OS process per sender (multiprocessing, spawn), each one websocket; the "
        "daemon and the bare limit server run in the benchmark's own process and event loop",
        "daemon": "hetd.server.daemon.Daemon, policy asp, optimizer sgd, no compute on the senders",
        "seconds_per_cell": opts.seconds,
        "rounds": ROUNDS
        if len(variants(opts.pservers, opts.pserver_backends)) == 1
        else VARIANT_ROUNDS,
        "malloc": {k: os.environ.get(k) for k in MALLOC_ENV},
    }


async def run_system(opts: SystemOptions) -> dict[str, Any]:
    """Run the parts asked for; the ``system.json`` document."""
    for key, value in MALLOC_ENV.items():  # inherited by the peer processes
        os.environ.setdefault(key, value)
    doc: dict[str, Any] = {"setup": _setup(opts), "throughput": []}
    need = max(
        [*opts.senders, 1] if "throughput" in opts.parts else [1],
    )
    if "latency" in opts.parts and opts.latency_workers:
        idle = opts.latency_workers - min(opts.latency_pushers, opts.latency_workers)
        need = max(need, opts.latency_pushers + -(-idle // IDLE_PER_PROCESS))
    pool = PeerPool(need)
    try:
        big = []
        if "big" in opts.parts:
            _say(opts, f"big model ({opts.big_params:,} params, 1 sender):")
            big = await run_big(pool, opts)
        if "throughput" in opts.parts or big:
            if "throughput" in opts.parts:
                _say(opts, "throughput (hetd vs the bare websocket limit):")
            grid = await run_throughput(pool, opts) if "throughput" in opts.parts else []
            doc["throughput"] = grid + big
            verdicts = judge(doc["throughput"])
            if verdicts:
                doc["targets"] = verdicts
        if "latency" in opts.parts and opts.latency_workers:
            _say(opts, f"engine latency with {opts.latency_workers} connected workers ...")
            doc["engine_latency"] = await run_latency(pool, opts)
    finally:
        pool.close()
    if "startup" in opts.parts and opts.startup_workers:
        _say(opts, f"start-up with {opts.startup_workers} workers ...")
        doc["startup"] = await startup_cold_and_warm(opts.startup_workers)
    return doc


# --- the document ----------------------------------------------------------------------------------

_NUM = (int, float)
ROW_KEYS: dict[str, tuple[type, ...]] = {
    "params": (int,),
    "codec": (str,),
    "workers": (int,),
    "updates_per_s": _NUM,
    "mb_in_per_s": _NUM,
    "mb_out_per_s": _NUM,
    "limit_updates_per_s": _NUM,
    "fraction_of_limit": _NUM,
}
ROW_EXTRA = (
    "limit_mb_in_per_s",
    "limit_mb_out_per_s",
    "push_frame_bytes",
    "params_frame_bytes",
    "server_cpu_ms_per_update",
    "limit_server_cpu_ms_per_update",
    "updates_per_publish",
    "rss_mb",
    "transport",  # "ws" or "shm" (rows from before it: ws)
    "pservers",  # S: 1, the daemon alone (rows from before it: 1)
    "pserver_backend",  # "none" at S = 1, else "local" or "ray"
    "pserver_headers",  # the daemon took headers only (rows from before it: false)
    "pserver_cpu_ms_per_update",  # the pserver processes' CPU per update (S = 1: 0)
    "push_p50_ms",  # a sender's push to its ack
    "push_p90_ms",
)
LATENCY_KEYS: dict[str, tuple[type, ...]] = {"connected": (int,), "p50_ms": _NUM, "p99_ms": _NUM}
STARTUP_KEYS: dict[str, tuple[type, ...]] = {"workers": (int,), "seconds_to_first_update": _NUM}


def _check_record(rec: Any, keys: dict[str, tuple[type, ...]], where: str) -> None:
    if not isinstance(rec, dict):
        raise ValueError(f"{where} must be an object")
    for key, types in keys.items():
        if key not in rec:
            raise ValueError(f"{where} lacks {key!r}")
        value = rec[key]
        if isinstance(value, bool) or not isinstance(value, types):
            raise ValueError(f"{where}.{key} must be {types[0].__name__}, got {value!r}")
        if isinstance(value, int | float) and not (math.isfinite(value) and value >= 0):
            raise ValueError(f"{where}.{key} must be finite and >= 0, got {value!r}")


def check_system(doc: Any) -> None:
    """Raise ValueError naming the first place where ``doc`` breaks the ``system.json`` schema:
    ``throughput`` (a list of records with :data:`ROW_KEYS`, optionally :data:`ROW_EXTRA`),
    ``engine_latency`` (:data:`LATENCY_KEYS`) and ``startup`` (:data:`STARTUP_KEYS`) when those
    parts ran, and ``setup``."""
    if not isinstance(doc, dict):
        raise ValueError("system.json must be an object")
    allowed = {"setup", "throughput", "engine_latency", "startup", "targets"}
    unknown = sorted(set(doc) - allowed)
    if unknown or "throughput" not in doc or "setup" not in doc:
        raise ValueError(f"system.json keys must be {sorted(allowed)} (throughput, setup required)")
    if not isinstance(doc["throughput"], list):
        raise ValueError("throughput must be a list")
    for i, row in enumerate(doc["throughput"]):
        _check_record(row, ROW_KEYS, f"throughput[{i}]")
        extra = sorted(set(row) - set(ROW_KEYS) - set(ROW_EXTRA))
        if extra:
            raise ValueError(f"throughput[{i}] has unknown keys {extra}")
        if row["codec"] not in CODECS or row["params"] <= 0 or row["workers"] <= 0:
            raise ValueError(f"throughput[{i}]: bad codec, params or workers")
        servers = row.get("pservers", 1)
        if isinstance(servers, bool) or not isinstance(servers, int) or servers < 1:
            raise ValueError(f"throughput[{i}].pservers must be an int >= 1, got {servers!r}")
    if "engine_latency" in doc:
        _check_record(doc["engine_latency"], LATENCY_KEYS, "engine_latency")
    if "startup" in doc:
        _check_record(doc["startup"], STARTUP_KEYS, "startup")


def system_md(doc: dict[str, Any]) -> str:
    """``system.md``: the tables a person reads."""
    setup = doc["setup"]
    lines = [
        "# hetd system benchmark",
        "",
        f"Machine: {setup['machine']['cores']} cores, Python {setup['machine']['python']}. "
        f"Senders: {setup['senders']}. Daemon: {setup['daemon']}. Per cell, hetd and the limit "
        f"alternate ({setup['rounds']} windows each, {setup['seconds_per_cell']:g} s in all for "
        "each) with the same processes and frame sizes: a bare aiohttp websocket exchange (push-sized frame up; ack- and params-sized "
        "frames down), no hetd code on the path. Both are counted on the server side. "
        "On 2 cores the senders share the CPU with the server, in both runs alike.",
        "",
    ]
    if doc["throughput"]:
        lines += [
            "| params | codec | senders | path | S | updates/s | MB/s in | MB/s out "
            "| limit updates/s | fraction of limit | push frame | params frame "
            "| CPU ms/update (bare) | pservers' CPU ms/update | push p50 ms | updates/publish "
            "| RSS |",
            "|---:|---|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for r in doc["throughput"]:
            cpu = r.get("server_cpu_ms_per_update")
            bare = r.get("limit_server_cpu_ms_per_update")
            rss = r.get("rss_mb")
            servers = r.get("pservers", 1)
            variant = "1" if servers == 1 else f"{servers} {r.get('pserver_backend', '')}"
            variant += " headers" if r.get("pserver_headers") else ""
            ps_cpu = r.get("pserver_cpu_ms_per_update") if servers > 1 else None
            lines.append(
                f"| {r['params']:,} | {r['codec']} | {r['workers']} | {r.get('transport', 'ws')} "
                f"| {variant} | {r['updates_per_s']:.1f} "
                f"| {r['mb_in_per_s']:.1f} | {r['mb_out_per_s']:.1f} "
                f"| {r['limit_updates_per_s']:.1f} | {r['fraction_of_limit']:.2f} "
                f"| {r.get('push_frame_bytes', 0):,} B | {r.get('params_frame_bytes', 0):,} B "
                f"| {'' if cpu is None else f'{cpu:.2f}'} ({'' if bare is None else f'{bare:.2f}'}) "
                f"| {'' if ps_cpu is None else f'{ps_cpu:.2f}'} | {r.get('push_p50_ms', '')} "
                f"| {r.get('updates_per_publish', '')} | {'' if rss is None else f'{rss:,} MB'} |"
            )
        lines.append("")
    lines += targets_md(doc.get("targets", []))
    lat = doc.get("engine_latency")
    if lat:
        lines += [
            f"Engine latency per event, {lat['connected']} connected workers "
            f"({lat.get('pushing', '?')} pushing {lat.get('params', 0):,} params in "
            f"{lat.get('codec', '?')}, the rest idle with heartbeats): deciding an event (policy, "
            f"bookkeeping, acks queued) p50 {lat['p50_ms']} ms, p99 {lat['p99_ms']} ms, max "
            f"{lat.get('max_ms')} ms over {lat.get('events', 0)} events. Publishing (the queued "
            "optimizer steps, the snapshot and the parameter frames of every worker released by "
            f"a batch of events, off the loop while the engine awaits it): p50 "
            f"{lat.get('publish_p50_ms')} ms, p99 {lat.get('publish_p99_ms')} ms over "
            f"{lat.get('publishes', 0)} publishes. Queue wait before an event is taken: p50 "
            f"{lat.get('queue_wait_p50_ms')} ms, p99 {lat.get('queue_wait_p99_ms')} ms.",
            "",
        ]
    st = doc.get("startup")
    if st:
        lines += [
            f"Start-up: daemon + {st['workers']} local hetd-worker processes launched together, "
            f"first applied update after {st['seconds_to_first_update']} s (daemon listening after "
            f"{st.get('seconds_to_listening')} s), with JAX's compilation cache as a restart finds "
            f"it; on a first start (empty cache: JAX import and every compilation) "
            f"{st.get('cold_seconds_to_first_update')} s (listening after "
            f"{st.get('cold_seconds_to_listening')} s).",
            "",
        ]
    return "\n".join(lines)


def write_outputs(out: Path, doc: dict[str, Any]) -> None:
    """``OUT/system.json`` (checked) and ``OUT/system.md``."""
    check_system(doc)
    out.mkdir(parents=True, exist_ok=True)
    (out / "system.json").write_text(json.dumps(doc, indent=2) + "\n")
    (out / "system.md").write_text(system_md(doc))


# --- command line ----------------------------------------------------------------------------------


def _ints(text: str, what: str) -> tuple[int, ...]:
    try:
        values = tuple(int(float(x)) for x in text.split(",") if x.strip())
    except ValueError:
        raise ValueError(f"{what} must be comma-separated numbers, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise ValueError(f"{what} must be positive, got {text!r}")
    return values


def options_from(args: argparse.Namespace) -> SystemOptions:
    """Validated options from parsed arguments."""
    codecs = tuple(c.strip() for c in (args.codecs or ",".join(CODECS)).split(",") if c.strip())
    bad = sorted(set(codecs) - set(CODECS))
    if bad:
        raise ValueError(f"--codecs: unknown {bad}; choose from {', '.join(CODECS)}")
    parts = tuple(x.strip() for x in args.parts.split(",") if x.strip())
    if not parts or set(parts) - set(PARTS):
        raise ValueError(f"--parts must name some of {', '.join(PARTS)}, got {args.parts!r}")
    if not args.seconds > 0:
        raise ValueError(f"--seconds must be > 0, got {args.seconds}")
    if args.latency_workers < 0 or args.startup_workers < 0:
        raise ValueError("--latency-workers and --startup-workers must be >= 0")
    return SystemOptions(
        out=Path(args.out),
        params=_ints(args.params, "--params") if args.params else PARAMS,
        codecs=codecs,
        senders=_ints(args.senders, "--senders") if args.senders else SENDERS,
        seconds=args.seconds,
        latency_workers=args.latency_workers,
        latency_seconds=max(1.0, 2 * args.seconds),
        startup_workers=args.startup_workers,
        big_params=_ints(args.big_params, "--big-params")[0] if args.big_params else BIG_PARAMS,
        parts=parts,
        quiet=getattr(args, "quiet", False),
        transports=("ws",)
        if getattr(args, "no_shm", False) or not shm.available()
        else ("ws", "shm"),
        pservers=_ints(args.pservers, "--pservers") if getattr(args, "pservers", None) else (1,),
        pserver_backends=_backends(getattr(args, "pserver_backends", None) or "local"),
        pserver_heads=_heads(getattr(args, "pserver_heads", None) or "whole"),
    )


def _backends(text: str) -> tuple[str, ...]:
    names = tuple(b.strip() for b in text.split(",") if b.strip())
    if not names or set(names) - set(BACKENDS):
        raise ValueError(
            f"--pserver-backends must name some of {', '.join(BACKENDS)}, got {text!r}"
        )
    return names


def _heads(text: str) -> tuple[str, ...]:
    names = tuple(h.strip() for h in text.split(",") if h.strip())
    if not names or set(names) - set(HEADS):
        raise ValueError(f"--pserver-heads must name some of {', '.join(HEADS)}, got {text!r}")
    return names


def run_main(opts: SystemOptions) -> int:
    """Run, write, print a summary; the exit code."""
    t0 = time.monotonic()
    doc = asyncio.run(run_system(opts))
    write_outputs(opts.out, doc)
    print(
        f"system benchmark in {time.monotonic() - t0:.0f} s; wrote {opts.out}/system.json, system.md"
    )
    print(system_md(doc))
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m hetd.bench.system --out DIR [options]``."""
    p = argparse.ArgumentParser(prog="python -m hetd.bench.system", description=__doc__)
    p.add_argument("--out", default="bench-out", help="output directory (default bench-out)")
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    add_options(p)
    try:
        opts = options_from(p.parse_args(argv))
    except ValueError as exc:
        print(f"hetd bench: {exc}", file=sys.stderr)
        return 2
    return run_main(opts)


if __name__ == "__main__":
    sys.exit(main())
