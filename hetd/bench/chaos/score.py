"""What a chaos run is scored on: its record from the cluster's polls, the worker logs and the
faults, one policy's row and verdict, and ``chaos.md``.

Measured (from :class:`~hetd.bench.chaos.cluster.Cluster`'s polls of the admin API):

* ``goodput``: samples applied in the chaos run ÷ samples applied in the baseline run. Samples
  applied = the versions gained over the run × the samples per version: one push's samples (the
  mean the workers report) for a policy that applies each push (asp, ssp), the pushes of a round
  (the workers connected when the version was made, from the status polls) for ``bsp``. Versions
  lost at the daemon kill do not count. The baseline runs in two halves of half the length, one
  just before the chaos run and one just after, on the same host, so that a drifting load weighs on
  both alike; each run records the host's load average.
* ``invariant_violations``: polls where ``updates_applied != version`` (a duplicate or partial apply
  would break it); must be 0. ``duplicates_acked``: resent pushes the daemon recognised and did not
  apply (from ``/metrics``' ``hetd_worker_updates_duplicate``, summed per daemon life).
* ``hash_mismatches``: every worker process logs ``hash_mismatches=N`` after its first verified
  full pull and after each mismatch (workers run with ``-v``, one log per process); the last count
  of each process, summed; must be 0. ``hash_verified``: how many worker processes logged a
  verified full pull (0 would mean nothing was checked, which fails too).
* ``versions_lost``: version just before the daemon's SIGKILL minus the version it restarted at;
  ``lost_bound`` is one checkpoint interval's worth (interval × the update rate before the kill).
* per fault: ``cost_s``, what it cost in seconds of the whole cluster's pre-fault rate (updates
  short of that rate from its injection to the next fault or the end of the run, ÷ that rate);
  ``rate_recovery_s`` (from the fault's injection to the first moment the update rate over
  a sliding window is back to >= 50 % of the rate before the fault) and ``workers_back_s`` (from the
  injection to the first moment after the fault ended with all N workers connected).

With pservers (``--pservers S``): per pserver kill, ``updates_back_s`` (:mod:`.pservers`: the
first 2 s window after the kill whose rate is at least half the 2 s before it), with its target
of 10 s; ``parts_dropped``, pushes the head dropped because a pserver's part did not come in time
(per daemon life, summed); and ``slices``, each pserver's slice saved at the daemon's last
checkpoint joined against that checkpoint's parameters, bit for bit; with a head of headers
(``--pserver-heads headers``, a checkpoint without parameters), each slice at that checkpoint's log
position and version, the slices joined into the model's shapes, finite, and having consumed the
same pushes (:mod:`.slices`).

**Verdict.** ``pass`` when, for every policy: no duplicate or partial apply, no hash mismatch (and
at least one verified pull), versions lost within one checkpoint interval, the daemon restarted and
every worker came back; with pservers also: at least one pserver killed, each one killed
restarted, no push dropped for a missing part, and in every run the slices matching the head's
checkpoint. Goodput (its target ``GOODPUT_TARGET``, for asp and ssp) and the time until updates are
back after a pserver kill (10 s) are reported, not part of the verdict: they measure speed, the
rest correctness.
"""

from __future__ import annotations

import itertools
import math
import re
import statistics
from pathlib import Path
from typing import Any

from hetd.bench.chaos import pservers
from hetd.bench.chaos.cluster import CHECKPOINT_S, ChaosOptions, Cluster
from hetd.bench.chaos.faults import Fault
from hetd.sim.results import PolicySpec

RATE_WINDOW_S = 1.0
ROUND_POLICIES = ("bsp",)  # one version per round of every connected worker's push
GOODPUT_TARGET = 0.90  # the target for asp and ssp
_HASH_COUNT = re.compile(rb"hash_mismatches=(\d+)")
_HASH_VERIFIED = b"params hash verified"


def hash_counts(logs: list[Path]) -> dict[str, int]:
    """From one log per worker process: the sum of each one's last ``hash_mismatches=N`` (its
    total), how many logged a verified full pull, and how many logs there were."""
    mismatches = verified = 0
    for path in logs:
        text = path.read_bytes()
        counts = _HASH_COUNT.findall(text)
        if counts:
            mismatches += int(counts[-1])
        verified += _HASH_VERIFIED in text
    return {"mismatches": mismatches, "verified": verified, "processes": len(logs)}


# --- one run ------------------------------------------------------------------------------------------


