"""Real network links for real-mode runs (``--links netns``): each worker behind its own shaped link.

Why: the emulated link (``--emulate-bandwidth``) is a sleep of bytes ÷ bandwidth inside the worker.
A real link adds what a sleep cannot: TCP flow control, a sender's queue that fills while a slow
link drains it, a cut that drops packets silently (no FIN, no RST, so only heartbeats can tell), and
a transfer time the daemon can measure. Linux gives all of it on one host, as root:

* every worker gets a network namespace of its own (``<run>-w<i>``), joined to the host's namespace
  (the *head side*, where the daemon runs) by a veth pair ``<run>h<i>`` (head end) / ``<run>w<i>``
  (worker end);
* both ends are shaped with ``tbf`` to the worker's bandwidth: the worker end's egress is its
  upload, the head end's egress its download;
* the daemon listens on one head address that lives on a veth pair of its own (``<run>hd`` /
  ``<run>hx``, both ends on the head side, never cut), so cutting one worker's link never takes the
  daemon's address away from the others;
* a cut (:meth:`NetnsLinks.down`) sets the head end down: packets are dropped silently both ways;
  :meth:`NetnsLinks.up` brings it back (the addresses, routes and qdiscs are kept).

Latency is not shaped: ``netem`` is not in every kernel (not in this host's), so latency stays
emulated by the worker; :func:`netem_available` says whether it could have been shaped.

**Addresses** come from the documentation range 198.51.100.0/24 only, so they cannot collide with a
real network, and nothing is routed anywhere else. The range is cut into /30 blocks: the run's head
address takes one block, each worker one more (head end ``4b+1``, worker end ``4b+2``). Blocks are
taken under a lock file from those no address on the head side uses, so concurrent runs get
disjoint blocks (at most 61 links at once).

**Clean by construction.** Every name starts with the run's name (``hetd`` + 6 random hex digits).
Before it creates anything, a run records its name and process in :data:`REGISTRY`; it removes
everything on :meth:`NetnsLinks.close` (called from ``finally``, at exit, and on SIGTERM/SIGHUP,
which are turned into :class:`SystemExit` while links are open). A run killed with SIGKILL leaves its
record behind; :func:`sweep` (every run calls it first) removes the namespaces and links of every
recorded run whose process is gone, matching by that run's exact name prefix and nothing broader.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import functools
import ipaddress
import json
import math
import os
import re
import secrets
import shutil
import signal
import subprocess
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

NETWORK = ipaddress.IPv4Network("198.51.100.0/24")  # RFC 5737 TEST-NET-2: never a real network
BLOCKS = range(1, 63)  # /30 blocks 4b..4b+3; 0 and 63 hold the /24's own .0 and .255
MAX_WORKERS = len(BLOCKS) - 1  # one block per worker, one for the head
REGISTRY = Path("/run/hetd-links")  # <run>.json per live run (tmpfs: gone at reboot, as netns are)
LOCK = Path("/run/lock/hetd-links.lock")
NAME_RE = re.compile(r"hetd[0-9a-f]{6}")  # a run's name; every object it makes starts with it
MIN_BURST = 16 * 1024  # bytes: a few MTU-sized packets
BURST_S = 0.002  # tbf bucket: 2 ms of the rate (at least MIN_BURST)
QUEUE_S = 0.1  # tbf queue: 100 ms of the rate (at least 64 KiB) before packets drop
IP_TIMEOUT_S = 20.0


class LinksError(RuntimeError):
    """An ``ip`` or ``tc`` command failed; the message has the command and its error."""


def _run(*argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=IP_TIMEOUT_S, check=False)
    if check and proc.returncode != 0:
        raise LinksError(f"{' '.join(argv)}: {proc.stderr.strip() or proc.returncode}")
    return proc


@functools.cache
def unavailable() -> str | None:
    """Why netns links cannot be made here (one line), or None when they can: they need root, the
    ``ip`` and ``tc`` commands, and a kernel that lets us make a namespace with a tbf qdisc (tried
    once per process on a throw-away namespace; a container without CAP_NET_ADMIN fails here)."""
    if os.geteuid() != 0:
        return "netns links need root (network namespaces, veth pairs, tc)"
    missing = [cmd for cmd in ("ip", "tc") if shutil.which(cmd) is None]
    if missing:
        return f"netns links need the {' and '.join(missing)} command(s) (iproute2)"
    why = _probe("tbf", "rate", "8mbit", "burst", "16kb", "limit", "65536")
    return None if why is None else f"netns links cannot be made here: {why}"


@functools.cache
def netem_available() -> bool:
    """Whether this kernel has ``netem`` (delay and loss); False where links cannot be made."""
    return unavailable() is None and _probe("netem", "delay", "1ms") is None


def _probe(*qdisc: str) -> str | None:
    """Make a throw-away namespace and put ``qdisc`` on its loopback; the error, or None."""
    probe = f"hetd{secrets.token_hex(3)}-probe"
    try:
        _run("ip", "netns", "add", probe)
        _run("ip", "netns", "exec", probe, "tc", "qdisc", "add", "dev", "lo", "root", *qdisc)
    except (LinksError, OSError, subprocess.SubprocessError) as exc:
        return str(exc)
    finally:
        _run("ip", "netns", "del", probe, check=False)
    return None


@dataclass(frozen=True)
class Link:
    """One worker's link: its namespace, the veth ends, their addresses, its rate (bytes/s, inf:
    not shaped)."""

    index: int
    netns: str
    head_if: str
    worker_if: str
    head_ip: str
    worker_ip: str
    rate: float


def _addr(block: int, host: int) -> str:
    return str(NETWORK.network_address + 4 * block + host)


def _used_blocks() -> set[int]:
    """/30 blocks of 198.51.100.0/24 that an address on the head side already uses."""
    out = _run("ip", "-4", "-o", "addr", "show").stdout
    used = set()
    for m in re.finditer(r"inet (\d+\.\d+\.\d+\.\d+)", out):
        ip = ipaddress.IPv4Address(m.group(1))
        if ip in NETWORK:
            used.add((int(ip) - int(NETWORK.network_address)) // 4)
    return used


def tbf_args(rate: float) -> list[str]:
    """``tc qdisc`` arguments (after ``dev X root``) shaping to ``rate`` bytes/s: rate in bits,
    a bucket of ``BURST_S`` of the rate, a queue of ``QUEUE_S`` of it."""
    if not (rate > 0 and math.isfinite(rate)):
        raise ValueError(f"a shaped link needs a finite rate > 0 bytes/s, got {rate}")
    burst = max(MIN_BURST, int(rate * BURST_S))
    limit = max(64 * 1024, int(rate * QUEUE_S)) + burst
    return ["tbf", "rate", f"{int(rate * 8)}bit", "burst", str(burst), "limit", str(limit)]


def _pid_start(pid: int) -> str | None:
    """The start time of process ``pid`` (field 22 of /proc/pid/stat), None when it is gone: with
    the pid, it tells a live run from a dead one whose pid was reused."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


