"""A slow-client flood against a real ``hetd serve``, measured (not a test: run it by hand).

    python tests/integration/flood_measure.py REPO [SOCKETS] [PHASE_S] [FD_LIMIT] [MODE]

starts ``hetd serve`` from the checkout at REPO (digits, asp, file-descriptor limit FD_LIMIT,
default 1024, as on the machine of issue 35), one real ``hetd-worker`` process, and measures for
PHASE_S seconds each (default 20): before, during and after a flood of SOCKETS (default 300)
connections to the worker port that each send the start of a request and nothing more (one the
daemon closes is opened again after RECONNECT_S, as a persistent attacker would). During the flood a second real
worker is started for 10 pushes: the time until it has joined (or "never") is reported, and ``/healthz`` on the
worker port is probed once a second. Prints one JSON object: per phase the daemon's RSS (MB), its
open file descriptors, the first worker's pushes per second, the healthz answers and the bytes the
daemon logged.

MODE ``hello`` (the default is ``slow``) floods with SOCKETS concurrent clients that each join as a
worker (token, ``hello``, ``welcome``) and leave at once, over and over; the daemon then runs with a
state directory, and each phase ends with a checkpoint whose size is reported (what the departed
workers left behind).
"""

from __future__ import annotations

import asyncio
import json
import os
import resource
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from typing import Any

HALF = b"GET /healthz HTTP/1.1\r\nHost: hetd\r\nX-Slow: "
RECONNECT_S = 0.5  # an attacker socket the daemon closed is opened again after this long


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def get(url: str, token: str | None = None, timeout: float = 5.0) -> Any:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def cpu_s(pid: int) -> float:
    """CPU seconds (user and system) a process has used."""
    with open(f"/proc/{pid}/stat") as fh:
        fields = fh.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def own_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def fds(pid: int) -> int:
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return -1


class Flood:
    """``n`` sockets that each send half a request, re-opened when the daemon closes them."""

    def __init__(self, port: int, n: int) -> None:
        self.port, self.n = port, n
        self.opened = self.closed_by_daemon = self.refused = 0
        self.tasks: list[asyncio.Task[None]] = []

    async def one(self) -> None:
        while True:
            try:
                reader, writer = await asyncio.open_connection("127.0.0.1", self.port)
            except OSError:
                self.refused += 1
                await asyncio.sleep(0.1)
                continue
            self.opened += 1
            try:
                writer.write(HALF)
                await writer.drain()
                await reader.read()  # until the daemon closes it
                self.closed_by_daemon += 1
            except OSError:
                self.closed_by_daemon += 1
            finally:
                writer.close()
            await asyncio.sleep(RECONNECT_S)

    def start(self) -> None:
        self.tasks = [asyncio.create_task(self.one()) for _ in range(self.n)]

    async def stop(self) -> None:
        for t in self.tasks:
            t.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)


class HelloFlood(Flood):
    """``n`` clients that each join as a worker and leave at once, over and over."""

    def __init__(self, port: int, n: int, token: str) -> None:
        super().__init__(port, n)
        self.token = token

    async def one(self) -> None:
        import aiohttp

        from hetd.protocol import wire

        hello = wire.encode("hello", 1, name="flood", device={}, codecs=["none"])
        url = f"ws://127.0.0.1:{self.port}/v1/ws"
        auth = {"Authorization": f"Bearer {self.token}"}
        async with aiohttp.ClientSession() as http:
            while True:
                try:
                    async with http.ws_connect(url, headers=auth, max_msg_size=0) as ws:
                        await ws.send_bytes(hello)
                        async for frame in ws:  # until the welcome
                            if wire.decode(frame.data).type == "welcome":
                                break
                    self.opened += 1
                except (TimeoutError, OSError, aiohttp.ClientError):
                    self.refused += 1
                    await asyncio.sleep(0.1)