def samples_gained(c: Cluster, t1: float) -> float:
    """Samples applied from t = 0 to ``t1``: versions gained x samples per version (a round of
    the connected workers' pushes for bsp, one push otherwise)."""
    pts = [(t, v, w) for t, v, _, w in c.series if t <= t1]
    per_push = c.samples_per_push
    rounds = c.policy.name in ROUND_POLICIES
    # Signed: versions lost at the daemon kill are taken back (asp/ssp: exactly v_end - v_0).
    return sum(
        (b[1] - a[1]) * per_push * (max(1, b[2]) if rounds else 1)
        for a, b in itertools.pairwise(pts)
    )


def cost(c: Cluster, f: Fault, end: float) -> float | None:
    """Seconds of the pre-fault rate the fault cost: updates short of that rate from the
    injection to ``end``, divided by it."""
    if f.injected_s is None:
        return None
    pre = c.rate(f.injected_s - 5.0, f.injected_s)
    if pre <= 0 or end <= f.injected_s:
        return None
    pts = [(t, ua) for t, _, ua, _ in c.series if f.injected_s <= t <= end]
    gained = sum(max(0, b[1] - a[1]) for a, b in itertools.pairwise(pts))
    return round(max(0.0, (end - f.injected_s) - gained / pre), 2)


def recovery(c: Cluster, f: Fault) -> dict[str, Any]:
    """The rate before the fault, how long until the rate was back to half of it, and how long
    until every worker was connected again after the fault ended."""
    if f.injected_s is None:
        return {"rate_recovery_s": None, "workers_back_s": None}
    t_inj = f.injected_s
    pre = c.rate(t_inj - 5.0, t_inj)
    rate_s = None
    for t, *_ in c.series:
        if pre <= 0:  # no rate before (the daemon was down): nothing to recover to
            break
        if t >= t_inj + RATE_WINDOW_S and c.rate(t - RATE_WINDOW_S, t) >= 0.5 * pre:
            rate_s = round(t - t_inj, 3)
            break
    back = None
    end = f.ended_s if f.ended_s is not None else t_inj
    for t, _, _, w in c.series:
        if t >= end and w >= c.opts.workers:
            back = round(t - t_inj, 3)
            break
    return {"pre_rate": round(pre, 2), "rate_recovery_s": rate_s, "workers_back_s": back}


def run_record(
    c: Cluster, faults: list[Fault], v0: int, v1: int, observed_s: float
) -> dict[str, Any]:
    """One run's record: versions ``v0`` to ``v1`` gained over its measured length, samples,
    invariant and hash checks, restarts, and each fault with its recovery and cost."""
    o = c.opts
    hashes = hash_counts(c.worker_logs())
    ends = [f.at_s if f.injected_s is None else f.injected_s for f in faults[1:]]
    ends.append(o.duration_s)
    return {
        "duration_s": o.duration_s,
        "observed_s": observed_s,
        "version_start": v0,
        "version_end": v1,
        "versions_gained": v1 - v0,
        "samples_per_push": round(c.samples_per_push, 3),
        "samples_applied": round(samples_gained(c, o.duration_s)),
        "invariant_violations": c.violations,
        "hash_mismatches": hashes["mismatches"],
        "hash_verified": hashes["verified"],
        "worker_processes": hashes["processes"],
        "load_mean": round(sum(c.loads) / len(c.loads), 2) if c.loads else None,
        "duplicates_acked": round(sum(c.dup_by_life.values())),
        "daemon_starts": c.daemon_starts,
        "workers_spawned": c.spawned,
        "workers_at_end": c.series[-1][3] if c.series else 0,
        "parts_dropped": sum(c.parts_dropped_by_life.values()),
        "slices": c.slices,
        "faults": [
            {
                "at_s": f.at_s,
                "kind": f.kind,
                **({"pserver": f.slot} if f.kind == "kill_pserver" else {"worker": f.slot}),
                "injected_s": None if f.injected_s is None else round(f.injected_s, 3),
                "ended_s": None if f.ended_s is None else round(f.ended_s, 3),
                **f.extra,
                **recovery(c, f),
                **(
                    pservers.updates_back(c, f.injected_s)
                    if f.kind == "kill_pserver" and f.injected_s is not None
                    else {}
                ),
                "cost_s": cost(c, f, end),
            }
            for f, end in zip(faults, ends, strict=False)
        ],
    }


# --- one policy ---------------------------------------------------------------------------------------

_SUMMED = (
    "samples_applied",
    "versions_gained",
    "invariant_violations",
    "hash_mismatches",
    "hash_verified",
    "worker_processes",
    "parts_dropped",
)


