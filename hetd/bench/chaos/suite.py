"""The chaos suite's runs: per policy, the baseline's two halves and the chaos run between them,
each a :class:`~hetd.bench.chaos.cluster.Cluster` with (or without) its
:class:`~hetd.bench.chaos.faults.Faulter`, scored by :mod:`hetd.bench.chaos.score`; then
``chaos.json`` and ``chaos.md`` in OUT, rewritten after each policy.

Owns :func:`run_chaos` and one run's course: start the daemon and the workers, wait until every
worker has pushed, poll and inject the faults for the run's length, wait (not counted) until every
worker is back, score, stop.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import json
import math
import os
import sys
import time
from typing import Any

from hetd.bench.chaos.cluster import (
    BASE_STEP_S,
    CHECKPOINT_S,
    JOIN_TIMEOUT_S,
    ChaosOptions,
    Cluster,
)
from hetd.bench.chaos.faults import Fault, Faulter, schedule
from hetd.bench.chaos.score import merge_baselines, policy_row, render_md, run_record
from hetd.bench.chaos.slices import check
from hetd.bench.links import NetnsLinks, open_links
from hetd.sim.results import PolicySpec

SETTLE_S = 180.0  # after a run, how long to wait for every worker to be back


async def run_once(
    opts: ChaosOptions,
    policy: PolicySpec,
    faults: list[Fault],
    tag: str,
    net: NetnsLinks | None = None,
) -> dict[str, Any]:
    """One run of ``opts.duration_s`` with these faults (none: a baseline); its record."""
    o = opts
    c = Cluster(opts, policy, tag, net)
    try:
        await c.start_daemon()
        c.workers = [await c.spawn_worker(i) for i in range(o.workers)]
        await c.wait_ready(JOIN_TIMEOUT_S)
        c.t0 = time.monotonic()
        s0 = await c.status()
        v0 = int(s0["version"]) if isinstance(s0, dict) else 0
        if isinstance(s0, dict):
            c.series.append((0.0, v0, int(s0["updates_applied"]), int(s0["workers"])))
        stop = asyncio.Event()
        poller = asyncio.create_task(c.poll(stop))
        faulter = asyncio.create_task(Faulter(c).run(faults))
        await asyncio.sleep(o.duration_s)
        s1 = await c.status()
        if isinstance(s1, dict):  # the last point of the measured run, for samples_gained
            c.series.append(
                (
                    o.duration_s,
                    int(s1["version"]),
                    int(s1["updates_applied"]),
                    int(s1["workers"]),
                )
            )
        at_end = [x for x in c.series if x[0] <= o.duration_s]
        v1 = int(s1["version"]) if isinstance(s1, dict) else (at_end or c.series)[-1][1]
        await faulter  # a hold that began before the end finishes (bounded by the hold)
        # Not counted in goodput: wait until every worker is back (a daemon restarted late
        # in a short run is still importing JAX), so each fault's recovery can be measured.
        await c.settle(time.monotonic() + SETTLE_S)
        stop.set()
        await poller
        observed = round(time.monotonic() - c.t0, 2)
        # with pservers, their slices saved at the daemon's last checkpoint against it
        await c.stop(
            functools.partial(check, servers=o.pservers, headers=o.headers, config=c.config)
            if o.pservers
            else None
        )
        return run_record(c, faults, v0, v1, observed)
    finally:
        await c.stop()


async def _policy(
    opts: ChaosOptions, policy: PolicySpec, net: NetnsLinks | None = None
) -> dict[str, Any]:
    def say(message: str) -> None:
        if not opts.quiet:
            print(message, file=sys.stderr, flush=True)

    half = dataclasses.replace(opts, minutes=opts.minutes / 2)
    say(f"chaos: {policy.label}: baseline without faults, first half ({half.duration_s:g} s)")
    before = await run_once(half, policy, [], "baseline", net)
    say(f"chaos: {policy.label}: run with faults ({opts.duration_s:g} s)")
    chaos = await run_once(opts, policy, schedule(opts), "chaos", net)
    say(f"chaos: {policy.label}: baseline without faults, second half ({half.duration_s:g} s)")
    after = await run_once(half, policy, [], "baseline", net)
    return policy_row(opts, policy, chaos, merge_baselines(before, after))


async def run_chaos_async(opts: ChaosOptions) -> dict[str, Any]:
    """The suite in the running event loop (:func:`run_chaos`)."""
    if opts.workers < 1:
        raise ValueError(f"--workers must be >= 1, got {opts.workers}")
    if not opts.minutes > 0 or not opts.fault_every > 0:
        raise ValueError("--minutes and --fault-every must be > 0")
    if opts.headers and opts.pservers < 1:
        raise ValueError(
            "--pserver-heads headers needs --pservers S >= 1: they hold the parameters"
        )
    schedule(opts)  # a bad schedule is refused before anything starts
    opts.out.mkdir(parents=True, exist_ok=True)
    doc: dict[str, Any] = {
        "options": {
            "workers": opts.workers,
            "minutes": opts.minutes,
            "fault_every": opts.fault_every,
            "seed": opts.seed,
            "dataset": opts.dataset,
            "checkpoint_s": CHECKPOINT_S,
            "stall_s": opts.stall_s,
            "heartbeat_timeout_s": opts.heartbeat_timeout_s,
            "base_step_s": BASE_STEP_S,
            "cpus": os.cpu_count(),
            "links": {"kind": "emulated"},
            "pservers": opts.pservers,
            "pserver_heads": "headers" if opts.headers else "whole",
        },
        "policies": [],
    }
    with contextlib.ExitStack() as stack:
        net = None
        if opts.links == "netns":  # one unshaped link per worker slot, for the whole suite
            net = stack.enter_context(open_links([math.inf] * opts.workers))
            doc["options"]["links"] = net.describe()
        for policy in opts.policies:
            doc["policies"].append(await _policy(opts, policy, net))
            fails = [p["policy"] for p in doc["policies"] if p["verdict"] != "pass"]
            doc["verdict"] = "fail" if fails else "pass"
            (opts.out / "chaos.json").write_text(json.dumps(doc, indent=2) + "\n")
            (opts.out / "chaos.md").write_text(render_md(doc))
    return doc


def run_chaos(opts: ChaosOptions) -> dict[str, Any]:
    """The suite (blocking); writes ``chaos.json`` and ``chaos.md`` in ``opts.out``."""
    return asyncio.run(run_chaos_async(opts))
