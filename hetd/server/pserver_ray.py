"""The Ray backend for pservers (``[pservers] backend = "ray"``, ``pip install 'hetd[ray]'``).

Each slice is a named, detached Ray actor (``hetd-pserver-<I>`` in namespace ``hetd``) that runs
the same ``hetd pserver`` command the local backend spawns, as its child, on the same directory
(``<[store] dir>/pservers/slice<I>``). When the child exits the actor exits with it, and Ray
restarts the actor (up to :data:`MAX_RESTARTS` times), which starts the command again: the
pserver reloads its newest saved slice and its parts file, takes its old port again and catches
up from the log, exactly as under the local supervisor. A child that exits with status 3 (its
slice cannot go on) leaves its actor up and reported ``failed``: restarting would not help.

Ray places, restarts and finds the processes; it carries no tensor and orders nothing: the parts
go from the workers to the pservers' own ports, the log from the head's link. When the placement
group ``hetd`` exists (``hetd cluster up`` makes it) the actors take its last S bundles; without
it they are pinned to the head's node. The head's link listens on loopback only (it carries no
token yet), so outside a test of fake nodes on one host the group is packed on one node.

Ray is imported here and nowhere else in hetd: a plain install has no Ray and needs none.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from hetd.server.pserver_sup import EXIT_BROKEN, LOG_FILE, pserver_command

log = logging.getLogger("hetd.server.pservers")

NAMESPACE = "hetd"  # the Ray namespace of hetd's actors and placement group
GROUP = "hetd"  # the placement group's name: bundle 0 the head (hetd cluster up), then the slices
HEAD = "hetd-head"  # the head's actor (hetd cluster up)
MAX_RESTARTS = 20  # restarts of one pserver's actor before Ray gives it up
POLL_S = 0.5  # how often the daemon asks each actor how it stands
PORT_WAIT_S = 15.0  # a restarted actor waits this long for its old port to be free


def pserver_name(server: int) -> str:
    return f"hetd-pserver-{server}"


def load_ray() -> Any:
    """The ``ray`` module, or an error that says how to install it."""
    try:
        return importlib.import_module("ray")
    except ImportError:
        raise RuntimeError(
            "the ray backend needs Ray, which a plain install leaves out: pip install 'hetd[ray]'"
        ) from None


def _die_with_parent() -> None:  # pragma: no cover - runs in the child, between fork and exec
    """The child gets SIGTERM when the actor's thread that started it ends (Linux)."""
    if sys.platform.startswith("linux"):
        import ctypes
        import signal

        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM), 0, 0, 0)


def _wait_port_free(port_file: Path, timeout: float) -> None:
    """Wait until the port named in ``port_file`` can be bound on loopback (the process that had
    it, stopping with the actor it belonged to, has let it go), at most ``timeout`` s."""
    try:
        port = int(port_file.read_text().strip())
    except (OSError, ValueError):
        return
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(("127.0.0.1", port))
                return
            except OSError:
                pass
        time.sleep(0.1)


class ProcessActor:
    """A Ray actor that runs one hetd command as its child and lives as long as it does.

    The child is started by a thread of the actor that waits for it (so the child's parent-death
    signal follows the actor). If the child exits while the actor was not told to stop, and not
    with status 3, the actor process exits too and Ray restarts it, which starts the child again.

    ``nice``: the child's niceness, that of the process that placed the actor. Ray runs its
    workers at a niceness of its own (15 by default), which a child would inherit: a pserver on
    the data path would then wait behind the head and the workers for a core, as one the local
    backend starts does not. Where the child may not be given a lower niceness than the actor's
    (no CAP_SYS_NICE, RLIMIT_NICE), :meth:`info` says why.
    """

    def __init__(
        self,
        argv: list[str],
        log_path: str,
        port_file: str = "",
        env: dict[str, str] | None = None,
        nice: int | None = None,
    ) -> None:
        Path(log_path).parent.mkdir(parents=True, exist_ok=True)
        if port_file:
            _wait_port_free(Path(port_file), PORT_WAIT_S)
        self.argv = argv
        self.stopping = False
        self.status: int | None = None
        self.proc: subprocess.Popen[bytes] | None = None
        self.error = ""
        self.nice = nice
        self.nice_error = ""  # why the child kept another niceness than ``nice``
        started = threading.Event()
        environ = dict(os.environ, **(env or {}))
        threading.Thread(
            target=self._run, args=(log_path, environ, started), daemon=True, name="hetd-child"
        ).start()
        started.wait()
        if self.proc is None:
            raise RuntimeError(f"cannot start {' '.join(argv)}: {self.error}")

    def _run(self, log_path: str, env: dict[str, str], started: threading.Event) -> None:
        try:
            with open(log_path, "ab") as err:
                self.proc = subprocess.Popen(
                    self.argv,
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                    stderr=err,
                    env=env,
                    preexec_fn=_die_with_parent,  # prctl only, before exec
                    # a session of its own, as the local backend's: where the kernel groups a
                    # session's processes for CPU shares (autogroup), the pserver would otherwise
                    # share one group with Ray's processes and whatever started Ray
                    start_new_session=True,
                )
        except OSError as exc:
            self.error = str(exc)
            return
        finally:
            if self.proc is not None and self.nice is not None:
                try:
                    os.setpriority(os.PRIO_PROCESS, self.proc.pid, self.nice)
                except OSError as exc:
                    self.nice_error = f"niceness {self.nice}: {exc}"
            started.set()
        self.status = self.proc.wait()
        if not self.stopping and self.status != EXIT_BROKEN:
            os._exit(1)  # Ray restarts this actor, which starts the command again

    def info(self) -> dict[str, Any]:
        proc = self.proc
        return {
            "pid": os.getpid(),
            "node": importlib.import_module("ray").get_runtime_context().get_node_id(),
            "child": proc.pid if proc is not None else None,
            "status": self.status,
            "nice_error": self.nice_error,
        }

    def stop(self, timeout: float) -> int | None:
        """SIGTERM to the child, SIGKILL after ``timeout``; its exit status."""
        self.stopping = True
        proc = self.proc
        if proc is None:
            return None
        with contextlib.suppress(ProcessLookupError):
            proc.terminate()
        try:
            return proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            return proc.wait()


