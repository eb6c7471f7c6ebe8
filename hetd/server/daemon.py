"""The daemon: listens first, then builds the engine from a config behind that; serves websockets,
the admin API and the dashboard; checkpoints; handles signals and systemd.

Start-up order (why: an operator and the workers see a listening daemon within a second, and the
workers import JAX and compile their own step while the daemon builds its model): bind both
endpoints with nothing heavier than aiohttp imported, log the listening line, then import JAX, load
the data, build the model and the engine in a thread, resume from the newest checkpoint and start
the engine. A worker that connects meanwhile waits for the engine and then gets its ``welcome``;
``/healthz`` answers at once (``"ready": false`` until the engine runs); the admin API answers 503
``starting`` until then. :mod:`hetd.server.build` builds the engine from the config, and
:mod:`hetd.server.worker_app` is the workers' HTTP app.

With a state directory the daemon locks it before it listens and keeps it locked until its last
checkpoint is written (:mod:`hetd.server.statedir`): a second daemon on the same directory, or
one whose port is taken, stops with :class:`StartupError` (``hetd serve`` exits 2).

``Daemon`` owns every task it starts (the engine, the HTTP runners, the checkpoint timer, the
planning rounds of :mod:`hetd.server.planning`) and cancels and awaits them on ``stop``.
``serve`` is what ``hetd serve`` runs: listen, build, resume, tell systemd READY=1, wait for
SIGTERM or SIGINT, then stop taking pushes, say bye to workers, write the last checkpoint and exit.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import signal
import socket
import ssl
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from aiohttp import web

from hetd import config as config_mod
from hetd.server import admin, admin_context, admin_replicas, dashboard, front
from hetd.server.budget import DecodeBudget
from hetd.server.build import Head, build_head
from hetd.server.build import build_engine as build_engine  # hetd.server.daemon.build_engine too
from hetd.server.relay import Relay
from hetd.server.shm_hub import ShmHub
from hetd.server.statedir import StateDirError, StateDirLock
from hetd.server.throttle import AuthThrottle
from hetd.server.worker_app import make_worker_app

if TYPE_CHECKING:  # the heavy modules (JAX, flax, optax) load behind the listening sockets
    from hetd.core.engine import Engine
    from hetd.server import checkpoint
    from hetd.server.metrics import Metrics
    from hetd.server.planning import Planning
    from hetd.server.pserver_backend import PserverProcesses
    from hetd.server.pserver_link import HeadLink
    from hetd.server.replicas import ReplicaDriver

log = logging.getLogger("hetd.server.daemon")


class StartupError(Exception):
    """The daemon cannot start as configured (a port in use, a state directory held by another
    daemon or not writable): restarting will not help, so ``hetd serve`` exits 2."""


class Daemon:
    """A running daemon: the engine task, the worker endpoint, the admin API, the checkpoint timer.

    ``listen`` binds both endpoints; ``build`` makes the engine (in a thread, unless one was given),
    resumes from the newest valid checkpoint in ``[store] dir`` (when set) and starts it; ``start``
    does both. ``stop`` drains gracefully: bye to every worker, one last checkpoint, sockets closed,
    engine stopped — each step bounded by ``[server] stop_timeout_s``.
    """

    def __init__(
        self, cfg: config_mod.Config, engine: Engine | None = None, head: Head | None = None
    ) -> None:
        """``engine``: one built already (else ``build`` makes it from ``cfg``); ``head``: what
        pservers need of a given engine (its optimizer spec and initial parameters)."""
        config_mod.check_serving(cfg)  # before anything is built: a refused start changes nothing
        self.cfg = cfg
        # [server] tls_cert / tls_key: both endpoints serve TLS (wss://, https://); None: plain
        self.ssl_context: ssl.SSLContext | None = config_mod.server_ssl_context(cfg.server)
        self._engine = engine
        self._head = head
        self.pservers: HeadLink | None = None  # the pservers' link ([pservers] servers)
        self.pserver_procs: PserverProcesses | None = None  # [pservers] backend "local", "ray"
        self.checkpointer: checkpoint.Checkpointer | None = None  # made by build (imports flax)
        self.resumed_from: checkpoint.CheckpointInfo | None = None
        self.metrics: Metrics | None = None
        self.ready = False  # True once the engine runs (and the admin API answers)
        self._ready = asyncio.Event()  # set when ready, or when the daemon stops before that
        self._runners: list[web.AppRunner] = []
        self._worker_sites: list[front.GuardedSite] = []
        self._engine_task: asyncio.Task[None] | None = None
        self._timer_task: asyncio.Task[None] | None = None
        self._warm_task: asyncio.Task[None] | None = None
        self.planning: Planning | None = None  # forecasts for a policy that reads them
        self._plan_task: asyncio.Task[None] | None = None
        self._stopped = False
        self.port = 0  # the bound worker port
        self.admin_port: int | None = None  # the bound admin port (None: admin API off)
        self.admin_app: web.Application | None = None
        server = cfg.server
        # wrong tokens per address, on both ports and the dashboard's login (hetd.server.throttle)
        self.throttle = AuthThrottle(server.max_auth_failures, server.auth_window_s)
        # connections that showed no token yet, on both ports (hetd.server.front)
        self.front = front.FrontGuard(
            front.FrontLimits(
                server.header_timeout_s, server.max_pending, server.max_pending_per_address
            )
        )
        self._admin_slot = admin_context.AdminSlot(
            server.admin_token, tls=self.ssl_context is not None, throttle=self.throttle
        )
        # pipeline replicas' act/gact frames between workers (routes installed by their owner)
        self.relay = Relay()
        self.replicas: ReplicaDriver | None = None  # one pipeline replica beside DP (built later)
        # pushes decoded at once, and their bytes ([server] max_decodes, decode_bytes)
        self.decodes = DecodeBudget(cfg.server.max_decodes, cfg.server.decode_bytes)
        self.shm = ShmHub()  # shared memory for same-host workers that ask (made on demand)
        self.state_lock: StateDirLock | None = None  # [store] dir, held from listen to stop

    @property
    def engine(self) -> Engine:
        """The engine; RuntimeError before :meth:`build` made it."""
        if self._engine is None:
            raise RuntimeError("the daemon has not built its engine yet (await start())")
        return self._engine

    @property
    def engine_or_none(self) -> Engine | None:
        """The engine, or None while the daemon still builds it."""
        return self._engine

    async def wait_ready(self) -> Engine | None:
        """The running engine once it runs; None when the daemon stopped first."""
        await self._ready.wait()
        return self._engine if self.ready else None

    async def serve_worker(self, request: web.Request, engine: Engine) -> web.StreamResponse:
        """One worker's websocket session (:func:`hetd.server.sessions.handle`: imported here,
        behind the listening sockets), its pushes waiting for this daemon's pservers' parts."""
        from hetd.server import sessions

        server = self.cfg.server
        return await sessions.handle(
            request,
            engine,
            server.worker_token,
            server.max_frame_bytes,
            server.outbox_frames,
            self.relay,
            hub=self.shm if engine.store.holds_params else None,  # (else every release is pulled)
            budget=self.decodes,
            pservers=self.pservers,
        )

    async def start(self) -> int:
        """Listen, then build, resume and run the engine; returns the bound worker port (useful
        with port 0).

        Raises :class:`hetd.server.checkpoint.CheckpointError` when the newest valid checkpoint does
        not fit the configured model, and whatever building the model or data set raised; the
        sockets are closed again and nothing is written.
        """
        await self.listen()
        await self.build()
        return self.port

    async def listen(self) -> int:
        """Lock the state directory (when one is set), then bind the worker endpoint and the admin
        API; returns the worker port. :class:`StartupError` when the directory is another
        daemon's (naming it) or cannot be used, or a port cannot be bound."""
        try:
            self._lock_state_dir()
            await self._start_endpoints()
        except BaseException:  # a port in use, ...: close what was opened, write nothing
            await self.stop(final_checkpoint=False)
            raise
        if self.state_lock is not None:  # a second daemon is told where this one listens
            self.state_lock.note(worker_port=self.port, admin_port=self.admin_port)
        return self.port

    def _lock_state_dir(self) -> None:
        """Hold ``[store] dir`` for as long as this daemon runs: one writer of its checkpoints."""
        if self.state_lock is None and self.cfg.store.dir:
            try:
                self.state_lock = StateDirLock.acquire(self.cfg.store.dir)
            except StateDirError as exc:
                raise StartupError(str(exc)) from exc

    async def build(self) -> None:
        """Build the engine (a thread: the sockets keep answering), resume, start it."""
        began = time.monotonic()
        try:
            head = self._head
            if self._engine is None:
                built, head = await asyncio.to_thread(build_head, self.cfg)
                self._engine = built
            engine = self._engine
            if self._stopped:  # stopped while it built: start nothing
                return
            if self.cfg.store.dir:
                from hetd.server.checkpoint import Checkpointer

                self._lock_state_dir()  # (listen took it, unless build was called alone)
                self.checkpointer = Checkpointer(self.cfg.store.dir, self.cfg.store.keep)
            from hetd.codecs import registry as codecs
            from hetd.server.metrics import Metrics

            # Compile the optimizer step in a thread while we resume (no state touched).
            int8 = codecs.spec_name(engine.config.codec) == "int8"
            self._warm_task = asyncio.create_task(
                asyncio.to_thread(engine.store.warm, int8), name="hetd-warm-store"
            )
            if self.checkpointer is not None:
                self.resumed_from = await asyncio.to_thread(self.checkpointer.restore, engine)
            if self.cfg.pservers.servers > 0:
                await self._start_pservers(engine, head)
            self.metrics = Metrics(engine, extra=self._metric_extras)
            from hetd.server.replicas import ReplicaDriver

            if engine.store.holds_params:  # (a replica's stages take the head's parameters)
                self.replicas = ReplicaDriver(engine, self.relay)  # formed by POST /v1/replicas
            self._engine_task = asyncio.create_task(engine.run(), name="hetd-engine")
            if self.cfg.policy.plan_every_s > 0:  # each round plans only under such a policy
                from hetd.server.planning import Planning

                self.planning = Planning(engine, self.cfg.policy.plan_every_s)
                self._plan_task = asyncio.create_task(self.planning.run(), name="hetd-planning")
        except BaseException:
            await self.stop(final_checkpoint=False)
            raise
        if self._stopped:  # stopped while building
            return
        if self.admin_port is not None:
            self._admin_slot.attach(
                admin_context.AdminContext(
                    engine=engine,
                    token=self.cfg.server.admin_token,
                    metrics=self.metrics,
                    checkpoint=self.checkpoint if self.checkpointer is not None else None,
                    daemon_status=self.describe,
                    timeout_s=self.cfg.server.stop_timeout_s,
                    export=self.export,
                    replicas=self.replicas,
                )
            )
        if self.checkpointer is not None and self.cfg.store.interval_s > 0:
            self._timer_task = asyncio.create_task(
                self.checkpointer.run_timer(engine, self.cfg.store.interval_s),
                name="hetd-checkpoint-timer",
            )
        self.ready = True
        self._ready.set()
        t = self.cfg.train
        log.info(
            "ready after %.1f s: %s on %s, policy %s %s, version %d",
            time.monotonic() - began,
            t.model,
            t.dataset,
            engine.host.policy.name,
            dict(engine.host.policy.params),
            engine.store.version,
        )

    async def _start_pservers(self, engine: Engine, head: Head | None) -> None:
        """The pservers' link: the partition map for the optimizer (probed: one that cannot be
        cut is refused, saying why), then listening on ``[pservers] host:port``."""
        from hetd.core.store import make_optimizer
        from hetd.pserver.separable import NotSliceable, plan
        from hetd.server.pserver_link import HeadLink, LinkSetup

        p = self.cfg.pservers
        if head is None or head.optimizer is None:
            raise StartupError(
                "[pservers] servers needs the daemon's own optimizer spec ([train] optimizer): "
                "a Task's own optimizer, or an engine given ready-made, is not run by pservers yet"
            )
        if p.headers == engine.store.holds_params:  # (an engine built elsewhere than build_engine)
            raise StartupError(
                f"[pservers] headers = {str(p.headers).lower()}, but the engine's store "
                f"{'holds' if engine.store.holds_params else 'holds no'} parameters: build it "
                "with hetd.core.ledger.LedgerStore exactly when headers = true"
            )
        shapes = dict(engine.store.shapes)
        try:
            pmap = await asyncio.to_thread(plan, make_optimizer(head.optimizer), shapes, p.servers)
        except NotSliceable as exc:
            raise StartupError(f"[pservers] servers = {p.servers}: {exc}") from None
        link = HeadLink(engine, LinkSetup(pmap, head.optimizer, head.params, p.part_timeout_s))
        try:
            await link.start(p.host, p.port)
        except OSError as exc:
            raise StartupError(
                f"cannot listen on {p.host}:{p.port} (the pservers' link, [pservers] port): "
                f"{exc.strerror or exc}"
            ) from exc
        self.pservers = link
        if self.checkpointer is not None:
            self.checkpointer.log_floor = link.floor
            if link.headers:  # its checkpoints name the slices: written once all are saved
                wait_s = self.cfg.server.stop_timeout_s
                self.checkpointer.commit = lambda position: link.saved_by_all(position, wait_s)
        if p.backend != "none":
            from pathlib import Path

            from hetd.server import pserver_backend

            procs = pserver_backend.make(
                p.backend, (p.host, link.port), Path(self.cfg.store.dir) / "pservers", p.servers
            )
            self.pserver_procs = procs  # (before starting: stop ends what did start)
            try:
                await procs.start()
            except OSError as exc:
                raise StartupError(f"cannot start the pserver processes: {exc}") from exc
            log.info("started %d pserver processes under %s", p.servers, procs.root)
        log.info(
            "%d pservers follow the decision log on %s:%d; workers are welcomed once all of "
            "them connected, and send them their pushes' parts",
            p.servers,
            p.host,
            link.port,
        )

    async def _start_endpoints(self) -> None:
        server = self.cfg.server
        tls = self.ssl_context is not None
        self.port, site = await self._listen(
            make_worker_app(self), server.host, server.port, "the worker endpoint, [server] port"
        )
        self._worker_sites.append(site)
        where = f"{'wss' if tls else 'ws'}://{server.host}:{self.port} (workers)"
        if server.admin_port >= 0:
            # the admin API, its pipeline-replica routes and the dashboard, on one app
            self.admin_app = admin.make_admin_app(self._admin_slot)
            admin_replicas.add_routes(self.admin_app)
            dashboard.install(self.admin_app, self._admin_slot)
            self.admin_port, _ = await self._listen(
                self.admin_app,
                server.admin_host,
                server.admin_port,
                "the admin API, [server] admin_port",
            )
            where += (
                f", {'https' if tls else 'http'}://{server.admin_host}:{self.admin_port}"
                " (admin API, dashboard at /)"
            )
        else:
            where += ", admin API off"
        log.info("listening on %s", where)
        if server.admin_port >= 0 and not server.admin_token:
            log.warning("no admin token configured: the admin API refuses every call")
        if not server.worker_token:
            log.warning(
                "no worker token ([server] open_workers = true): any process that reaches "
                "%s:%d joins as a worker and reads the model; for demos only (set "
                "HETD_WORKER_TOKEN otherwise)",
                server.host,
                self.port,
            )

    async def _listen(
        self, app: web.Application, host: str, port: int, what: str
    ) -> tuple[int, front.GuardedSite]:
        """Serve ``app`` on ``host:port`` behind the front guard (header timeout, pending caps);
        idle keep-alive connections close after ``[server] header_timeout_s`` too."""
        front.install(app, self.front)
        timeout = self.cfg.server.header_timeout_s
        runner = web.AppRunner(app, handle_signals=False, keepalive_timeout=timeout)
        await runner.setup()
        self._runners.append(runner)
        site = front.GuardedSite(runner, host, port, self.front, ssl_context=self.ssl_context)
        try:
            await site.start()
        except OSError as exc:  # in use, not an address of this machine, a privileged port
            raise StartupError(
                f"cannot listen on {host}:{port} ({what}): {exc.strerror or exc}"
            ) from exc
        return site.port, site

    async def checkpoint(self) -> checkpoint.CheckpointInfo:
        """Write a checkpoint now (POST /v1/checkpoint); RuntimeError without a state directory."""
        if self.checkpointer is None:
            raise RuntimeError("checkpoints are off: set [store] dir or --state-dir")
        return await self.checkpointer.save(self.engine)

    async def export(self, out: str) -> dict[str, Any]:
        """Write the model for users (POST /v1/export): an orbax directory and params.msgpack."""
        from hetd.server import export

        engine = self.engine
        link = self.pservers
        if engine.store.holds_params or link is None:
            state = await engine.queue.call(lambda: export.capture(engine))
        else:  # the pservers hold the parameters: the version's pulled from them
            state, (version, position) = await engine.queue.call(
                lambda: (export.capture(engine), link.here())
            )
            pulled = await link.pull(version, position)
            if pulled is None:
                from hetd.server.safe_files import Refused

                raise Refused(
                    f"the pservers no longer hold version {version}, or did not answer in "
                    "time: export again",
                    503,
                    "pservers_unavailable",
                )
            state = dataclasses.replace(state, params=dict(pulled.tensors))
        return await asyncio.to_thread(export.write, out, state, self.cfg)

    def describe(self) -> dict[str, Any]:
        """Daemon facts for /v1/status: pid, ports, checkpoints."""
        ck = self.checkpointer
        return {
            "daemon": {"pid": os.getpid(), "worker_port": self.port, "admin_port": self.admin_port},
            "checkpoint": {
                "dir": str(ck.directory) if ck is not None else None,
                "interval_s": self.cfg.store.interval_s,
                "keep": self.cfg.store.keep,
                "written": ck.written if ck is not None else 0,
                "last": ck.last.to_json() if ck is not None and ck.last is not None else None,
                "resumed_from": self.resumed_from.to_json() if self.resumed_from else None,
            },
            "planning": self.planning.describe() if self.planning is not None else None,
            "decisions": self._describe_log(),
        }

    def _describe_log(self) -> dict[str, Any] | None:
        """The decision log's place ([pservers] log): its last position, the store version
        there, the first position it still holds; None when no log is kept."""
        if self._engine is None or self._engine.store.decisions is None:
            return None
        from hetd.pserver.log import DecisionLog

        log_ = self._engine.store.decisions
        if not isinstance(log_, DecisionLog):
            return None
        out: dict[str, Any] = {
            "position": log_.position,
            "version": log_.version,
            "first": log_.first,
        }
        if self.pservers is not None:
            out["link_port"] = self.pservers.port
            out["saved"] = list(self.pservers.durable)  # each slice's newest saved position
            out["connected"] = sorted(self.pservers.connected)
            out["parts"] = self.pservers.parts.describe()  # pushes and their pservers' parts
            # what the head takes of a push: "headers" (it holds no parameters) or "whole"
            out["head"] = "headers" if self.pservers.headers else "whole"
        if self.pserver_procs is not None:  # each process's pid, state and restarts
            out["processes"] = self.pserver_procs.describe()
        return out

    async def _pservers_saved(self, link: HeadLink, timeout: float) -> None:
        """Wait (at most ``timeout``) until every connected pserver saved the log's last
        position, where the final checkpoint's entry is: they stop on it, with nothing to replay."""
        decisions = self._engine.store.decisions if self._engine is not None else None
        if decisions is None:
            return
        end = decisions.position
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if all(link.durable[s] >= end for s in link.connected):
                return
            await asyncio.sleep(0.05)
        log.warning(
            "pservers did not all save the final checkpoint's position within %.0f s", timeout
        )

    def _metric_extras(self) -> dict[str, float]:
        relayed = self.relay.stats()
        extras = {
            "hetd_relay_frames": float(relayed.frames),  # act/gact frames forwarded
            "hetd_relay_bytes": float(relayed.bytes),
            "hetd_relay_dropped": float(relayed.dropped),  # ... dropped for want of a route
        }
        if self.replicas is not None:
            extras["hetd_replica_steps_assembled"] = float(self.replicas.assembled)
            extras["hetd_replica_steps_aborted"] = float(self.replicas.aborted)
        ck = self.checkpointer
        if ck is None:
            return extras
        extras["hetd_checkpoints_written"] = float(ck.written)
        if ck.last is not None:
            extras["hetd_last_checkpoint_version"] = float(ck.last.version)
        return extras

    async def stop(self, timeout: float | None = None, *, final_checkpoint: bool = True) -> None:
        """Graceful stop, each step bounded by ``timeout`` (default ``[server] stop_timeout_s``):
        stop accepting workers; one engine command says bye to every worker (they reconnect
        later) and captures the state, so every push the engine took is in it and none after;
        close the sockets; write the last checkpoint; stop the engine. A second call does nothing.
        """
        if self._stopped:
            return
        self._stopped = True
        self._ready.set()  # workers waiting for the engine get a 503 unless it runs
        timeout = self.cfg.server.stop_timeout_s if timeout is None else timeout
        engine = self._engine
        for task in (self._timer_task, self._plan_task):  # (a planner's thread ends by itself)
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        for site in self._worker_sites:  # no new connections; open ones get their bye below
            with contextlib.suppress(Exception):
                await site.stop()
        capture = final_checkpoint and self.checkpointer is not None
        state: dict[str, Any] | None = None
        if engine is not None and self._engine_task is not None and not self._engine_task.done():
            try:
                state = await asyncio.wait_for(
                    engine.queue.call(lambda: _drain(engine, capture)), timeout
                )
            except Exception:
                log.exception("draining the engine failed")
        for runner in self._runners:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(runner.cleanup(), timeout)
        self._runners.clear()
        self.front.close()
        self.shm.close()  # after the sessions: nothing in /dev/shm is left behind
        if engine is not None and self.checkpointer is not None and state is not None:
            try:
                info = await asyncio.wait_for(self.checkpointer.save(engine, state), timeout)
                log.warning("final checkpoint %s at version %d", info.path, info.version)
            except Exception:
                log.exception("the final checkpoint failed")
        if self.pserver_procs is not None:  # after the last checkpoint: they save its entry
            if state is not None and self.pservers is not None:
                await self._pservers_saved(self.pservers, timeout)
            await self.pserver_procs.stop(timeout)
            self.pserver_procs = None
        if self.pservers is not None:  # after the last checkpoint: its entry reached them
            await self.pservers.close()
            self.pservers = None
        if self._engine_task is not None:
            self._engine_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._engine_task
            self._engine_task = None
        if self._warm_task is not None:  # a thread cannot be cancelled: let it finish
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._warm_task, timeout)
            self._warm_task = None
        if self.state_lock is not None:  # after the last checkpoint: another daemon may start
            self.state_lock.release()
            self.state_lock = None