async def main() -> None:
    repo = os.path.abspath(sys.argv[1])
    n = int(sys.argv[2]) if len(sys.argv) > 2 else 300
    phase_s = float(sys.argv[3]) if len(sys.argv) > 3 else 20.0
    fd_limit = int(sys.argv[4]) if len(sys.argv) > 4 else 1024
    mode = sys.argv[5] if len(sys.argv) > 5 else "slow"
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    state = tempfile.mkdtemp(prefix="hetd-flood-state-")
    resource.setrlimit(resource.RLIMIT_NOFILE, (20000, 20000))  # the attacker's own
    wt, at = secrets.token_urlsafe(24), secrets.token_urlsafe(24)
    port, admin = free_port(), free_port()
    env = {
        **os.environ,
        "HETD_WORKER_TOKEN": wt,
        "HETD_ADMIN_TOKEN": at,
        "JAX_PLATFORMS": "cpu",
        "PYTHONPATH": repo,
        "XLA_FLAGS": "--xla_cpu_multi_thread_eigen=false",
    }
    fd, log_path = tempfile.mkstemp(prefix="hetd-flood-", suffix=".log")

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (fd_limit, fd_limit))

    daemon = subprocess.Popen(
        [
            *(sys.executable, "-m", "hetd", "serve", "--dataset", "digits", "--policy", "asp"),
            *("--port", str(port), "--admin-port", str(admin)),
            *(("--state-dir", state) if mode == "hello" else ()),
        ],
        cwd=repo,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=fd,
        preexec_fn=limit,
    )
    workers: list[subprocess.Popen[bytes]] = []
    admin_url = f"http://127.0.0.1:{admin}"

    def worker(name: str, *args: str) -> subprocess.Popen[bytes]:
        proc = subprocess.Popen(
            [sys.executable, "-m", "workers.cli", f"ws://127.0.0.1:{port}", "--name", name, *args],
            cwd=repo,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        workers.append(proc)
        return proc

    def rows() -> list[dict[str, Any]]:
        body = get(admin_url + "/v1/workers", at)
        return list(body["workers"])

    def pushes(name: str) -> int:
        return sum(int(w.get("pushes", 0)) for w in rows() if w["name"] == name)

    result: dict[str, Any] = {
        "repo": repo,
        "mode": mode,
        "sockets": n,
        "phase_s": phase_s,
        "fd_limit": fd_limit,
    }
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if get(admin_url + "/healthz", timeout=2)["ready"]:
                    break
            except OSError:
                pass
            await asyncio.sleep(0.5)
        worker("real")
        while pushes("real") < 50:
            await asyncio.sleep(0.5)

        async def phase(name: str, during: Flood | None = None) -> dict[str, Any]:
            loop = asyncio.get_running_loop()
            log0 = os.path.getsize(log_path)
            t0 = time.monotonic()
            try:
                p0: int | None = await asyncio.to_thread(pushes, "real")
            except OSError:  # the admin API does not answer (no file descriptor left)
                p0 = None
            cpu0, own0 = cpu_s(daemon.pid), own_cpu_s()
            joined: float | None = None
            # (it makes a few pushes and leaves: the first worker trains alone again after)
            late = worker("late", "--steps", "10") if during is not None else None
            health = {"ok": 0, "failed": 0, "slowest_s": 0.0}
            max_fds, max_rss = 0, 0.0
            while time.monotonic() - t0 < phase_s:
                t = loop.time()
                try:
                    await asyncio.to_thread(get, f"http://127.0.0.1:{port}/healthz", None, 5.0)
                    health["ok"] += 1
                    health["slowest_s"] = max(health["slowest_s"], round(loop.time() - t, 3))
                except OSError:
                    health["failed"] += 1
                max_fds, max_rss = max(max_fds, fds(daemon.pid)), max(max_rss, rss_mb(daemon.pid))
                if late is not None and joined is None:
                    try:
                        if any(w["name"] == "late" for w in await asyncio.to_thread(rows)):
                            joined = time.monotonic() - t0
                        elif late.poll() is not None:  # came and went between two looks
                            joined = time.monotonic() - t0 if late.returncode == 0 else None
                    except OSError:
                        pass
                await asyncio.sleep(max(0.0, 1.0 - (loop.time() - t)))
            rate: float | str = "admin API unreachable at the start"
            try:
                p1 = await asyncio.to_thread(pushes, "real")
                if p0 is not None:
                    rate = round((p1 - p0) / (time.monotonic() - t0), 1)
            except OSError as exc:
                rate = f"admin API unreachable: {exc}"
            spent = time.monotonic() - t0
            out: dict[str, Any] = {
                "real_worker_pushes_per_s": rate,
                "daemon_cpu_share": round((cpu_s(daemon.pid) - cpu0) / spent, 2),
                "measuring_process_cpu_share": round((own_cpu_s() - own0) / spent, 2),
                "daemon_rss_mb_end": round(rss_mb(daemon.pid), 1),
                "daemon_rss_mb_max": round(max_rss, 1),
                "daemon_open_fds_max": max_fds,
                "healthz_worker_port": health,
                "log_bytes": os.path.getsize(log_path) - log0,
            }
            if late is not None:
                out["late_worker_joined_after_s"] = (
                    round(joined, 1) if joined is not None else "never"
                )
            if mode == "hello":
                req = urllib.request.Request(
                    admin_url + "/v1/checkpoint",
                    method="POST",
                    headers={"Authorization": f"Bearer {at}"},
                )
                try:
                    await asyncio.to_thread(urllib.request.urlopen, req, None, 60)
                    newest = max(
                        (os.path.join(d, f) for d, _, fs in os.walk(state) for f in fs),
                        key=os.path.getmtime,
                    )
                    out["checkpoint_bytes"] = os.path.getsize(newest)
                except (OSError, ValueError) as exc:
                    out["checkpoint_bytes"] = f"no checkpoint: {exc}"
            if during is not None:
                out["flood"] = {
                    "opened": during.opened,
                    "closed_by_daemon": during.closed_by_daemon,
                    "connect_failed": during.refused,
                }
            return out

        result["before"] = await phase("before")
        flood = HelloFlood(port, n, wt) if mode == "hello" else Flood(port, n)
        flood.start()
        await asyncio.sleep(2.0)  # the flood is up
        result["during"] = await phase("during", flood)
        await flood.stop()
        result["after"] = await phase("after")
    finally:
        for p in [*workers, daemon]:
            p.send_signal(signal.SIGTERM)
        for p in [*workers, daemon]:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
        result["daemon_log"] = log_path
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    asyncio.run(main())
