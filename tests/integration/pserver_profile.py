"""Where the head's time goes with and without pservers, sampled (not a test: run it by hand).

    PYTHONPATH=. .venv/bin/python tests/integration/pserver_profile.py [PARAMS] [SENDERS] [SECONDS] [S,...]

(an S followed by ``h``, e.g. ``2h``: behind a head of headers, ``[pservers] headers = true``)

For each S (default ``1,2``; 1 is the daemon alone), one system-bench cell (int8, SENDERS
no-compute senders over the websocket, default 4, for SECONDS, default 10, on a synthetic model
of PARAMS parameters, default 32e6, S >= 2 with local pservers) while ``py-spy`` (``pip install
py-spy``) samples every busy thread of the head (this process) and of each pserver process,
RATE times a second. A sample is charged to the innermost frame of its stack that names one of
:data:`STAGES` (C work, numpy's or the kernel's, is charged to the Python frame that called it).
Prints one JSON line per S: updates/s, the head's and the pservers' CPU ms per update, and per
process and stage the busy ms per update (samples x 10 ms / updates in the window).
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter
from functools import partial
from pathlib import Path

from hetd.bench import system as bench
from hetd.bench.system_peers import Job, PeerPool
from hetd.bench.system_pservers import Variant, pserver_cpu_s, stop_served

RATE = 100  # py-spy samples per second
# (file fragment) -> stage; the first match from the innermost frame out wins
STAGES: tuple[tuple[str, str], ...] = (
    ("pserver/disk.py", "pserver: parts file (write, fsync)"),
    ("pserver/commit.py", "pserver: parts file (group fsync, its thread)"),
    ("pserver/slice.py", "pserver: slice (apply, step)"),
    ("pserver/node.py", "pserver: node"),
    ("pserver/link.py", "pserver: link frames"),
    ("protocol/pslink.py", "pserver: link frames"),
    ("server/pserver_proc.py", "pserver: process (parts in, haves out)"),
    ("core/store.py", "store (optimizer step, snapshot)"),
    ("core/applier.py", "applier"),
    ("core/downlink.py", "downlink (params frames)"),
    ("core/publish.py", "publish"),
    ("core/ingest.py", "decode push"),
    ("/codecs/", "codec decode"),
    ("protocol/params.py", "params frame"),
    ("protocol/wire.py", "wire (pack/unpack)"),
    ("protocol/aligned.py", "wire (aligned decode)"),
    ("server/pserver_link.py", "head: pservers' link (log, haves)"),
    ("server/pserver_pulls.py", "head: params_at (slice hashes)"),
    ("server/pserver_parts.py", "head: parts wait"),
    ("hetd/pserver/", "head: decision log"),
    ("server/sessions.py", "sessions"),
    ("core/engine.py", "engine (decide)"),
    ("hetd/core/", "core (other)"),
    ("aiohttp/", "aiohttp (websocket frames)"),
    ("asyncio/", "asyncio (sockets, loop)"),
    ("jax", "jax (dispatch, compiled steps)"),
    ("hetd/bench/", "bench (sampling, counters)"),
)


def _stage(stack: str) -> str:
    frames = stack.split(";")
    for frame in reversed(frames):
        for fragment, stage in STAGES:
            if fragment in frame:
                return stage
    return f"other ({frames[-1][:60]})"


def _spy(pid: int, seconds: float, out: Path) -> subprocess.Popen[bytes]:
    """py-spy recording ``pid`` (every thread, idle ones left out) as collapsed stacks."""
    spy = Path(sys.executable).with_name("py-spy")
    cmd = [str(spy), "record", "-p", str(pid), "-d", str(int(seconds)), "-r", str(RATE)]
    cmd += ["-f", "raw", "-o", str(out), "--nonblocking", "--threads"]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _busy(path: Path) -> tuple[Counter[str], Counter[str]]:
    """Samples per stage, and per innermost frame of hetd's, from a collapsed-stacks file."""
    counts: Counter[str] = Counter()
    frames: Counter[str] = Counter()
    if not path.exists():
        return counts, frames
    for line in path.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        if stack and n.isdigit():
            counts[_stage(stack)] += int(n)
            ours = [f for f in stack.split(";") if "hetd/" in f or "workers/" in f]
            frames[
                ours[-1].split(" (")[0] + " " + ours[-1].rsplit("/", 1)[-1] if ours else "?"
            ] += int(n)
    return counts, frames


async def one(
    params: int, senders: int, seconds: float, servers: int, tmp: str, headers: bool = False
) -> dict[str, object]:
    shapes = bench.synthetic_shapes(params)
    backend = "local" if servers > 1 else "none"
    served = await bench.serve(shapes, "int8", Variant(servers, backend, headers))
    daemon, pool = served.daemon, PeerPool(senders)
    url = f"ws://127.0.0.1:{daemon.port}/v1/ws"
    cap, chunk = bench._frame_cap(params), daemon.cfg.server.max_frame_bytes
    jobs = [
        Job("hetd", url, codec="int8", shapes=shapes, cap=cap, frame_cap=chunk, seed=i)
        for i in range(senders)
    ]
    try:
        await pool.start(jobs, timeout=300.0)
        await asyncio.sleep(2.0)  # past the first steps
        procs = daemon.pserver_procs
        pids = {"head": os.getpid()}
        for row in procs.describe() if procs is not None else []:
            pids[f"pserver{row['slice']}"] = row["pid"]
        files = {name: Path(tmp) / f"{name}.txt" for name in pids}
        spies = [_spy(pid, seconds, files[name]) for name, pid in pids.items()]
        tally = await bench._measure(  # the window, while py-spy samples
            bench._engine_counters(daemon.engine), seconds, partial(pserver_cpu_s, daemon)
        )
        for spy in spies:
            await asyncio.to_thread(spy.wait, 60)
        await pool.stop(senders)
        busy = {name: _busy(path) for name, path in files.items()}
    finally:
        pool.close()
        await stop_served(served)
    rates = tally.rates()
    updates = max(1, tally.updates)
    ms = 1e3 / RATE / updates  # one sample's ms, per update
    return {
        "servers": servers,
        "updates_per_s": round(rates["updates_per_s"], 3),
        "head_cpu_ms_per_update": round(rates["cpu_ms_per_update"], 1),
        "pservers_cpu_ms_per_update": round(rates["ps_cpu_ms_per_update"], 1),
        "busy_ms_per_update": {
            name: {k: round(v * ms, 1) for k, v in counts.most_common(12) if v * ms >= 1}
            for name, (counts, _) in busy.items()
        },
        "busy_ms_per_update_by_frame": {
            name: {k: round(v * ms, 1) for k, v in frames.most_common(8) if v * ms >= 1}
            for name, (_, frames) in busy.items()
        },
    }


async def main() -> None:
    params = int(float(sys.argv[1])) if len(sys.argv) > 1 else 32_000_000
    senders = int(sys.argv[2]) if len(sys.argv) > 2 else 4
    seconds = float(sys.argv[3]) if len(sys.argv) > 3 else 10.0
    # S, or S followed by h: a head of headers ([pservers] headers = true)
    servers = sys.argv[4].split(",") if len(sys.argv) > 4 else ["1", "2"]
    for s in servers:
        t0 = time.monotonic()
        with tempfile.TemporaryDirectory() as tmp:
            out = await one(params, senders, seconds, int(s.rstrip("h")), tmp, s.endswith("h"))
            out["headers"] = s.endswith("h")
        out["wall_s"] = round(time.monotonic() - t0, 1)
        print(json.dumps(out), flush=True)


if __name__ == "__main__":
    asyncio.run(main())
