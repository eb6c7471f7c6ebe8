"""Training through pservers against a daemon without them, measured (not a test: run it by hand).

    .venv/bin/python tests/integration/pserver_measure.py [STEPS] [WORKERS]

For S = 0 (no pservers) and S = 2 (two local pserver processes), one after the other: a daemon
(digits, the bundled MLP, asp, momentum, int8 pushes, a state directory) and WORKERS real
``hetd-worker`` processes (default 2) that make STEPS pushes each (default 60). Prints one JSON
line per S: the updates the head applied, the seconds from the first applied update to the last,
updates per second over that window, the pushes dropped for lack of parts, and for S = 2 whether
the slices the pservers saved at a final checkpoint join to the head's parameters bit for bit.
"""

from __future__ import annotations

import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

from hetd import config as config_mod
from hetd.pserver import disk
from hetd.pserver.partition import join
from hetd.server.daemon import Daemon
from tests.conftest import make_config, start_worker


async def _once(servers: int, steps: int, workers: int, root: Path) -> dict[str, object]:
    cfg = make_config("asp", optimizer="momentum", lr=0.05, codec="int8")
    cfg = config_mod.replace(cfg, "server", admin_port=-1, stop_timeout_s=60.0)
    cfg = config_mod.replace(cfg, "store", dir=str(root / f"s{servers}"), interval_s=0.0)
    if servers:
        cfg = config_mod.replace(
            cfg, "pservers", log=True, servers=servers, port=0, backend="local"
        )
    daemon = Daemon(cfg)
    port = await daemon.start()
    try:
        link = daemon.pservers
        if link is not None:
            await asyncio.wait_for(link.ready.wait(), 300)
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
        out: dict[str, object] = {"servers": servers, "updates": store.version}
        window = last - first
        out["window_s"] = round(window, 2)
        out["updates_per_s"] = round((store.version - 1) / window, 2) if window else None
        if link is not None:
            out["dropped"] = link.parts.lost
            await daemon.checkpoint()
            position = daemon.engine.decisions.position  # type: ignore[union-attr]
            while link.durable != [position] * servers:
                await asyncio.sleep(0.05)
            head = dict(store.snapshot().tensors)
            dirs = [root / f"s{servers}" / "pservers" / f"slice{s}" for s in range(servers)]
            slices = [disk.load(disk.listing(d)[0]).slice.params for d in dirs]
            joined = join(link.setup.pmap, slices)
            out["bit_for_bit"] = all(joined[k].tobytes() == head[k].tobytes() for k in head)
        return out
    finally:
        await daemon.stop(final_checkpoint=False)


async def main(steps: int, workers: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        for servers in (0, 2):
            print(json.dumps(await _once(servers, steps, workers, Path(tmp))), flush=True)


if __name__ == "__main__":
    args = [int(a) for a in sys.argv[1:]]
    asyncio.run(main(*(args + [60, 2][len(args) :])))