def remote_actor(ray: Any) -> Any:
    """:class:`ProcessActor` as a Ray actor class."""
    return ray.remote(ProcessActor)


def place(ray: Any, bundles: int, strategy: str = "STRICT_PACK", timeout: float = 120.0) -> Any:
    """Make the detached placement group ``hetd`` of ``bundles`` bundles of one CPU each (the head's
    first when ``hetd cluster up`` places it, then one per slice) and wait until Ray reserved it."""
    pg = ray.util.placement_group(
        [{"CPU": 1}] * bundles, strategy=strategy, name=GROUP, lifetime="detached"
    )
    try:
        ray.get(pg.ready(), timeout=timeout)
    except Exception:
        ray.util.remove_placement_group(pg)
        raise OSError(
            f"Ray could not reserve {bundles} bundles of one CPU ({strategy}) within "
            f"{timeout:g} s: is the cluster big enough?"
        ) from None
    return pg


def group(ray: Any) -> Any | None:
    """The placement group ``hetd`` of this namespace, or None."""
    try:
        return ray.util.get_placement_group(GROUP)
    except ValueError:
        return None


def connect(ray: Any, address: str | None = None) -> bool:
    """Join the Ray cluster at ``address`` (None: ``RAY_ADDRESS``, else a local one) in the
    ``hetd`` namespace, unless this process already did; True when this call joined."""
    if ray.is_initialized():
        return False
    ray.init(address=address, namespace=NAMESPACE, log_to_driver=False, logging_level="WARNING")
    return True


class _Slot:
    def __init__(self, server: int, directory: Path) -> None:
        self.server = server
        self.directory = directory
        self.actor: Any = None
        self.pid: int | None = None  # the actor's process
        self.node = ""  # the Ray node it runs on
        self.child: int | None = None  # its hetd pserver process
        self.state = "starting"  # starting, running, restarting, failed, stopped
        self.restarts = 0
        self.last_exit: int | None = None

    def describe(self) -> dict[str, Any]:
        return {
            "slice": self.server,
            "pid": self.child if self.state == "running" else None,
            "actor": pserver_name(self.server),
            "actor_pid": self.pid,
            "node": self.node,
            "state": self.state,
            "restarts": self.restarts,
            "last_exit": self.last_exit,
            "dir": str(self.directory),
        }


