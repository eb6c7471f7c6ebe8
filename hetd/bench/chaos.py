"""``hetd bench --suite chaos``: a real daemon and real workers under a seeded fault schedule.

For each policy, two runs of the same length on loopback:

* **chaos**: ``python -m hetd serve`` as a subprocess (a temporary TOML config: loopback, a temporary
  state directory checkpointed every ``CHECKPOINT_S`` s, the admin API on, mnist5k, the policy) and
  N ``hetd-worker`` processes. One fault every ``fault_every`` s, drawn with the seed from: SIGKILL a
  worker (a replacement is started at once), SIGSTOP a worker for a *stall* (20 s, scaled down to
  0.4 x the fault period for short runs) then SIGCONT, and *cut* a worker's connection; and exactly
  one SIGKILL of the daemon mid-run, restarted at once on the same ports and state directory (the
  workers reconnect with their own backoff and resume their ids).
* **baseline**: the same, with no faults.

**The cut with --links netns** (root): every worker runs in a network namespace of its own behind
an unshaped veth pair (:mod:`hetd.bench.links`) and the daemon listens on the run's head address; a
cut sets that worker's link down for the same time, then up: packets are dropped silently both
ways (no FIN, no RST), so the daemon notices through heartbeats alone, and the worker finds its
connection dead once the link is back and resumes its id. ``chaos.json`` records the links under
``options``.

**The cut** on loopback drops the worker's socket: its connection to the daemon is destroyed in
the kernel (``ss -K``), both ends see a reset mid-stream (a push or a params frame may be half
sent), the daemon drops the session and the worker reconnects with ``resume`` after its backoff.
Where ``ss`` cannot destroy sockets (not root, or a kernel without socket destroy) the cut falls
back to a silent partition: the worker is SIGSTOPped for the daemon's heartbeat timeout + 1.5 s, the
daemon hears nothing and drops the session, and on SIGCONT the worker finds its socket closed and
reconnects (``how`` in the fault's record says so). The heartbeat timeout is set to the stall + 3 s,
so a stall is a pure stall and never drops the worker.

Measured (the admin API is polled: ``/v1/status`` every ``POLL_S``, ``/v1/workers`` and
``/metrics`` every second):

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

**Verdict.** ``pass`` when, for every policy: no duplicate or partial apply, no hash mismatch (and
at least one verified pull), versions lost within one checkpoint interval, the daemon restarted and
every worker came back. Goodput has a target (``GOODPUT_TARGET`` for asp and ssp) that is reported,
not part of the verdict: it measures speed, the rest correctness.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import json
import math
import os
import random
import re
import secrets
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hetd.bench.links import NetnsLinks, open_links
from hetd.bench.system_limit import free_port
from hetd.sim.results import PolicySpec

CHECKPOINT_S = 2.0  # the daemon's checkpoint interval
POLL_S = 0.25  # /v1/status
SLOW_POLL_S = 1.0  # /v1/workers and /metrics
JOIN_TIMEOUT_S = 240.0  # worker processes import JAX and compile before their first push
BASE_STEP_S = 0.05  # workers pad each step of 32 samples to this (steadier rates on a loaded host)
RATE_WINDOW_S = 1.0
SETTLE_S = 180.0  # after a run, how long to wait for every worker to be back
KINDS = ("kill_worker", "stall_worker", "cut_worker")
ROUND_POLICIES = ("bsp",)  # one version per round of every connected worker's push
GOODPUT_TARGET = 0.90  # the target for asp and ssp
_HASH_COUNT = re.compile(rb"hash_mismatches=(\d+)")
_HASH_VERIFIED = b"params hash verified"


@dataclass(frozen=True)
class ChaosOptions:
    """What ``hetd bench --suite chaos`` takes."""

    policies: tuple[PolicySpec, ...]
    out: Path
    workers: int = 4
    minutes: float = 3.0
    fault_every: float = 30.0
    seed: int = 0
    dataset: str = "mnist5k"
    quiet: bool = False
    links: str = "emulated"  # netns: a cut is the worker's link set down (hetd.bench.links, root)

    @property
    def duration_s(self) -> float:
        return self.minutes * 60.0

    @property
    def stall_s(self) -> float:
        return min(20.0, 0.4 * self.fault_every)

    @property
    def heartbeat_timeout_s(self) -> float:
        return self.stall_s + 3.0


@dataclass
class Fault:
    """One planned fault and what happened."""

    at_s: float  # planned, from the run's t = 0
    kind: str  # kill_worker | stall_worker | cut_worker | kill_daemon
    slot: int = -1  # the worker slot (-1: the daemon)
    injected_s: float | None = None
    ended_s: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def schedule(opts: ChaosOptions) -> list[Fault]:
    """The seeded fault plan: one fault every ``fault_every`` s, the middle one the daemon kill."""
    rng = random.Random(opts.seed)
    times = []
    t = opts.fault_every
    while t < opts.duration_s - 1e-9:
        times.append(t)
        t += opts.fault_every
    if not times:
        raise ValueError("--fault-every must be shorter than the run (--minutes)")
    daemon_at = len(times) // 2
    faults = []
    for i, at in enumerate(times):
        if i == daemon_at:
            faults.append(Fault(at, "kill_daemon"))
        else:
            faults.append(Fault(at, rng.choice(KINDS), rng.randrange(opts.workers)))
    return faults


# --- the admin API (blocking; called in a thread) ---------------------------------------------------


def _get(port: int, path: str, token: str, timeout: float = 2.0) -> bytes | None:
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}", headers={"Authorization": f"Bearer {token}"}
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as reply:
            body: bytes = reply.read()
            return body
    except (OSError, urllib.error.URLError, ValueError):
        return None


def _json(port: int, path: str, token: str) -> Any:
    body = _get(port, path, token)
    if body is None:
        return None
    try:
        return json.loads(body)
    except ValueError:
        return None


def _rows(port: int, token: str) -> list[dict[str, Any]] | None:
    body = _json(port, "/v1/workers", token)
    rows = body.get("workers") if isinstance(body, dict) else None
    return rows if isinstance(rows, list) else None


_METRIC = re.compile(r"^(hetd_worker_updates_duplicate|hetd_worker_updates_applied)(?:_total)?\{")


def drop_sockets(pid: int, port: int) -> int:
    """Reset process ``pid``'s TCP connections to ``port`` on loopback (``ss -K``, the kernel's
    socket destroy: both ends see a reset, as when a NAT or a proxy drops a connection). Returns how
    many were dropped; 0 when ``ss`` cannot list or destroy sockets here (not root, or a kernel
    without socket destroy), and the caller falls back to the partition."""
    listed = subprocess.run(
        ["ss", "-tnpH", "state", "established", "dport", "=", f":{port}"],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    if listed.returncode != 0:
        return 0
    ports = [
        line.split()[2].rsplit(":", 1)[1]  # Recv-Q Send-Q Local:Port Peer:Port users:(...)
        for line in listed.stdout.splitlines()
        if f"pid={pid}," in line and len(line.split()) >= 4
    ]
    dropped = 0
    for sport in ports:
        killed = subprocess.run(
            ["ss", "-KtnH", "dport", "=", f":{port}", "sport", "=", f":{sport}"],
            capture_output=True, text=True, check=False,
        )  # fmt: skip
        dropped += sum(1 for line in killed.stdout.splitlines() if line.strip())
    return dropped


def metric_sums(text: str) -> dict[str, float]:
    """Sums over workers of the duplicate and applied counters in a ``/metrics`` page."""
    out = {"duplicates": 0.0, "applied": 0.0}
    for line in text.splitlines():
        m = _METRIC.match(line)
        if m:
            key = "duplicates" if m.group(1).endswith("duplicate") else "applied"
            with contextlib.suppress(ValueError):
                out[key] += float(line.rsplit(" ", 1)[1])
    return out


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


# --- one run -----------------------------------------------------------------------------------------


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int | float | str):
        return json.dumps(v)
    raise ValueError(f"cannot write {v!r} into the daemon's config")


def _config_text(
    opts: ChaosOptions, policy: PolicySpec, port: int, admin: int, state: str, host: str
) -> str:
    params = ", ".join(f"{json.dumps(k)} = {_toml_value(v)}" for k, v in policy.params)
    return (
        "[server]\n"
        f'host = {json.dumps(host)}\nport = {port}\nadmin_host = "127.0.0.1"\nadmin_port = {admin}\n'
        f"heartbeat_s = 0.5\nheartbeat_timeout_s = {opts.heartbeat_timeout_s!r}\n"
        "stop_timeout_s = 3.0\n"
        "[train]\n"
        f"dataset = {json.dumps(opts.dataset)}\nseed = {opts.seed}\neval_interval_s = 5.0\n"
        f"shards = {max(1, opts.workers)}\n"
        "[policy]\n"
        f"name = {json.dumps(policy.name)}\nparams = {{{params}}}\n"
        "[store]\n"
        f"dir = {json.dumps(state)}\ninterval_s = {CHECKPOINT_S!r}\nkeep = 3\n"
    )


class Run:
    """One daemon subprocess, N worker processes, the poller and (in a chaos run) the faults."""

    def __init__(
        self,
        opts: ChaosOptions,
        policy: PolicySpec,
        faults: list[Fault],
        tag: str,
        net: NetnsLinks | None = None,
    ):
        self.opts = opts
        self.net = net  # the workers' links (--links netns), or None: loopback
        self.host = "127.0.0.1" if net is None else net.head
        self.policy = policy
        self.faults = faults
        self.tag = tag
        self.port = free_port()
        self.admin_port = free_port()
        self.worker_token = secrets.token_hex(16)
        self.admin_token = secrets.token_hex(16)
        self.tmp = tempfile.TemporaryDirectory(prefix="hetd-chaos-")
        self.logs = opts.out / "logs"
        for old in self.logs.glob(f"{policy.name}-{tag}-*.log"):  # an earlier suite's, same OUT
            old.unlink()
        self.config = Path(self.tmp.name) / "hetd.toml"
        self.config.write_text(
            _config_text(
                opts, policy, self.port, self.admin_port, str(Path(self.tmp.name) / "st"), self.host
            )
        )
        self.daemon: asyncio.subprocess.Process | None = None
        self.daemon_starts = 0
        self.workers: list[asyncio.subprocess.Process] = []
        self.spawned = 0
        self.t0 = 0.0  # monotonic time of the run's t = 0
        # (t, version, updates_applied, workers) per status poll; t from t = 0
        self.series: list[tuple[float, int, int, int]] = []
        self.violations = 0
        self.dup_by_life: dict[int, float] = {}
        self.applied_by_life: dict[int, float] = {}
        self.samples_per_push = 0.0
        self.paused: set[int] = set()
        self.loads: list[float] = []  # the host's 1-min load average, once a second

    def _env(self) -> dict[str, str]:
        from hetd.local.demo import worker_env

        env = worker_env(self.worker_token)
        env["HETD_ADMIN_TOKEN"] = self.admin_token
        return env

    def _log(self, name: str) -> Any:
        self.logs.mkdir(parents=True, exist_ok=True)
        return open(self.logs / f"{self.policy.name}-{self.tag}-{name}.log", "ab")

    async def start_daemon(self) -> None:
        self.daemon_starts += 1
        with self._log("daemon") as log:
            self.daemon = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "hetd", "serve", "--config", str(self.config),
                env=self._env(), stdout=log, stderr=log,
            )  # fmt: skip

    async def spawn_worker(self, slot: int) -> asyncio.subprocess.Process:
        self.spawned += 1
        with self._log(f"w{slot}-{self.spawned}") as log:  # one log per process
            argv = [
                sys.executable, "-m", "workers.cli", f"ws://{self.host}:{self.port}",
                "--name", f"w{slot}-{self.spawned}", "--retry-max-delay", "1.0",
                "--emulate-base-step", repr(BASE_STEP_S), "--verbose",
            ]  # fmt: skip
            proc = await asyncio.create_subprocess_exec(
                *(argv if self.net is None else self.net.command(slot, argv)),
                env=self._env(), stdin=asyncio.subprocess.DEVNULL, stdout=log, stderr=log,
            )  # fmt: skip
        return proc

    async def status(self) -> Any:
        return await asyncio.to_thread(_json, self.admin_port, "/v1/status", self.admin_token)

    async def wait_ready(self, timeout: float) -> None:
        """Until every worker is connected and has pushed (its jit compiled)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            rows = await asyncio.to_thread(_rows, self.admin_port, self.admin_token)
            if (
                isinstance(rows, list)
                and len(rows) >= self.opts.workers
                and all(r.get("pushes", 0) > 0 for r in rows)
            ):
                return
            if self.daemon is not None and self.daemon.returncode is not None:
                raise RuntimeError(
                    f"the daemon exited with code {self.daemon.returncode} (see {self.logs})"
                )
            await asyncio.sleep(0.5)
        raise TimeoutError(f"{self.opts.workers} workers did not all push within {timeout:g} s")

    async def poll(self, stop: asyncio.Event) -> None:
        last_slow = -math.inf
        while not stop.is_set():
            now = time.monotonic() - self.t0
            s = await self.status()
            if isinstance(s, dict):
                v, ua, w = int(s["version"]), int(s["updates_applied"]), int(s["workers"])
                self.series.append((time.monotonic() - self.t0, v, ua, w))
                if v != ua:
                    self.violations += 1
            if now - last_slow >= SLOW_POLL_S:
                last_slow = now
                await self._poll_slow()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), POLL_S)

    async def _poll_slow(self) -> None:
        life = self.daemon_starts
        with contextlib.suppress(OSError):
            self.loads.append(os.getloadavg()[0])
        text = await asyncio.to_thread(_get, self.admin_port, "/metrics", self.admin_token)
        if text is not None:
            sums = metric_sums(text.decode(errors="replace"))
            self.dup_by_life[life] = max(self.dup_by_life.get(life, 0.0), sums["duplicates"])
            self.applied_by_life[life] = max(self.applied_by_life.get(life, 0.0), sums["applied"])
        rows = await asyncio.to_thread(_rows, self.admin_port, self.admin_token)
        if isinstance(rows, list):
            pushes = sum(int(r.get("pushes", 0)) for r in rows)
            samples = sum(int(r.get("samples", 0)) for r in rows)
            if pushes:
                self.samples_per_push = samples / pushes

    # --- faults ---

    async def inject(self, f: Fault) -> None:
        o = self.opts
        f.injected_s = time.monotonic() - self.t0
        if f.kind == "kill_daemon":
            assert self.daemon is not None
            s = await self.status()
            before = int(s["version"]) if isinstance(s, dict) else self.series[-1][1]
            self.daemon.kill()
            await self.daemon.wait()
            f.extra["version_before"] = before
            f.extra["rate_before"] = self.rate(f.injected_s - 5.0, f.injected_s)
            await self.start_daemon()
            while True:
                s = await self.status()
                if isinstance(s, dict):
                    f.extra["version_after"] = int(s["version"])
                    break
                if self.daemon is not None and self.daemon.returncode is not None:
                    raise RuntimeError(f"the restarted daemon exited (see {self.logs})")
                await asyncio.sleep(0.1)
            f.extra["restart_s"] = round(time.monotonic() - self.t0 - f.injected_s, 3)
            f.ended_s = time.monotonic() - self.t0
            return
        slot = f.slot
        if slot in self.paused:  # that worker is already under a fault: take a free one
            free = [i for i in range(o.workers) if i not in self.paused]
            if not free:
                f.extra["skipped"] = "every worker is under a fault"
                return
            slot = f.slot = free[0]
        proc = self.workers[slot]
        if f.kind == "kill_worker":
            proc.kill()
            await proc.wait()
            self.workers[slot] = await self.spawn_worker(slot)
            f.ended_s = time.monotonic() - self.t0
            return
        if f.kind == "cut_worker" and self.net is None:
            dropped = await asyncio.to_thread(drop_sockets, proc.pid, self.port)
            if dropped:  # the cut: the socket is reset, the worker reconnects at once
                f.extra["sockets_dropped"] = dropped
                f.ended_s = time.monotonic() - self.t0
                return
            f.extra["how"] = "partition (ss -K unavailable)"
        hold = o.stall_s if f.kind == "stall_worker" else o.heartbeat_timeout_s + 1.5
        f.extra["held_s"] = hold
        self.paused.add(slot)
        if f.kind == "cut_worker" and self.net is not None:  # a real partition: the link goes down
            f.extra["link_down"] = True
            try:
                self.net.down(slot)
                await asyncio.sleep(hold)
            finally:
                self.net.up(slot)
                self.paused.discard(slot)
            f.ended_s = time.monotonic() - self.t0
            return
        try:
            proc.send_signal(signal.SIGSTOP)
            await asyncio.sleep(hold)
        finally:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGCONT)
            self.paused.discard(slot)
        f.ended_s = time.monotonic() - self.t0

    async def faulter(self) -> None:
        tasks = []
        for f in self.faults:
            delay = self.t0 + f.at_s - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(self.inject(f)))
        await asyncio.gather(*tasks)

    # --- measures ---

    def samples_gained(self, t1: float) -> float:
        """Samples applied from t = 0 to ``t1``: versions gained x samples per version (a round of
        the connected workers' pushes for bsp, one push otherwise)."""
        pts = [(t, v, w) for t, v, _, w in self.series if t <= t1]
        per_push = self.samples_per_push
        rounds = self.policy.name in ROUND_POLICIES
        # Signed: versions lost at the daemon kill are taken back (asp/ssp: exactly v_end - v_0).
        return sum(
            (b[1] - a[1]) * per_push * (max(1, b[2]) if rounds else 1)
            for a, b in itertools.pairwise(pts)
        )

    def hash_counts(self) -> dict[str, int]:
        """Per worker process (one log each): its last ``hash_mismatches=N``, summed, and how many
        processes logged a verified full pull."""
        return hash_counts(sorted(self.logs.glob(f"{self.policy.name}-{self.tag}-w*.log")))

    def cost(self, f: Fault, end: float) -> float | None:
        """Seconds of the pre-fault rate the fault cost: updates short of that rate from the
        injection to ``end``, divided by it."""
        if f.injected_s is None:
            return None
        pre = self.rate(f.injected_s - 5.0, f.injected_s)
        if pre <= 0 or end <= f.injected_s:
            return None
        pts = [(t, ua) for t, _, ua, _ in self.series if f.injected_s <= t <= end]
        gained = sum(max(0, b[1] - a[1]) for a, b in itertools.pairwise(pts))
        return round(max(0.0, (end - f.injected_s) - gained / pre), 2)

    def rate(self, t0: float, t1: float) -> float:
        """Updates applied per second in [t0, t1] (from updates_applied; a restart counts 0)."""
        pts = [(t, ua) for t, _, ua, _ in self.series if t0 <= t <= t1]
        if len(pts) < 2 or pts[-1][0] - pts[0][0] <= 0:
            return 0.0
        gained = sum(max(0, b[1] - a[1]) for a, b in itertools.pairwise(pts))
        return gained / (pts[-1][0] - pts[0][0])

    def recovery(self, f: Fault) -> dict[str, Any]:
        if f.injected_s is None:
            return {"rate_recovery_s": None, "workers_back_s": None}
        t_inj = f.injected_s
        pre = self.rate(t_inj - 5.0, t_inj)
        rate_s = None
        for t, *_ in self.series:
            if pre <= 0:  # no rate before (the daemon was down): nothing to recover to
                break
            if t >= t_inj + RATE_WINDOW_S and self.rate(t - RATE_WINDOW_S, t) >= 0.5 * pre:
                rate_s = round(t - t_inj, 3)
                break
        back = None
        end = f.ended_s if f.ended_s is not None else t_inj
        for t, _, _, w in self.series:
            if t >= end and w >= self.opts.workers:
                back = round(t - t_inj, 3)
                break
        return {"pre_rate": round(pre, 2), "rate_recovery_s": rate_s, "workers_back_s": back}

    async def settle(self, deadline: float) -> None:
        """Until every worker is connected and an update was applied after that (a restarted
        daemon lists workers that have just rejoined before any of them pushed again)."""
        since: int | None = None  # updates_applied when all N were first seen connected
        while time.monotonic() < deadline:
            if self.series:
                _, _, ua, w = self.series[-1]
                if w < self.opts.workers:
                    since = None
                elif since is None:
                    since = ua
                elif ua > since:
                    return
            await asyncio.sleep(0.5)

    async def run(self) -> dict[str, Any]:
        o = self.opts
        try:
            await self.start_daemon()
            self.workers = [await self.spawn_worker(i) for i in range(o.workers)]
            await self.wait_ready(JOIN_TIMEOUT_S)
            self.t0 = time.monotonic()
            s0 = await self.status()
            v0 = int(s0["version"]) if isinstance(s0, dict) else 0
            if isinstance(s0, dict):
                self.series.append((0.0, v0, int(s0["updates_applied"]), int(s0["workers"])))
            stop = asyncio.Event()
            poller = asyncio.create_task(self.poll(stop))
            faulter = asyncio.create_task(self.faulter())
            await asyncio.sleep(o.duration_s)
            s1 = await self.status()
            if isinstance(s1, dict):  # the last point of the measured run, for samples_gained
                self.series.append(
                    (
                        o.duration_s,
                        int(s1["version"]),
                        int(s1["updates_applied"]),
                        int(s1["workers"]),
                    )
                )
            at_end = [x for x in self.series if x[0] <= o.duration_s]
            v1 = int(s1["version"]) if isinstance(s1, dict) else (at_end or self.series)[-1][1]
            await faulter  # a hold that began before the end finishes (bounded by the hold)
            # Not counted in goodput: wait until every worker is back (a daemon restarted late
            # in a short run is still importing JAX), so each fault's recovery can be measured.
            await self.settle(time.monotonic() + SETTLE_S)
            stop.set()
            await poller
            gained = v1 - v0
            samples = self.samples_gained(o.duration_s)
            hashes = self.hash_counts()
            ends = [f.at_s if f.injected_s is None else f.injected_s for f in self.faults[1:]]
            ends.append(o.duration_s)
            return {
                "duration_s": o.duration_s,
                "observed_s": round(time.monotonic() - self.t0, 2),
                "version_start": v0,
                "version_end": v1,
                "versions_gained": gained,
                "samples_per_push": round(self.samples_per_push, 3),
                "samples_applied": round(samples),
                "invariant_violations": self.violations,
                "hash_mismatches": hashes["mismatches"],
                "hash_verified": hashes["verified"],
                "worker_processes": hashes["processes"],
                "load_mean": round(sum(self.loads) / len(self.loads), 2) if self.loads else None,
                "duplicates_acked": round(sum(self.dup_by_life.values())),
                "daemon_starts": self.daemon_starts,
                "workers_spawned": self.spawned,
                "workers_at_end": self.series[-1][3] if self.series else 0,
                "faults": [
                    {
                        "at_s": f.at_s,
                        "kind": f.kind,
                        "worker": f.slot,
                        "injected_s": None if f.injected_s is None else round(f.injected_s, 3),
                        "ended_s": None if f.ended_s is None else round(f.ended_s, 3),
                        **f.extra,
                        **self.recovery(f),
                        "cost_s": self.cost(f, end),
                    }
                    for f, end in zip(self.faults, ends, strict=False)
                ],
            }
        finally:
            await self.stop()

    async def stop(self) -> None:
        from hetd.local.demo import stop_processes

        for p in self.workers:
            with contextlib.suppress(ProcessLookupError):
                p.send_signal(signal.SIGCONT)
        procs = [p for p in self.workers if p.returncode is None]
        if self.daemon is not None:
            procs.append(self.daemon)
        with contextlib.suppress(Exception):
            await stop_processes(procs)
        self.tmp.cleanup()


