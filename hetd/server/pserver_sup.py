"""The local process backend for pservers (``[pservers] backend = "local"``): the daemon spawns its
S ``hetd pserver`` processes, one per slice, each on its own directory, and supervises them.

A process that exits while the daemon runs is started again on the same directory (it reloads
its newest saved slice and its parts file, and catches up from the log), after a backoff that
doubles with each quick exit in a row (:class:`RestartPolicy`). A process that exits quickly
``max_fails`` times in a row, or with status 3 (its slice cannot go on: restarting will not
help), is not started again: its slot says ``failed`` with the last exit status, and the daemon
logs why. :meth:`LocalPservers.stop` sends SIGTERM (a pserver stops with its saved slices and
parts file as they are) and SIGKILL to any still running after the timeout.

Each process gets ``--parent`` with the daemon's pid, so it stops when the daemon dies without
stopping it (Linux), and never outlives it to share its directory with the next daemon's process.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger("hetd.server.pservers")

EXIT_BROKEN = 3  # hetd pserver's status for a slice that cannot go on (server/pserver_proc)
LOG_FILE = "pserver.log"  # each process's stderr, appended, in its directory


def pserver_command(head: tuple[str, int], server: int, directory: Path) -> list[str]:
    """The command line of slice ``server``'s pserver, following the head's link at ``head`` and
    keeping its slice in ``directory`` (whichever backend runs it)."""
    host, port = head
    return [
        sys.executable, "-m", "hetd", "pserver", "--head", f"{host}:{port}",
        "--slice", str(server), "--dir", str(directory),
    ]  # fmt: skip


@dataclass(frozen=True)
class RestartPolicy:
    """When a process that exited is started again."""

    backoff_s: float = 0.5  # wait before the first restart after a quick exit
    max_backoff_s: float = 10.0  # the wait doubles per quick exit in a row, up to this
    stable_s: float = 30.0  # a process that ran this long exited "not quickly": the count resets
    max_fails: int = 5  # quick exits in a row before the slot is given up (reported, not restarted)


class Slot:
    """One slice's process and its history."""

    def __init__(self, server: int, directory: Path) -> None:
        self.server = server
        self.directory = directory
        self.proc: asyncio.subprocess.Process | None = None
        self.state = "starting"  # starting, running, waiting (backoff), failed, stopped
        self.restarts = 0  # starts after the first
        self.fails = 0  # quick exits in a row
        self.last_exit: int | None = None
        self.reason = ""  # why a failed slot was given up

    def describe(self) -> dict[str, Any]:
        running = self.proc is not None and self.proc.returncode is None
        return {
            "slice": self.server,
            "pid": self.proc.pid if running and self.proc is not None else None,
            "state": self.state,
            "restarts": self.restarts,
            "last_exit": self.last_exit,
            "dir": str(self.directory),
        }


class LocalPservers:
    """S pserver processes on this host, following the head's link at ``head``."""

    def __init__(
        self,
        head: tuple[str, int],
        root: Path,
        servers: int,
        policy: RestartPolicy | None = None,
    ) -> None:
        self.head = head
        self.root = root
        self.policy = policy or RestartPolicy()
        self.slots = [Slot(s, root / f"slice{s}") for s in range(servers)]
        self._tasks: list[asyncio.Task[None]] = []
        self._stopping = False
        self._wake = asyncio.Event()  # set by stop: a backoff wait ends at once

    def command(self, slot: Slot) -> list[str]:
        return [
            *pserver_command(self.head, slot.server, slot.directory),
            "--parent",
            str(os.getpid()),
        ]

    async def start(self) -> None:
        """Start every process (their directories made) and their supervisors."""
        for slot in self.slots:
            slot.directory.mkdir(parents=True, exist_ok=True)
        for slot in self.slots:
            await self._spawn(slot)
            self._tasks.append(
                asyncio.create_task(self._supervise(slot), name=f"hetd-pserver-{slot.server}")
            )

    async def _spawn(self, slot: Slot) -> None:
        with open(slot.directory / LOG_FILE, "ab") as err:  # the child keeps its own descriptor
            slot.proc = await asyncio.create_subprocess_exec(
                *self.command(slot),
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.DEVNULL,
                stderr=err,
                start_new_session=True,  # a terminal's Ctrl-C reaches the daemon, which stops them
            )
        slot.state = "running"
        log.info("pserver %d started (pid %d)", slot.server, slot.proc.pid)

    async def _supervise(self, slot: Slot) -> None:
        policy = self.policy
        while True:
            proc = slot.proc
            assert proc is not None
            began = time.monotonic()
            status = await proc.wait()
            slot.last_exit = status
            if self._stopping:
                slot.state = "stopped"
                return
            ran = time.monotonic() - began
            slot.fails = 0 if ran >= policy.stable_s else slot.fails + 1
            tail = f"(its log: {slot.directory / LOG_FILE})"
            if status == EXIT_BROKEN:
                slot.reason = "its slice cannot go on (status 3)"
            elif slot.fails >= policy.max_fails:
                slot.reason = f"exited {slot.fails} times in a row within {policy.stable_s:g} s"
            if slot.reason:
                slot.state = "failed"
                log.error("pserver %d is not restarted: %s %s", slot.server, slot.reason, tail)
                return
            wait = min(policy.max_backoff_s, policy.backoff_s * 2 ** max(0, slot.fails - 1))
            wait = wait if slot.fails else 0.0
            log.warning(
                "pserver %d exited with status %d after %.1f s; restarting in %.1f s %s",
                slot.server,
                status,
                ran,
                wait,
                tail,
            )
            slot.state = "waiting"
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), wait)
            if self._stopping:
                slot.state = "stopped"
                return
            try:
                await self._spawn(slot)
            except OSError as exc:
                slot.state = "failed"
                slot.reason = f"cannot start: {exc}"
                log.error("pserver %d is not restarted: %s", slot.server, slot.reason)
                return
            slot.restarts += 1

    def describe(self) -> list[dict[str, Any]]:
        return [slot.describe() for slot in self.slots]

    async def stop(self, timeout: float) -> None:
        """SIGTERM to every running process, SIGKILL to those still running after ``timeout``;
        their supervisors end. A second call does nothing more."""
        self._stopping = True
        self._wake.set()
        running = [s.proc for s in self.slots if s.proc is not None and s.proc.returncode is None]
        for proc in running:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for proc in running:
            try:
                await asyncio.wait_for(proc.wait(), max(0.1, deadline - time.monotonic()))
            except TimeoutError:
                log.warning("pserver pid %d did not stop within %.0f s: killed", proc.pid, timeout)
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                await proc.wait()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks.clear()
