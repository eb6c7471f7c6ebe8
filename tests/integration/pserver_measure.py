"""Training through pservers against a daemon without them, measured (not a test: run it by hand).

    .venv/bin/python tests/integration/pserver_measure.py [STEPS] [WORKERS] [RUNS]

RUNS, comma-separated, one after the other (default ``none,local``): ``none`` a daemon without
pservers (S = 0), ``local`` two pserver processes the daemon spawns, ``ray`` two pserver Ray actors
(``pip install 'hetd[ray]'``; a Ray instance is started on this host for them). Each run: a daemon
(digits, the bundled MLP, asp, momentum, int8 pushes, a state directory) and WORKERS real
``hetd-worker`` processes (default 2) that make STEPS pushes each (default 60). Prints one JSON
line per S: the updates the head applied, the seconds from the first applied update to the last,
updates per second over that window, the pushes dropped for lack of parts, the p50 and p90 of a
push's wait at the head from its arrival to the moment every pserver holds its part (what the
pservers add to a push's latency), the p50 of the engine's decision latency, and for S = 2 whether
the slices the pservers saved at a final checkpoint join to the head's parameters bit for bit.
"""

from __future__ import annotations

import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from hetd import config as config_mod
from hetd.pserver import disk
from hetd.pserver.partition import join
from hetd.server.daemon import Daemon
from tests.conftest import make_config, start_worker


def _timed(parts: Any, waits: list[float]) -> None:
    """Time each push from its arrival at the head (``hold``) to its parts all held (``submit``)."""
    arrived: dict[tuple[int, int], float] = {}
    hold, submit = parts.hold, parts.submit

    def timed_hold(push: Any) -> None:
        arrived[(push.worker, push.id)] = time.perf_counter()
        hold(push)

    def timed_submit(push: Any) -> None:
        began = arrived.pop((push.worker, push.id), None)
        if began is not None:
            waits.append(time.perf_counter() - began)
        submit(push)

    parts.hold, parts.submit = timed_hold, timed_submit


def _ms(values: list[float], q: float) -> float | None:
    return round(1e3 * float(np.quantile(values, q)), 2) if values else None


async def _once(backend: str, steps: int, workers: int, root: Path) -> dict[str, object]:
    servers = 0 if backend == "none" else 2
    state = root / f"{backend}-{time.monotonic_ns()}"
    cfg = make_config("asp", optimizer="momentum", lr=0.05, codec="int8")
    cfg = config_mod.replace(cfg, "server", admin_port=-1, stop_timeout_s=60.0)
    cfg = config_mod.replace(cfg, "store", dir=str(state), interval_s=0.0)
    if servers:
        cfg = config_mod.replace(
            cfg, "pservers", log=True, servers=servers, port=0, backend=backend
        )
    daemon = Daemon(cfg)
    port = await daemon.start()
    waits: list[float] = []
    try:
        link = daemon.pservers
        if link is not None:
            await asyncio.wait_for(link.ready.wait(), 300)
            _timed(link.parts, waits)
        procs = [await start_worker(port, steps) for _ in range(workers)]
        store = daemon.engine.store
        first = last = 0.0
        seen = 0
        while any(p.returncode is None for p in procs):
            if store.version != seen:
                last = time.monotonic()
                first = first or last
                seen = store.version
            await asyncio.sleep(0.01)
        out: dict[str, object] = {"backend": backend, "servers": servers}
        out["updates"] = store.version
        window = last - first
        out["window_s"] = round(window, 2)
        out["updates_per_s"] = round((store.version - 1) / window, 2) if window else None
        summary = daemon.engine.meters.latency.summary()
        out["engine_p50_ms"] = summary["p50_ms"]
        if link is not None:
            out["dropped"] = link.parts.lost
            out["parts_wait_p50_ms"] = _ms(waits, 0.5)
            out["parts_wait_p90_ms"] = _ms(waits, 0.9)
            await daemon.checkpoint()
            position = daemon.engine.store.decisions.position  # type: ignore[union-attr]
            while link.durable != [position] * servers:
                await asyncio.sleep(0.05)
            head = dict(store.snapshot().tensors)
            dirs = [state / "pservers" / f"slice{s}" for s in range(servers)]
            slices = [disk.load(disk.listing(d)[0]).slice.params for d in dirs]
            joined = join(link.setup.pmap, slices)
            out["bit_for_bit"] = all(joined[k].tobytes() == head[k].tobytes() for k in head)
        return out
    finally:
        await daemon.stop(final_checkpoint=False)


async def main(steps: int, workers: int, runs: list[str]) -> None:
    if "ray" in runs:
        from hetd.server.pserver_ray import connect, load_ray

        ray = load_ray()
        connect(ray)  # a Ray instance on this host for the whole run
    with tempfile.TemporaryDirectory() as tmp:
        for backend in runs:
            print(json.dumps(await _once(backend, steps, workers, Path(tmp))), flush=True)


if __name__ == "__main__":
    numbers = [int(a) for a in sys.argv[1:3]]
    steps, workers = numbers + [60, 2][len(numbers) :]
    runs = sys.argv[3].split(",") if len(sys.argv) > 3 else ["none", "local"]
    asyncio.run(main(steps, workers, runs))