async def _policy(
    opts: ChaosOptions, policy: PolicySpec, net: NetnsLinks | None = None
) -> dict[str, Any]:
    def say(message: str) -> None:
        if not opts.quiet:
            print(message, file=sys.stderr, flush=True)

    half = dataclasses.replace(opts, minutes=opts.minutes / 2)
    say(f"chaos: {policy.label}: baseline without faults, first half ({half.duration_s:g} s)")
    before = await Run(half, policy, [], "baseline", net).run()
    say(f"chaos: {policy.label}: run with faults ({opts.duration_s:g} s)")
    chaos = await Run(opts, policy, schedule(opts), "chaos", net).run()
    say(f"chaos: {policy.label}: baseline without faults, second half ({half.duration_s:g} s)")
    after = await Run(half, policy, [], "baseline", net).run()
    base = merge_baselines(before, after)
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
    row["failures"] = failures(row)
    row["verdict"] = "fail" if row["failures"] else "pass"
    return {**row, "chaos": chaos, "baseline": base}


_SUMMED = (
    "samples_applied",
    "versions_gained",
    "invariant_violations",
    "hash_mismatches",
    "hash_verified",
    "worker_processes",
)


def merge_baselines(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """One baseline from its two halves, run just before and just after the chaos run: the counts
    summed, the load averaged. Bracketing the chaos run this way, a host whose load drifts during
    the suite weighs on the baseline as it weighed on the chaos run (a baseline run only after it
    once ran at a load of 19 against the chaos run's 5.6 and flattered its goodput)."""
    merged: dict[str, Any] = {k: before[k] + after[k] for k in _SUMMED}
    loads = [x for x in (before["load_mean"], after["load_mean"]) if x is not None]
    merged["load_mean"] = round(sum(loads) / len(loads), 2) if loads else None
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
    return out


def render_md(doc: dict[str, Any]) -> str:
    """``chaos.md``: the table per policy and each fault's recovery."""
    o = doc["options"]
    lines = [
        "# Chaos suite",
        "",
        f"{o['workers']} workers, {o['minutes']:g} min per run, one fault every "
        f"{o['fault_every']:g} s (seed {o['seed']}), checkpoint every {o['checkpoint_s']:g} s, "
        f"stall {o['stall_s']:g} s, heartbeat timeout {o['heartbeat_timeout_s']:g} s.",
        "",
        f"Verdict: **{doc['verdict']}** (no duplicate or partial apply, no hash mismatch, versions "
        "lost within one checkpoint interval, daemon restarted, every worker back).",
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
            worker = "daemon" if f["kind"] == "kill_daemon" else str(f["worker"])
            lines.append(
                f"| {fmt(f['injected_s'])} | {f['kind']} | {worker} | {fmt(f.get('held_s'))} | "
                f"{fmt(f.get('pre_rate'))} | {fmt(f.get('cost_s'))} | {fmt(f['rate_recovery_s'])} | "
                f"{fmt(f['workers_back_s'])} |"
            )
    return "\n".join(lines) + "\n"


async def run_chaos_async(opts: ChaosOptions) -> dict[str, Any]:
    if opts.workers < 1:
        raise ValueError(f"--workers must be >= 1, got {opts.workers}")
    if not opts.minutes > 0 or not opts.fault_every > 0:
        raise ValueError("--minutes and --fault-every must be > 0")
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