class RayPservers:
    """S pserver actors following the head's link at ``head``."""

    def __init__(self, head: tuple[str, int], root: Path, servers: int) -> None:
        self.head = head
        self.root = root
        self.slots = [_Slot(s, root / f"slice{s}") for s in range(servers)]
        self._ray: Any = None
        self._joined = False
        self._task: asyncio.Task[None] | None = None
        self._stopping = False

    def command(self, slot: _Slot) -> list[str]:
        return pserver_command(self.head, slot.server, slot.directory)

    async def start(self) -> None:
        try:
            await asyncio.to_thread(self._start)
        except Exception as exc:  # Ray's own errors: the daemon reports them as a refused start
            if isinstance(exc, OSError):
                raise
            raise OSError(f"the ray backend: {exc}") from exc
        self._task = asyncio.create_task(self._watch(), name="hetd-pservers-ray")

    def _start(self) -> None:
        ray = self._ray = load_ray()
        self._joined = connect(ray)
        pg = group(ray)
        first = 0
        if pg is not None:
            ray.get(pg.ready(), timeout=120)
            first = len(pg.bundle_specs) - len(self.slots)
            if first < 0:
                raise OSError(
                    f"the placement group {GROUP!r} has {len(pg.bundle_specs)} bundles, fewer "
                    f"than the {len(self.slots)} pservers"
                )
        actor_class = remote_actor(ray)
        strategies = ray.util.scheduling_strategies
        here = ray.get_runtime_context().get_node_id()
        for slot in self.slots:
            slot.directory.mkdir(parents=True, exist_ok=True)
            if pg is not None:
                where: dict[str, Any] = {
                    "num_cpus": 1,
                    "scheduling_strategy": strategies.PlacementGroupSchedulingStrategy(
                        placement_group=pg, placement_group_bundle_index=first + slot.server
                    ),
                }
            else:
                where = {
                    "num_cpus": 0,
                    "scheduling_strategy": strategies.NodeAffinitySchedulingStrategy(
                        node_id=here, soft=False
                    ),
                }
            slot.actor = actor_class.options(
                name=pserver_name(slot.server),
                namespace=NAMESPACE,
                lifetime="detached",  # a head restarted by Ray finds them again by name
                get_if_exists=True,
                max_restarts=MAX_RESTARTS,
                **where,
            ).remote(
                self.command(slot),
                str(slot.directory / LOG_FILE),
                str(slot.directory / "port"),
                None,
                os.getpriority(os.PRIO_PROCESS, 0),  # the daemon's: as the local backend's
            )
        for slot, info in zip(
            self.slots, ray.get([s.actor.info.remote() for s in self.slots]), strict=True
        ):
            slot.pid, slot.child, slot.node = info["pid"], info["child"], info["node"]
            slot.state = "running"
            log.info("pserver %d started as Ray actor %s", slot.server, pserver_name(slot.server))
            if info.get("nice_error"):
                log.warning(
                    "pserver %d keeps Ray's worker niceness (%s): it may wait for a core behind "
                    "the daemon",
                    slot.server,
                    info["nice_error"],
                )

    async def _watch(self) -> None:
        """Ask each actor how it stands, every :data:`POLL_S`: a new actor process is a restart."""
        while not self._stopping:
            for slot in self.slots:
                if slot.state in ("failed", "stopped"):
                    continue
                try:
                    info = await asyncio.wait_for(slot.actor.info.remote(), 10.0)
                except Exception as exc:  # the actor is restarting, or dead for good
                    if type(exc).__name__ == "ActorDiedError":
                        slot.state = "failed"
                        log.error("pserver %d: its actor is gone for good: %s", slot.server, exc)
                    elif slot.state != "restarting":
                        slot.state = "restarting"
                        log.warning("pserver %d: its actor died; Ray restarts it", slot.server)
                    continue
                if info["pid"] != slot.pid:
                    slot.restarts += 1
                    slot.pid = info["pid"]
                slot.child, slot.node = info["child"], info["node"]
                if info["status"] == EXIT_BROKEN:
                    slot.state, slot.last_exit = "failed", EXIT_BROKEN
                    log.error(
                        "pserver %d is not restarted: its slice cannot go on (status 3; its log: "
                        "%s)",
                        slot.server,
                        slot.directory / LOG_FILE,
                    )
                else:
                    slot.state = "running"
            await asyncio.sleep(POLL_S)

    def describe(self) -> list[dict[str, Any]]:
        return [slot.describe() for slot in self.slots]

    async def stop(self, timeout: float) -> None:
        if self._stopping:
            return
        self._stopping = True
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._ray is not None:
            await asyncio.to_thread(self._stop, timeout)

    def _stop(self, timeout: float) -> None:
        ray = self._ray
        actors = [s for s in self.slots if s.actor is not None]
        refs = [s.actor.stop.remote(timeout) for s in actors]
        for slot, ref in zip(actors, refs, strict=True):
            try:
                slot.last_exit = ray.get(ref, timeout=timeout + 5.0)
            except Exception as exc:  # an actor that is gone or restarting: killed below
                log.warning("pserver %d did not stop cleanly: %s", slot.server, exc)
            with contextlib.suppress(Exception):
                ray.kill(slot.actor, no_restart=True)
            slot.state = "stopped"
        if self._joined:
            ray.shutdown()