def merge_baselines(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """One baseline from its two halves, run just before and just after the chaos run: the counts
    summed, the load averaged. Bracketing the chaos run this way, a host whose load drifts during
    the suite weighs on the baseline as it weighed on the chaos run (a baseline run only after it
    once ran at a load of 19 against the chaos run's 5.6 and flattered its goodput)."""
    merged: dict[str, Any] = {k: before[k] + after[k] for k in _SUMMED}
    loads = [x for x in (before["load_mean"], after["load_mean"]) if x is not None]
    merged["load_mean"] = round(sum(loads) / len(loads), 2) if loads else None
    merged["slices"] = [before["slices"], after["slices"]]
    merged["halves"] = [before, after]
    return merged


def pre_fault_goodput(chaos: dict[str, Any], policy: str, opts: ChaosOptions) -> float | None:
    """Goodput against the chaos run's own rate before its faults (the median over the faults of
    the updates/s in the 5 s before each) instead of the baseline run: the same host at the same
    time, so a baseline that ran on a busier (or quieter) machine cannot flatter (or sink) it."""
    rates = [f["pre_rate"] for f in chaos["faults"] if f.get("pre_rate")]
    if not rates or not chaos["samples_per_push"]:
        return None
    median = statistics.median(rates)
    per_version = chaos["samples_per_push"] * (opts.workers if policy in ROUND_POLICIES else 1)
    expected = median * chaos["duration_s"] * per_version
    return float(chaos["samples_applied"] / expected) if expected > 0 else None


def policy_row(
    opts: ChaosOptions, policy: PolicySpec, chaos: dict[str, Any], base: dict[str, Any]
) -> dict[str, Any]:
    """One policy's scores and verdict from its chaos run and its merged baseline."""
    kill = next((f for f in chaos["faults"] if f["kind"] == "kill_daemon"), None)
    lost = bound = None
    if kill is not None and "version_after" in kill:
        lost = kill["version_before"] - kill["version_after"]
        bound = math.ceil(CHECKPOINT_S * kill["rate_before"])
    goodput = (
        chaos["samples_applied"] / base["samples_applied"] if base["samples_applied"] else None
    )
    own = pre_fault_goodput(chaos, policy.name, opts)
    row: dict[str, Any] = {
        "policy": policy.label,
        "goodput": None if goodput is None else round(goodput, 4),
        "goodput_vs_pre_fault": None if own is None else round(own, 4),
        "goodput_target": GOODPUT_TARGET if policy.name in ("asp", "ssp") else None,
        "duplicate_or_partial_applies": chaos["invariant_violations"]
        + base["invariant_violations"],
        "duplicates_acked": chaos["duplicates_acked"],
        "hash_mismatches": chaos["hash_mismatches"] + base["hash_mismatches"],
        "hash_verified": chaos["hash_verified"] + base["hash_verified"],
        "versions_lost": lost,
        "lost_bound": bound,
        "lost_within_bound": None if lost is None or bound is None else lost <= max(bound, 1),
        "daemon_restarted": chaos["daemon_starts"] == 2,
        "workers_back": chaos["workers_at_end"] >= opts.workers,
    }
    if opts.pservers:
        row.update(pservers.scores(chaos, base, opts.headers))
    row["failures"] = failures(row)
    row["verdict"] = "fail" if row["failures"] else "pass"
    return {**row, "chaos": chaos, "baseline": base}


def failures(row: dict[str, Any]) -> list[str]:
    """What broke one policy's verdict (empty: it passed)."""
    out = []
    if row["duplicate_or_partial_applies"]:
        out.append(f"{row['duplicate_or_partial_applies']} duplicate or partial applies")
    if row["hash_mismatches"]:
        out.append(f"{row['hash_mismatches']} parameter hash mismatches")
    if not row["hash_verified"]:
        out.append("no worker verified a parameter hash")
    if row["lost_within_bound"] is False:
        out.append(f"{row['versions_lost']} versions lost, more than {row['lost_bound']}")
    if not row["daemon_restarted"]:
        out.append("the daemon did not restart")
    if not row["workers_back"]:
        out.append("not every worker came back")
    if "pserver_kills" in row:  # a run with pservers
        if not row["pserver_kills"]:
            out.append("no pserver was killed")
        if not row["pservers_restarted"]:
            out.append("a killed pserver was not seen restarted")
        if row["parts_dropped"]:
            out.append(f"{row['parts_dropped']} pushes dropped waiting for a pserver's part")
        if not row["slices_match_head"]:
            why = "; ".join(str(x) for x in row["slices_why"]) or "not checked"
            out.append(f"the pservers' slices do not match the head's checkpoint ({why})")
    return out


# --- the report ---------------------------------------------------------------------------------------


def render_md(doc: dict[str, Any]) -> str:
    """``chaos.md``: the table per policy and each fault's recovery."""
    o = doc["options"]
    lines = [
        "# Chaos suite",
        "",
        f"{o['workers']} workers, {o['minutes']:g} min per run, one fault every "
        f"{o['fault_every']:g} s (seed {o['seed']}), checkpoint every {o['checkpoint_s']:g} s, "
        f"stall {o['stall_s']:g} s, heartbeat timeout {o['heartbeat_timeout_s']:g} s"
        + (
            f", {o['pservers']} local pservers (workers pull their releases from them)"
            + (
                ", the head taking each push's header only (it holds no parameters)."
                if o.get("pserver_heads") == "headers"
                else "."
            )
            if o.get("pservers")
            else "."
        ),
        "",
        f"Verdict: **{doc['verdict']}** (no duplicate or partial apply, no hash mismatch, versions "
        "lost within one checkpoint interval, daemon restarted, every worker back"
        + (
            "; a pserver killed and restarted, no push dropped for a missing part, the pservers' "
            + (
                "saved slices at the head's last checkpoint's log position and version, joining "
                "into the model's shapes, finite, and having consumed the same pushes)."
                if o.get("pserver_heads") == "headers"
                else "saved slices equal to the head's parameters bit for bit)."
            )
            if o.get("pservers")
            else ")."
        ),
        "",
        "Goodput is against the fault-free baseline run; the next column against the chaos run's "
        "own pre-fault rate (the same host at the same time: a check on load drift).",
        "",
        "| policy | goodput (target) | vs own pre-fault rate | dup/partial applies | duplicates "
        "acked | hash mismatches (verified pulls) | versions lost (bound) | daemon restarted "
        "| workers back | verdict |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for p in doc["policies"]:
        gp = "–" if p["goodput"] is None else f"{p['goodput']:.3f}"
        if p.get("goodput_target") is not None:
            gp += f" (≥ {p['goodput_target']:.2f})"
        lost = "–" if p["versions_lost"] is None else f"{p['versions_lost']} ({p['lost_bound']})"
        verdict = p["verdict"] + "".join(f"; {x}" for x in p["failures"])
        own = p.get("goodput_vs_pre_fault")
        own_s = "–" if own is None else f"{own:.3f}"
        lines.append(
            f"| {p['policy']} | {gp} | {own_s} | {p['duplicate_or_partial_applies']} | "
            f"{p['duplicates_acked']} | {p['hash_mismatches']} ({p['hash_verified']}) | {lost} | "
            f"{p['daemon_restarted']} | {p['workers_back']} | {verdict} |"
        )
    for p in doc["policies"]:
        c, b = p["chaos"], p["baseline"]
        lines += [
            "",
            f"## {p['policy']}",
            "",
            f"Samples applied: {c['samples_applied']} with faults, {b['samples_applied']} without "
            f"({c['versions_gained']} and {b['versions_gained']} versions). Host load average "
            f"{c['load_mean']} and {b['load_mean']}. Worker processes {c['worker_processes']} "
            f"and {b['worker_processes']}.",
            "",
            "| at (s) | fault | worker | held (s) | pre-fault updates/s | cost (s of full rate) "
            "| rate ≥ 50 % after (s) | all workers back after (s) |",
            "|---|---|---|---|---|---|---|---|",
        ]

        def fmt(x: Any) -> str:
            return "–" if x is None else f"{x:g}" if isinstance(x, float) else str(x)

        for f in c["faults"]:
            worker = (
                "daemon"
                if f["kind"] == "kill_daemon"
                else f"pserver {f['pserver']}"
                if f["kind"] == "kill_pserver"
                else str(f["worker"])
            )
            lines.append(
                f"| {fmt(f['injected_s'])} | {f['kind']} | {worker} | {fmt(f.get('held_s'))} | "
                f"{fmt(f.get('pre_rate'))} | {fmt(f.get('cost_s'))} | {fmt(f['rate_recovery_s'])} | "
                f"{fmt(f['workers_back_s'])} |"
            )
        if "pserver_kills" in p:
            lines += pservers.report_lines(p, fmt)
    return "\n".join(lines) + "\n"