@contextlib.contextmanager
def _locked() -> Iterator[None]:
    LOCK.parent.mkdir(parents=True, exist_ok=True)
    with LOCK.open("a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def remove_run(name: str) -> list[str]:
    """Delete every link on the head side and every namespace whose name starts with ``name`` (a
    run's exact name, :data:`NAME_RE`), then its record; returns what was removed. Deleting a veth
    end deletes its peer and both qdiscs; deleting a namespace's name frees it once no process is
    left in it (a worker still running in it keeps it, unnamed, until it exits)."""
    if not NAME_RE.fullmatch(name):
        raise ValueError(f"not a run name: {name!r}")
    removed = []
    for dev in re.findall(r"^\d+: ([^:@\s]+)", _run("ip", "-o", "link", "show").stdout, re.M):
        if dev.startswith(name) and _run("ip", "link", "del", dev, check=False).returncode == 0:
            removed.append(dev)
    for ns in _run("ip", "netns", "list").stdout.split("\n"):
        ns = ns.split(" ", 1)[0]
        if (
            ns.startswith(name + "-")
            and _run("ip", "netns", "del", ns, check=False).returncode == 0
        ):
            removed.append(ns)
    with contextlib.suppress(FileNotFoundError):
        (REGISTRY / f"{name}.json").unlink()
    return removed


def _alive(record: Path) -> bool:
    """Whether the run that wrote ``record`` still runs (its pid, with the same start time)."""
    try:
        info = json.loads(record.read_text())
        return bool(_pid_start(int(info["pid"])) == info["start"])
    except (OSError, ValueError, KeyError, TypeError):
        return False  # a torn record: its run died while writing it


def _records() -> list[Path]:
    if not REGISTRY.is_dir():
        return []
    return [r for r in sorted(REGISTRY.glob("hetd*.json")) if NAME_RE.fullmatch(r.stem)]


def sweep() -> dict[str, list[str]]:
    """Remove what runs killed without cleaning up (SIGKILL, power loss of the process) left: every
    recorded run whose process is gone, by its exact name prefix. Returns run name -> removed."""
    if unavailable() is not None:
        return {}
    with _locked():
        return {r.stem: remove_run(r.stem) for r in _records() if not _alive(r)}


def _names() -> list[str]:
    """Every link on the head side and every namespace, by name."""
    devs = re.findall(r"^\d+: ([^:@\s]+)", _run("ip", "-o", "link", "show").stdout, re.M)
    return devs + [ns.split(" ", 1)[0] for ns in _run("ip", "netns", "list").stdout.split("\n")]


def leftovers(name: str) -> list[str]:
    """Links and namespaces on this host whose names start with run ``name`` (empty when clean)."""
    return [x for x in _names() if x.startswith(name) and x]


def orphans() -> list[str]:
    """Links and namespaces named like a run's whose run is not running (what a sweep removes);
    for checks: nothing is removed."""
    live = {r.stem for r in _records() if _alive(r)}
    return [x for x in _names() if (m := NAME_RE.match(x)) and m.group(0) not in live]


class NetnsLinks:
    """The links of one run (see the module docstring). Use :func:`open_links`."""

    def __init__(self, rates: Sequence[float]) -> None:
        if not 1 <= len(rates) <= MAX_WORKERS:
            raise ValueError(f"netns links take 1 to {MAX_WORKERS} workers, got {len(rates)}")
        self.name = f"hetd{secrets.token_hex(3)}"
        self.rates = [float(r) for r in rates]
        self.links: list[Link] = []
        self.head = ""
        self._closed = False
        self._lock = threading.Lock()

    # --- making and removing --------------------------------------------------------------------

    def _open(self) -> None:
        with _locked():
            REGISTRY.mkdir(parents=True, exist_ok=True)
            record = {"pid": os.getpid(), "start": _pid_start(os.getpid())}
            (REGISTRY / f"{self.name}.json").write_text(json.dumps(record))
            free = [b for b in BLOCKS if b not in _used_blocks()]
            if len(free) < len(self.rates) + 1:
                raise LinksError(
                    f"198.51.100.0/24 has {len(free)} free /30 blocks on this host; "
                    f"{len(self.rates) + 1} are needed (other runs hold the rest)"
                )
            head_block, *blocks = free[: len(self.rates) + 1]
            self.head = _addr(head_block, 1)
            hd, hx = f"{self.name}hd", f"{self.name}hx"
            _run("ip", "link", "add", hd, "type", "veth", "peer", "name", hx)
            _run("ip", "addr", "add", f"{self.head}/32", "dev", hd)
            _run("ip", "link", "set", hx, "up")
            _run("ip", "link", "set", hd, "up")
            for i, (rate, block) in enumerate(zip(self.rates, blocks, strict=False)):
                self._make(i, rate, block)

    def _make(self, i: int, rate: float, block: int) -> None:
        ns, h, w = f"{self.name}-w{i}", f"{self.name}h{i}", f"{self.name}w{i}"
        link = Link(i, ns, h, w, _addr(block, 1), _addr(block, 2), rate)
        _run("ip", "netns", "add", ns)
        _run("ip", "link", "add", h, "type", "veth", "peer", "name", w, "netns", ns)
        _run("ip", "addr", "add", f"{link.head_ip}/30", "dev", h)
        _run("ip", "-n", ns, "addr", "add", f"{link.worker_ip}/30", "dev", w)
        _run("ip", "-n", ns, "link", "set", "lo", "up")
        _run("ip", "-n", ns, "link", "set", w, "up")
        _run("ip", "link", "set", h, "up")
        # The worker reaches the daemon's address through its own link, and nothing else.
        _run("ip", "-n", ns, "route", "add", f"{self.head}/32", "via", link.head_ip, "dev", w)
        if math.isfinite(rate):
            _run("tc", "qdisc", "add", "dev", h, "root", *tbf_args(rate))
            _run("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", w, "root", *tbf_args(rate))
        self.links.append(link)

    def close(self) -> None:
        """Remove everything this run made (idempotent; safe from a signal handler's exit)."""
        with self._lock:
            if self._closed:
                return
            remove_run(self.name)
            self._closed = True

    # --- using ----------------------------------------------------------------------------------

    def command(self, i: int, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside worker ``i``'s namespace."""
        return ["ip", "netns", "exec", self.links[i].netns, *argv]

    def down(self, i: int) -> None:
        """Cut worker ``i``'s link: every packet either way is dropped, silently."""
        _run("ip", "link", "set", self.links[i].head_if, "down")

    def up(self, i: int) -> None:
        """Mend worker ``i``'s link."""
        _run("ip", "link", "set", self.links[i].head_if, "up")

    def qdiscs(self, i: int) -> tuple[str, str]:
        """``tc qdisc show`` of worker ``i``'s head end and worker end (for checks and logs)."""
        link = self.links[i]
        head = _run("tc", "qdisc", "show", "dev", link.head_if).stdout
        worker = _run(
            "ip", "netns", "exec", link.netns, "tc", "qdisc", "show", "dev", link.worker_if
        )
        return head, worker.stdout

    def describe(self) -> dict[str, Any]:
        """What ``results.json`` records about the links of a run."""
        return {
            "kind": "netns",
            "shaping": "tbf both directions"
            if any(math.isfinite(r) for r in self.rates)
            else "none (unshaped veth)",
            "latency": "emulated (the worker sleeps; tbf shapes the rate only)",
            "head": self.head,
            "rates": [None if not math.isfinite(r) else r for r in self.rates],
        }


_SIGNALS = (signal.SIGTERM, signal.SIGHUP)


def _exit_on_signal(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)  # unwinds through every ``finally``: the links are removed


@contextlib.contextmanager
def open_links(rates: Sequence[float]) -> Iterator[NetnsLinks]:
    """Make one run's links (after sweeping dead runs' leftovers), yield them, remove them on the
    way out: normal exit, an exception, Ctrl-C, SIGTERM or SIGHUP (turned into SystemExit while the
    links are open, when called from the main thread), or interpreter exit."""
    reason = unavailable()
    if reason is not None:
        raise LinksError(reason)
    sweep()
    links = NetnsLinks(rates)
    atexit.register(links.close)
    old: dict[signal.Signals, Any] = {}
    if threading.current_thread() is threading.main_thread():
        for sig in _SIGNALS:
            old[sig] = signal.signal(sig, _exit_on_signal)
    try:
        links._open()
        yield links
    finally:
        try:
            links.close()
        finally:
            atexit.unregister(links.close)
            for sig, handler in old.items():
                signal.signal(sig, handler)
