"""The state directory's lock: one daemon at a time writes checkpoints into a directory.

Two daemons sharing a state directory would each write checkpoints of their own training into it,
and a restart would resume whichever file ranks newest, losing the other's updates. So a daemon
takes an exclusive ``flock`` on ``<dir>/hetd.lock`` before it listens and holds it until it has
written its last checkpoint; a second daemon pointed at the same directory gets
:class:`StateDirBusy`, naming the holder (pid, host, ports) that the lock file records, and
``hetd serve`` exits 2. The lock is the kernel's: it goes away with the process however that ends
(SIGKILL included), so a stale lock file never blocks a restart. The file itself is left in place
(deleting it would let a third daemon lock a new file while the second still holds the old one).

Only the standard library: the lock is taken before JAX loads (start-up is quick to refuse).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import time
from pathlib import Path
from typing import Any

LOCK_NAME = "hetd.lock"


class StateDirError(Exception):
    """The state directory cannot be used: restarting will not help (``hetd serve`` exits 2)."""


class StateDirBusy(StateDirError):
    """Another running daemon holds the state directory's lock."""

    def __init__(self, directory: Path, holder: dict[str, Any]) -> None:
        self.directory, self.holder = directory, holder
        super().__init__(
            f"the state directory {directory} is in use by another hetd daemon ({describe(holder)}):"
            " stop that daemon, or give this one a --state-dir ([store] dir) of its own"
        )


def describe(holder: dict[str, Any]) -> str:
    """The holder as the lock file records it, for a person: pid, host, ports, since when."""
    if not holder:
        return "no details recorded yet: it is starting"
    parts = [f"pid {holder.get('pid', '?')}"]
    if holder.get("host"):
        parts[0] += f" on {holder['host']}"
    if holder.get("worker_port") is not None:
        parts.append(f"workers on port {holder['worker_port']}")
    admin = holder.get("admin_port", "")
    if admin is None:
        parts.append("admin API off")
    elif admin != "":
        parts.append(f"admin API on port {admin}")
    if holder.get("since_unix"):
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(holder["since_unix"])))
        parts.append(f"since {since}")
    return ", ".join(parts)


class StateDirLock:
    """An exclusive lock on a state directory, held by this process until :meth:`release`."""

    def __init__(self, directory: Path, fd: int) -> None:
        self.directory = directory
        self.path = directory / LOCK_NAME
        self._fd: int | None = fd
        self._facts: dict[str, Any] = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "since_unix": time.time(),
        }
        self._write()

    @classmethod
    def acquire(cls, directory: str | os.PathLike[str]) -> StateDirLock:
        """Lock ``directory`` (created when missing). :class:`StateDirBusy` when another process
        holds it; :class:`StateDirError` when the directory cannot be made or written."""
        path = Path(directory)
        try:
            path.mkdir(parents=True, exist_ok=True)
            fd = os.open(path / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o600)
        except OSError as exc:
            raise StateDirError(
                f"the state directory {path} cannot be used: {exc.strerror or exc}"
            ) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read(fd)
            os.close(fd)
            raise StateDirBusy(path, holder) from None
        except OSError as exc:  # a file system without locks: say so, never run unguarded
            os.close(fd)
            raise StateDirError(f"cannot lock the state directory {path}: {exc}") from None
        return cls(path, fd)

    def note(self, **facts: Any) -> None:
        """Record more about the holder (its ports, once bound) for a daemon that is refused."""
        self._facts.update(facts)
        self._write()

    def _write(self) -> None:
        if self._fd is None:
            return
        data = (json.dumps(self._facts, sort_keys=True) + "\n").encode()
        with contextlib.suppress(OSError):  # the lock is what matters; the facts only help
            os.ftruncate(self._fd, 0)
            os.pwrite(self._fd, data, 0)

    def release(self) -> None:
        """Give the directory up (a second call does nothing)."""
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        with contextlib.suppress(OSError):
            os.ftruncate(fd, 0)
        os.close(fd)  # closing the descriptor drops the flock


def _read(fd: int) -> dict[str, Any]:
    """What the holder recorded ({} while it has written nothing yet)."""
    try:
        raw = os.pread(fd, 4096, 0)
        facts = json.loads(raw.decode()) if raw.strip() else {}
    except (OSError, ValueError):
        return {}
    return facts if isinstance(facts, dict) else {}
