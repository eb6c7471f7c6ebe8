"""One chaos run's cluster: its options, the daemon subprocess and the worker processes, and what
the admin API shows of them while the run lasts.

Owns :class:`ChaosOptions` and :class:`Cluster`. A cluster writes the daemon's TOML config into a
temporary directory (loopback or the run's head address, a state directory checkpointed every
:data:`CHECKPOINT_S` s, the admin API on loopback, the data set and the policy, and with
``--pservers S`` S local pserver processes, :mod:`.pservers`), starts ``hetd serve`` and the
``hetd-worker`` processes through :mod:`hetd.local.procs` (one log file per process under
``OUT/logs``), and polls the admin API: ``/v1/status`` every :data:`POLL_S` s into
:attr:`Cluster.series`, ``/v1/workers`` and ``/metrics`` every :data:`SLOW_POLL_S` s.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import json
import math
import os
import re
import secrets
import signal
import tempfile
import time
import urllib.error
import urllib.request
from asyncio.subprocess import Process
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hetd.bench.chaos import pservers
from hetd.bench.links import NetnsLinks
from hetd.bench.system_limit import free_port
from hetd.config import toml_value
from hetd.local.procs import spawn_daemon, spawn_worker, stop_processes, wait_ready, worker_env
from hetd.sim.results import PolicySpec

CHECKPOINT_S = 2.0  # the daemon's checkpoint interval
POLL_S = 0.25  # /v1/status
SLOW_POLL_S = 1.0  # /v1/workers and /metrics
JOIN_TIMEOUT_S = 240.0  # worker processes import JAX and compile before their first push
BASE_STEP_S = 0.05  # workers pad each step of 32 samples to this (steadier rates on a loaded host)


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
    pservers: int = 0  # local pserver processes behind the daemon (0: none, the daemon alone)
    headers: bool = False  # with pservers: the head takes each push's header only, no parameters

    @property
    def duration_s(self) -> float:
        return self.minutes * 60.0

    @property
    def stall_s(self) -> float:
        return min(20.0, 0.4 * self.fault_every)

    @property
    def heartbeat_timeout_s(self) -> float:
        return self.stall_s + 3.0


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


# --- the daemon's config ------------------------------------------------------------------------------


def _config_text(
    opts: ChaosOptions, policy: PolicySpec, port: int, admin: int, state: str, host: str
) -> str:
    params = ", ".join(f"{json.dumps(k)} = {toml_value(v)}" for k, v in policy.params)
    return (
        "[server]\n"
        f'host = {json.dumps(host)}\nport = {port}\nadmin_host = "127.0.0.1"\nadmin_port = {admin}\n'
        f"heartbeat_s = 0.5\nheartbeat_timeout_s = {opts.heartbeat_timeout_s!r}\n"
        # with pservers, the stop waits until each saved the last checkpoint (on a loaded host)
        f"stop_timeout_s = {10.0 if opts.pservers else 3.0!r}\n"
        "[train]\n"
        f"dataset = {json.dumps(opts.dataset)}\nseed = {opts.seed}\neval_interval_s = 5.0\n"
        f"shards = {max(1, opts.workers)}\n"
        "[policy]\n"
        f"name = {json.dumps(policy.name)}\nparams = {{{params}}}\n"
        "[store]\n"
        f"dir = {json.dumps(state)}\ninterval_s = {CHECKPOINT_S!r}\nkeep = 3\n"
        + pservers.config_text(opts.pservers, opts.headers)
    )


# --- the cluster --------------------------------------------------------------------------------------


class Cluster:
    """One daemon subprocess, N worker processes and what the admin API shows of them."""

    def __init__(
        self, opts: ChaosOptions, policy: PolicySpec, tag: str, net: NetnsLinks | None = None
    ):
        self.opts = opts
        self.net = net  # the workers' links (--links netns), or None: loopback
        self.host = "127.0.0.1" if net is None else net.head
        self.policy = policy
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
        self.state = Path(self.tmp.name) / "st"
        self.config.write_text(
            _config_text(opts, policy, self.port, self.admin_port, str(self.state), self.host)
        )
        self.daemon: Process | None = None
        self.daemon_starts = 0
        self.workers: list[Process] = []
        self.spawned = 0
        self.t0 = 0.0  # monotonic time of the run's t = 0
        # (t, version, updates_applied, workers) per status poll; t from t = 0
        self.series: list[tuple[float, int, int, int]] = []
        self.violations = 0
        self.dup_by_life: dict[int, float] = {}
        self.applied_by_life: dict[int, float] = {}
        self.samples_per_push = 0.0
        self.loads: list[float] = []  # the host's 1-min load average, once a second
        self.parts_dropped_by_life: dict[int, int] = {}  # pushes dropped waiting for a part
        self.slices: dict[str, Any] | None = None  # the pservers' slices against the head
        self.stopped = False

    def _log(self, name: str) -> Any:
        self.logs.mkdir(parents=True, exist_ok=True)
        return open(self.logs / f"{self.policy.name}-{self.tag}-{name}.log", "ab")

    def worker_logs(self) -> list[Path]:
        """One log per worker process this run started, sorted by name."""
        return sorted(self.logs.glob(f"{self.policy.name}-{self.tag}-w*.log"))

    def _env(self) -> dict[str, str]:
        return worker_env(self.worker_token, self.admin_token)

    async def start_daemon(self) -> None:
        """Start (or, after a kill, restart) the daemon on the same ports and state directory."""
        self.daemon_starts += 1
        with self._log("daemon") as log:
            self.daemon = await spawn_daemon(
                "--config", str(self.config), env=self._env(), stdout=log, stderr=log
            )

    async def spawn_worker(self, slot: int) -> Process:
        """Start a worker process for ``slot`` (a replacement gets a new name and log)."""
        self.spawned += 1
        with self._log(f"w{slot}-{self.spawned}") as log:  # one log per process
            return await spawn_worker(
                f"ws://{self.host}:{self.port}",
                "--name", f"w{slot}-{self.spawned}", "--retry-max-delay", "1.0",
                "--emulate-base-step", repr(BASE_STEP_S), "--verbose",
                # with pservers, releases are pulled from them (as a remote worker's are)
                *(("--no-shm",) if self.opts.pservers else ()),
                env=self._env(), stdin=asyncio.subprocess.DEVNULL, stdout=log, stderr=log,
                wrap=None if self.net is None else functools.partial(self.net.command, slot),
            )  # fmt: skip

    async def status(self) -> Any:
        """The daemon's ``/v1/status`` (None while it does not answer)."""
        return await asyncio.to_thread(_json, self.admin_port, "/v1/status", self.admin_token)

    async def wait_ready(self, timeout: float) -> None:
        """Until every worker is connected and has pushed (its jit compiled)."""

        async def pushed() -> bool:
            rows = await asyncio.to_thread(_rows, self.admin_port, self.admin_token)
            return (
                isinstance(rows, list)
                and len(rows) >= self.opts.workers
                and all(r.get("pushes", 0) > 0 for r in rows)
            )

        assert self.daemon is not None
        await wait_ready(
            pushed,
            self.daemon,
            timeout=timeout,
            interval=0.5,
            name=f"the daemon (logs in {self.logs})",
            late=f"{self.opts.workers} workers did not all push within {timeout:g} s",
        )

    async def poll(self, stop: asyncio.Event) -> None:
        """Poll the admin API until ``stop`` is set."""
        last_slow = -math.inf
        while not stop.is_set():
            now = time.monotonic() - self.t0
            s = await self.status()
            if isinstance(s, dict):
                v, ua, w = int(s["version"]), int(s["updates_applied"]), int(s["workers"])
                self.series.append((time.monotonic() - self.t0, v, ua, w))
                if v != ua:
                    self.violations += 1
                dropped = pservers.parts_dropped(s)
                if dropped is not None:
                    life = self.daemon_starts
                    self.parts_dropped_by_life[life] = max(
                        self.parts_dropped_by_life.get(life, 0), dropped
                    )
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

    def rate(self, t0: float, t1: float) -> float:
        """Updates applied per second in [t0, t1] (from updates_applied; a restart counts 0)."""
        pts = [(t, ua) for t, _, ua, _ in self.series if t0 <= t <= t1]
        if len(pts) < 2 or pts[-1][0] - pts[0][0] <= 0:
            return 0.0
        gained = sum(max(0, b[1] - a[1]) for a, b in itertools.pairwise(pts))
        return gained / (pts[-1][0] - pts[0][0])

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

    def _keep_pserver_logs(self) -> None:
        """Each pserver's log (all its processes', appended) beside the run's other logs."""
        for s in range(self.opts.pservers):
            log = self.state / "pservers" / f"slice{s}" / "pserver.log"
            with contextlib.suppress(OSError), self._log(f"pserver{s}") as out:
                out.write(log.read_bytes())

    async def stop(self, check: Callable[[Path], dict[str, Any]] | None = None) -> None:
        """Stop every process (a stopped worker is continued first); ``check`` the state
        directory the daemon left (into :attr:`slices`); remove the temporary directory. A second
        call does nothing."""
        if self.stopped:
            return
        self.stopped = True
        for p in self.workers:
            with contextlib.suppress(ProcessLookupError):
                p.send_signal(signal.SIGCONT)
        procs = [p for p in self.workers if p.returncode is None]
        if self.daemon is not None:
            procs.append(self.daemon)
        with contextlib.suppress(Exception):
            await stop_processes(procs)
        if self.opts.pservers:
            self._keep_pserver_logs()
        if check is not None and self.daemon is not None:
            try:
                self.slices = await asyncio.to_thread(check, self.state)
            except Exception as exc:  # an unreadable file is a failed check, not a crash
                self.slices = {"match": False, "why": f"cannot read the state: {exc!r}"}
        self.tmp.cleanup()
