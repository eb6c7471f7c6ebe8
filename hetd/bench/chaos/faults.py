"""The chaos run's faults: the seeded plan, and each fault done to a running :class:`Cluster`.

Owns :class:`Fault`, :func:`schedule` and :class:`Faulter`. One fault every ``fault_every`` s,
drawn with the seed from: SIGKILL a worker (a replacement is started at once), SIGSTOP a worker
for a *stall* (20 s, scaled down to 0.4 x the fault period for short runs) then SIGCONT, and *cut*
a worker's connection; and exactly one SIGKILL of the daemon mid-run, restarted at once on the
same ports and state directory (the workers reconnect with their own backoff and resume their
ids). A worker already under a fault is not chosen again: the fault goes to a free one.

**The cut** on loopback drops the worker's socket: its connection to the daemon is destroyed in
the kernel (``ss -K``), both ends see a reset mid-stream (a push or a params frame may be half
sent), the daemon drops the session and the worker reconnects with ``resume`` after its backoff.
Where ``ss`` cannot destroy sockets (not root, or a kernel without socket destroy) the cut falls
back to a silent partition: the worker is SIGSTOPped for the daemon's heartbeat timeout + 1.5 s, the
daemon hears nothing and drops the session, and on SIGCONT the worker finds its socket closed and
reconnects (``how`` in the fault's record says so). The heartbeat timeout is set to the stall + 3 s,
so a stall is a pure stall and never drops the worker.

**The cut with --links netns** (root): every worker runs in a network namespace of its own behind
an unshaped veth pair (:mod:`hetd.bench.links`) and the daemon listens on the run's head address; a
cut sets that worker's link down for the same time, then up: packets are dropped silently both
ways (no FIN, no RST), so the daemon notices through heartbeats alone, and the worker finds its
connection dead once the link is back and resumes its id.

**A pserver kill** (``--pservers S``, drawn beside the worker faults, and at least one in every
plan): SIGKILL one of the daemon's pserver processes, its pid read from ``/v1/status``
(``decisions.processes``). The daemon's local supervisor starts it again on its directory; the
fault ends once the new process is connected to the head's link, and its record keeps the pid
killed, the new pid and how long each step took.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal
import subprocess
import time
from dataclasses import dataclass, field
from typing import Any

from hetd.bench.chaos import pservers
from hetd.bench.chaos.cluster import ChaosOptions, Cluster
from hetd.local.procs import wait_ready

KINDS = ("kill_worker", "stall_worker", "cut_worker")
PSERVER_KINDS = (*KINDS, "kill_pserver")  # with --pservers S >= 1


@dataclass
class Fault:
    """One planned fault and what happened."""

    at_s: float  # planned, from the run's t = 0
    kind: str  # kill_worker | stall_worker | cut_worker | kill_daemon | kill_pserver
    slot: int = -1  # the worker slot; kill_pserver: the pserver's slice (-1: the daemon)
    injected_s: float | None = None
    ended_s: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def schedule(opts: ChaosOptions) -> list[Fault]:
    """The seeded fault plan: one fault every ``fault_every`` s, the middle one the daemon kill;
    with pservers, pserver kills drawn too, and the first other fault made one if none was."""
    if opts.pservers < 0:
        raise ValueError(f"--pservers must be >= 0, got {opts.pservers}")
    rng = random.Random(opts.seed)
    times = []
    t = opts.fault_every
    while t < opts.duration_s - 1e-9:
        times.append(t)
        t += opts.fault_every
    if not times:
        raise ValueError("--fault-every must be shorter than the run (--minutes)")
    daemon_at = len(times) // 2
    kinds = PSERVER_KINDS if opts.pservers else KINDS
    faults = []
    for i, at in enumerate(times):
        if i == daemon_at:
            faults.append(Fault(at, "kill_daemon"))
            continue
        kind = rng.choice(kinds)
        slots = opts.pservers if kind == "kill_pserver" else opts.workers
        faults.append(Fault(at, kind, rng.randrange(slots)))
    others = [f for f in faults if f.kind != "kill_daemon"]
    if opts.pservers and not any(f.kind == "kill_pserver" for f in faults):
        if not others:
            raise ValueError("--pservers needs a run of at least two faults (--fault-every)")
        others[0].kind, others[0].slot = "kill_pserver", rng.randrange(opts.pservers)
    return faults


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


class Faulter:
    """Does a run's faults to its cluster, each at its time, and records on each what happened
    (``injected_s``, ``ended_s`` and ``extra``)."""

    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster
        self.paused: set[int] = set()  # worker slots under a fault now

    async def run(self, faults: list[Fault]) -> None:
        """Inject every fault at its planned time; return once each has ended."""
        c = self.cluster
        tasks = []
        for f in faults:
            delay = c.t0 + f.at_s - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(self.inject(f)))
        await asyncio.gather(*tasks)

    def _now(self) -> float:
        return time.monotonic() - self.cluster.t0

    async def inject(self, f: Fault) -> None:
        """Do one fault and wait for its end (a stall's or a cut's hold, a restart)."""
        c = self.cluster
        f.injected_s = self._now()
        if f.kind == "kill_daemon":
            await self._kill_daemon(f)
            return
        if f.kind == "kill_pserver":
            await self._kill_pserver(f)
            return
        slot = f.slot
        if slot in self.paused:  # that worker is already under a fault: take a free one
            free = [i for i in range(c.opts.workers) if i not in self.paused]
            if not free:
                f.extra["skipped"] = "every worker is under a fault"
                return
            slot = f.slot = free[0]
        proc = c.workers[slot]
        if f.kind == "kill_worker":
            proc.kill()
            await proc.wait()
            c.workers[slot] = await c.spawn_worker(slot)
            f.ended_s = self._now()
            return
        if f.kind == "cut_worker" and c.net is None:
            dropped = await asyncio.to_thread(drop_sockets, proc.pid, c.port)
            if dropped:  # the real cut: the socket is reset, the worker reconnects at once
                f.extra["sockets_dropped"] = dropped
                f.ended_s = self._now()
                return
            f.extra["how"] = "partition (ss -K unavailable)"
        hold = c.opts.stall_s if f.kind == "stall_worker" else c.opts.heartbeat_timeout_s + 1.5
        f.extra["held_s"] = hold
        self.paused.add(slot)
        if f.kind == "cut_worker" and c.net is not None:  # a real partition: the link goes down
            f.extra["link_down"] = True
            try:
                c.net.down(slot)
                await asyncio.sleep(hold)
            finally:
                c.net.up(slot)
                self.paused.discard(slot)
            f.ended_s = self._now()
            return
        try:
            proc.send_signal(signal.SIGSTOP)
            await asyncio.sleep(hold)
        finally:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGCONT)
            self.paused.discard(slot)
        f.ended_s = self._now()

    async def _kill_daemon(self, f: Fault) -> None:
        """SIGKILL the daemon and restart it at once; the versions before and after, and the
        update rate before (what one checkpoint interval may lose)."""
        c = self.cluster
        assert c.daemon is not None and f.injected_s is not None
        s = await c.status()
        before = int(s["version"]) if isinstance(s, dict) else c.series[-1][1]
        c.daemon.kill()
        await c.daemon.wait()
        f.extra["version_before"] = before
        f.extra["rate_before"] = c.rate(f.injected_s - 5.0, f.injected_s)
        await c.start_daemon()

        async def answers() -> bool:
            s = await c.status()
            if isinstance(s, dict):
                f.extra["version_after"] = int(s["version"])
            return isinstance(s, dict)

        assert c.daemon is not None
        await wait_ready(
            answers,
            c.daemon,
            timeout=None,
            interval=0.1,
            name=f"the restarted daemon (logs in {c.logs})",
        )
        f.extra["restart_s"] = round(self._now() - f.injected_s, 3)
        f.ended_s = self._now()

    async def _kill_pserver(self, f: Fault) -> None:
        """SIGKILL pserver ``f.slot``'s process and wait (at most
        :data:`~hetd.bench.chaos.pservers.RESTART_WAIT_S`) until the daemon shows a new process
        for it connected to its link: the pids, and when each was seen."""
        c = self.cluster
        assert f.injected_s is not None
        row = pservers.process_row(await c.status(), f.slot)
        pid = None if row is None else row.get("pid")
        if not isinstance(pid, int) or pid <= 0:  # the daemon down, or that pserver restarting
            f.extra["skipped"] = "no running process for that pserver"
            f.ended_s = self._now()
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        f.extra["pid_killed"] = pid
        f.extra["pid_new"] = None
        deadline = time.monotonic() + pservers.RESTART_WAIT_S
        while time.monotonic() < deadline:
            s = await c.status()
            row = pservers.process_row(s, f.slot)
            new = None if row is None else row.get("pid")
            if isinstance(new, int) and new > 0 and new != pid:
                if f.extra["pid_new"] is None:
                    f.extra["pid_new"] = new
                    f.extra["new_pid_s"] = round(self._now() - f.injected_s, 3)
                if f.slot in pservers.connected(s):
                    f.extra["reconnected_s"] = round(self._now() - f.injected_s, 3)
                    break
            await asyncio.sleep(0.2)
        f.ended_s = self._now()