def _drain(engine: Engine, capture: bool) -> dict[str, Any] | None:
    """Say bye to every worker (they reconnect later) and capture the state to checkpoint."""
    from hetd.server.checkpoint import engine_state

    engine.bye_all("daemon stopping")
    return engine_state(engine) if capture else None


def sd_notify(state: str) -> bool:
    """Tell systemd about our state (``READY=1``, ``STOPPING=1``, ``STATUS=...``, newline-separated)
    over the datagram socket in ``NOTIFY_SOCKET``; False when not run as a notify service."""
    addr = os.environ.get("NOTIFY_SOCKET")
    if not addr:
        return False
    if addr.startswith("@"):
        addr = "\0" + addr[1:]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
            sock.connect(addr)
            sock.sendall(state.encode())
    except OSError as exc:
        log.warning("sd_notify to %s failed: %s", os.environ.get("NOTIFY_SOCKET"), exc)
        return False
    return True


async def serve(cfg: config_mod.Config, extra: Callable[[Daemon], Any] | None = None) -> None:
    """Run until SIGTERM/SIGINT, then drain and stop (what ``hetd serve`` does).

    The listening line is logged as soon as both endpoints are bound; READY=1 goes to systemd
    once the engine runs, with a STATUS line naming the ports.
    """
    daemon = Daemon(cfg)
    await daemon.start()
    try:
        if extra is not None:
            await extra(daemon)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        admin_at = (
            f"{cfg.server.admin_host}:{daemon.admin_port}"
            if daemon.admin_port is not None
            else "off"
        )
        resumed = (
            f"resumed at version {daemon.resumed_from.version}"
            if daemon.resumed_from is not None
            else "fresh start"
        )
        sd_notify(
            f"READY=1\nSTATUS=workers on {cfg.server.host}:{daemon.port}, admin on {admin_at}, "
            f"{resumed}\nMAINPID={os.getpid()}"
        )
        await stop.wait()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
        sd_notify("STOPPING=1\nSTATUS=draining: bye to workers, final checkpoint")
        log.warning("stopping: saying bye to %d workers", len(daemon.engine.members.facts))
    finally:
        await daemon.stop()
