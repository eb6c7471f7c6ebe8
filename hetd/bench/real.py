"""``hetd bench --mode real``: one run with a real daemon and real ``hetd-worker`` processes.

Owns :func:`run_real`. It starts :class:`hetd.server.daemon.Daemon` on a free loopback port and one
``hetd-worker`` process per scenario worker, slowed with the emulation flags (as ``hetd demo``
does), waits until every worker has joined and pushed once (its jit compiled) and then three more
times (so the pushes that time each worker for the run's policy are not the join's), trains for
``budget_s`` wall seconds while sampling the engine's events (through a recording wrapper around
the policy) and batch sizes for the plots, then stops everything it started and returns the same
:class:`~hetd.sim.results.RunResult` as the simulator.

Every scenario the simulator runs runs here too: each worker gets its slow-down, regime shifts
(``--emulate-shift T:X``; a shift given as ``at_fraction`` is resolved against the run's budget),
stragglers (``--emulate-stragglers`` with the scenario's factor and mean length), link bandwidth and
latency (charged per message both ways, as the simulator charges ``latency_s`` per pull and per
push) and memory.

**Churn** (a scenario's ``[[events]]``). A joiner's process starts with the others and waits
(``hetd-worker --emulate-join-at``): it loads JAX, fetches the setup and builds its trainer
before t = 0, and connects ``at_s`` after it, as the simulator's joiner arrives then; its first
step compiles (from the shared compilation cache when one is warm). Starting it at ``at_s``
instead made a join cost Python's and JAX's start-up, tens of seconds on a loaded host, longer
than a short run. A clean leave is SIGTERM (the worker sends what it computed, says bye and exits); a crash
is SIGKILL. On loopback the kernel closes a killed process's socket, so the daemon hears of the
crash at once; with ``--links netns`` the worker's link is cut first, so nothing reaches the daemon
and it finds out by the heartbeat timeout (the scenario's ``heartbeat_timeout_s``), as the
simulator's silent crash does. Every worker ever in the run has its namespace and link from the
start.

**Memory-poor workers.** A worker whose ``memory`` cannot hold a whole-model step (the
parameters, their gradients and a micro-batch's activations, :func:`workers.emulate.whole_step_bytes`)
fails one as a real memory-poor device does (``hetd-worker --emulate-memory``: it leaves with an
out-of-memory error). So the bsp warm-up, which gives every worker whole-model steps, would end it
before t = 0, and a policy that does not plan for it (lbbsp) could never meet it. It is started
as a joiner at t = 0 (``--emulate-join-at 0``): it builds its trainer before, connects at t = 0,
and from then on meets what the run's policy gives it, as in the simulator, whose workers all
start at t = 0: dpmp makes it a pipeline stage, lbbsp gives it a share, its first step fails and
lbbsp goes on with the others.

**The time origin.** The simulator's t = 0 is the start of the run, and so is the real run's: the
moment every worker has joined and pushed once (and three warm-up rounds more), from which the
budget and every curve count. That moment is not known when the worker processes start (importing
JAX, loading data and compiling take seconds to minutes on a loaded machine, and differently for
each worker), so no start time can go on their command line, and counting from each worker's own
welcome would give each its own origin, seconds apart. Each worker is therefore started with
``--emulate-origin stdin`` and, at t = 0, the bench writes the wall-clock time of t = 0 to every
worker's standard input; a worker converts it to its own monotonic clock, so the origin does not
depend on when the line arrives, and all workers share it up to the host's clock (one host:
exactly). Before it (while the slowest worker still compiles) workers run at their initial
slow-down with no shift and no straggle episode; shift times and straggle episodes count from it,
as in the simulator.

**Links.** By default every worker connects over loopback and sleeps for its link (bytes ÷
bandwidth and the latency, per message). With ``links="netns"`` (``--links netns``, root) each
worker process starts inside a network namespace of its own behind a veth pair shaped with tbf to
its bandwidth both ways (:mod:`hetd.bench.links`), the daemon listens on the run's head address, and
the worker sleeps only for the latency (no netem here). The run's ``RunResult.links`` says which.

**Evaluations** (``evals``, ``--evals``). ``"deferred"`` (the default): at each point of the
evaluation grid the engine keeps a copy of the parameters, timestamped then
(:class:`hetd.bench.kept.KeptSnapshots`, memory bounded, spilled to disk past its cap), and the
bench evaluates them after the budget, once the workers are stopped, so the probe takes no CPU from
the run it measures: the simulator, whose evaluations cost nothing but ``eval_s`` of delay before
a policy sees one, charges none either. ``"live"``: the daemon evaluates in a thread during the
run, as ``hetd serve`` does (1,000 test images every 0.5 s took ≈ 0.2 of a core with the 5.8M MLP).
A policy that reads ``Eval`` events (``Policy.reads_evals``: ashl switches stages on the loss) is
always evaluated live, and said so. ``RunResult.evals`` records the mode each run used, and a line
on standard error the daemon process's CPU per update.

**A fresh start at t = 0.** While the slowest worker still compiles, the others train (under bsp,
whatever the run's policy, so that at t = 0 a worker is at most one step into its work and one
round from the others): each
pushes once at least, and the faster ones many times. None of that is in the simulator's run, which starts
every worker at t = 0 from the initial model with the policy just built (profiling included). So at
t = 0 the bench starts the run afresh, on the engine's task: the policy is swapped for a new one of
the same spec (its state and the plans rebuilt from ``init``, buffered pushes applied first, as any
swap does), then the parameters and the optimizer's state go back to what they were before the first
worker joined, under a new version (so every worker's next parameters replace what it holds). What
stays is what the workers are: compiled, connected, and measured (their facts). A push computed
before t = 0 and applied after it lands on the fresh parameters: at most one per worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import math
import os
import resource
import secrets
import signal
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from typing import IO, Any

from hetd import config as config_mod
from hetd.bench import links as links_mod
from hetd.bench.kept import DEFAULT_CAP_BYTES, KeptSnapshots
from hetd.core.engine import Engine
from hetd.local.procs import spawn_worker, stop_processes, worker_env
from hetd.server.daemon import Daemon
from hetd.sim.results import PolicySpec, RunResult, Trace, staleness_stats, time_to_target
from hetd.sim.scenario import Join, Scenario
from policies import ClusterView, Policy
from policies.types import Decision, Event, Leave, Push, Release
from workers.imports import operator_flags

LINKS = ("emulated", "netns")  # --links: the worker sleeps for its link, or a real shaped one
# worker processes import jax, build their trainer and compile before their first push: under
# nice on a loaded 2-core host the 2M transformer (S7) took over 120 s; a worker that exits is
# noticed at once, whatever this says
JOIN_TIMEOUT_S = 600.0
POLL_S = 0.05  # how often the engine is sampled for batch shares and progress
SETTLE_ROUNDS = 3  # warm-up rounds after every worker has pushed once, before t = 0
WARMUP = PolicySpec("bsp")  # the daemon's policy until the t = 0 restart swaps in the run's
EVALS = ("deferred", "live")  # --evals: kept and evaluated after the run, or during it


@dataclasses.dataclass(frozen=True)
class EvalOptions:
    """How a real run evaluates: ``mode`` (one of :data:`EVALS`) and, deferred, the bytes of
    kept parameters held in memory before the rest go to disk."""

    mode: str = "deferred"
    cap_bytes: int = DEFAULT_CAP_BYTES


class Recorder:
    """Wraps the engine's policy to see every event and decision: a worker is busy from the
    release that sends it parameters until its next push arrives (the engine's own rule: a
    Release only counts for a worker that is waiting). Engine-clock seconds."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self._busy_since: dict[int, float] = {}
        self._spans: dict[int, list[tuple[float, float]]] = {}
        # s of compute each worker reported with its pushes (emulation included): its device's
        # busy time, pipelined or not
        self.compute_s: dict[int, float] = {}

    def wrap(self, inner: Policy) -> Policy:
        """``inner`` with the same name, parameters, state and flags (the events it reads:
        evaluations, forecasts), observed."""

        def update(event: Event, state: Any, view: ClusterView) -> tuple[Sequence[Decision], Any]:
            decisions, state = inner.update(event, state, view)
            self._observe(event, decisions, view)
            return decisions, state

        return inner._replace(update=update)

    def _observe(self, event: Event, decisions: Sequence[Decision], view: ClusterView) -> None:
        if isinstance(event, Push):
            self.compute_s[event.worker] = self.compute_s.get(event.worker, 0.0) + max(
                0.0, event.compute_s
            )
        if isinstance(event, Push | Leave):
            began = self._busy_since.pop(event.worker, None)
            if began is not None:
                self._spans.setdefault(event.worker, []).append((began, event.now))
        for d in decisions:
            if isinstance(d, Release) and d.worker not in self._busy_since:
                facts = view.workers.get(d.worker)
                if facts is not None and facts.waiting:
                    self._busy_since[d.worker] = event.now

    def spans(self) -> dict[int, list[tuple[float, float]]]:
        """Busy intervals per engine worker id; an open one ends now."""
        now = self._engine.clock.now()
        out = {w: list(s) for w, s in self._spans.items()}
        for w, began in self._busy_since.items():
            out.setdefault(w, []).append((began, now))
        return out


def memory_poor(sc: Scenario, shapes: Mapping[str, Sequence[int]]) -> frozenset[int]:
    """The initial workers whose ``memory`` cannot hold a whole-model step of the model of
    parameter ``shapes`` (module docstring): what a worker with that ``--emulate-memory``
    refuses (its micro-batch is the daemon's, the scenario's ``micro_batch``)."""
    from workers.emulate import whole_step_bytes
    from workers.loop import DEFAULT_MICRO_BATCH

    need = whole_step_bytes(shapes, sc.micro_batch or DEFAULT_MICRO_BATCH)
    return frozenset(
        i for i, w in enumerate(sc.workers) if w.memory is not None and w.memory < need
    )


def check_real(sc: Scenario) -> None:
    """Raise ValueError if ``hetd-worker``'s emulation flags cannot express ``sc``. Every
    scenario the simulator accepts can be expressed today; this builds each worker's flags, so a
    caller learns of a problem before a long simulated sweep rather than after it."""
    for i in range(len(sc.all_workers)):
        _worker_args(sc, i, 0)


def _config(
    sc: Scenario, policy: PolicySpec, seed: int, lr: float, host: str = "127.0.0.1"
) -> config_mod.Config:
    cfg = config_mod.Config()
    cfg = config_mod.replace(
        cfg,
        "server",
        host=host,
        port=0,
        admin_port=0,
        worker_token=secrets.token_hex(16),
        admin_token=secrets.token_hex(16),
        heartbeat_s=min(0.5, sc.heartbeat_timeout_s / 4),
        heartbeat_timeout_s=sc.heartbeat_timeout_s,
    )
    cfg = config_mod.replace(
        cfg,
        "train",
        model=sc.model,
        model_kwargs=dict(sc.model_kwargs),
        dataset=sc.dataset,
        dataset_kwargs=dict(sc.dataset_kwargs),
        seed=seed,
        optimizer=sc.optimizer,
        lr=lr,
        worker_lr=sc.worker_lr or lr,
        inner_optimizer=sc.inner_optimizer,
        outer_optimizer=sc.outer_optimizer,
        micro_batch=sc.micro_batch,
        global_batch=sc.global_batch,
        batch_size=sc.batch_per_worker,
        codec=sc.codec,
        downlink=sc.downlink,
        shards=sc.n,
        eval_interval_s=sc.eval_interval_s,
        target_accuracy=sc.target_accuracy,
    )
    return config_mod.replace(
        cfg,
        "policy",
        name=policy.name,
        params=policy.build_params(),
        plan_every_s=sc.plan_every_s,  # the scenario's planning rounds, as the simulator's
    )


def _worker_args(
    sc: Scenario, i: int, seed: int, shaped: bool = False, late: bool = False
) -> list[str]:
    """Emulation flags for worker ``i`` (``late``: a memory-poor worker, which joins at t = 0,
    the module docstring). ``--emulate-slowdown`` and a shift's slow-down must be
    >= 1, so slow-downs are relative to the fastest worker at any time (regime shifts included),
    whose speed goes into ``--emulate-base-step`` (seconds per 32 samples; the worker scales it
    by its batch). Shift times are seconds from the run's t = 0 (written to the worker's standard
    input, see the module docstring). ``shaped``: a real link carries the bandwidth (netns links),
    so the worker does not sleep for it; latency stays emulated (tbf shapes the rate only)."""
    w = sc.all_workers[i]
    fastest = min([x.slowdown for x in sc.all_workers] + [s.slowdown for s in sc.shifts])
    per_32 = sc.base_step_s * 32 / sc.base_batch * fastest
    # the scenario named its model and data set: its own workers may build them (workers.imports)
    args = [
        *operator_flags(sc.model, sc.dataset),
        "--name",
        f"w{i}",
        "--emulate-slowdown",
        repr(w.slowdown / fastest),
        "--emulate-base-step",
        repr(per_32),
        "--emulate-origin",
        "stdin",
        "--emulate-seed",
        str(seed * 1000 + i),
        "--max-retries",
        "3",
    ]
    shifts = sorted((s for s in sc.shifts if s.worker == i), key=lambda s: s.time(sc.budget_s))
    for s in shifts:  # sorted stably: at one time, the scenario's last shift wins, as in sim
        args += ["--emulate-shift", f"{s.time(sc.budget_s)!r}:{s.slowdown / fastest!r}"]
    st = w.stragglers
    if st.p > 0:
        args += [
            "--emulate-stragglers",
            repr(st.p),
            "--emulate-straggle-factor",
            repr(st.factor),
            "--emulate-straggle-mean",
            repr(st.mean_len),
        ]
    if math.isfinite(w.bandwidth) and not shaped:
        args += ["--emulate-bandwidth", repr(w.bandwidth)]
    if w.latency_s > 0:
        args += ["--emulate-latency", repr(w.latency_s)]
    if w.memory is not None:
        args += ["--emulate-memory", str(w.memory)]
    join = next((e for e in sc.events if isinstance(e, Join) and e.worker == i), None)
    if join is not None:  # started with the others, it connects at its time (Churn)
        args += ["--emulate-join-at", repr(join.at_s)]
    elif late:
        args += ["--emulate-join-at", "0.0"]
    return args


async def _start_schedules(procs: Sequence[asyncio.subprocess.Process], wall_t0: float) -> None:
    """Tell every worker the wall-clock time of t = 0 (``--emulate-origin stdin``), then close
    its standard input (it reads nothing more)."""
    line = f"{wall_t0!r}\n".encode()
    for p in procs:
        if p.stdin is None or p.stdin.is_closing():
            continue
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):  # it died: noticed later
            p.stdin.write(line)
            await p.stdin.drain()
        p.stdin.close()


async def _run(
    sc: Scenario,
    policy: PolicySpec,
    seed: int,
    lr: float,
    on_time: Callable[[float], None],
    links: str = "emulated",
    evals: EvalOptions = EvalOptions(),
    observe: Callable[[Engine], None] | None = None,
) -> RunResult:
    check_real(sc)
    if links not in LINKS:
        raise ValueError(f"unknown links {links!r}; use one of {', '.join(LINKS)}")
    if evals.mode not in EVALS:
        raise ValueError(f"unknown evals {evals.mode!r}; use one of {', '.join(EVALS)}")
    if links == "emulated":
        result = await _run_on(sc, policy, seed, lr, on_time, None, evals, observe)
        return dataclasses.replace(result, links={"kind": "emulated"})
    with links_mod.open_links([w.bandwidth for w in sc.all_workers]) as net:
        result = await _run_on(sc, policy, seed, lr, on_time, net, evals, observe)
        return dataclasses.replace(result, links=net.describe())


async def _run_on(
    sc: Scenario,
    policy: PolicySpec,
    seed: int,
    lr: float,
    on_time: Callable[[float], None],
    net: links_mod.NetnsLinks | None,
    evals: EvalOptions = EvalOptions(),
    observe: Callable[[Engine], None] | None = None,
) -> RunResult:
    """One run; with ``net`` the daemon listens on the head side of the run's links and each
    worker process starts inside its own namespace. ``observe`` is handed the daemon's engine
    before any worker starts (a test's way to watch what it answers)."""
    # Until t = 0 the workers compile and warm up under bsp: one step per release, so what a
    # worker still computes at t = 0 is one step (under the run's policy it could be a whole
    # plan of local steps: adsp's first period was 2.5-4.6 s on a loaded host, and the first
    # commit after t = 0 came that late), and every worker's clock stays within one round of the
    # others (under asp the fast ones ran 50 rounds ahead, and a synchronous policy swapped in
    # at t = 0 held them until the slowest caught up: 2 s). The restart swaps in the run's.
    cfg = _config(sc, WARMUP, seed, lr, "127.0.0.1" if net is None else net.head)
    daemon = Daemon(cfg)
    port = await daemon.start()  # listens, then builds the engine; no worker has started yet
    engine = daemon.engine
    if observe is not None:
        observe(engine)
    recorder = Recorder(engine)
    engine.host.policy, engine.host.state = recorder.wrap(engine.host.policy), engine.host.state
    initial = engine.store.state()  # before any worker joins: the t = 0 restart goes back to it
    late = memory_poor(sc, engine.store.shapes)  # they join at t = 0 (the module docstring)
    url = f"ws://{cfg.server.host}:{port}"
    env = worker_env(cfg.server.worker_token)
    procs: list[asyncio.subprocess.Process] = []  # worker i's process at index i
    # Each worker's stderr goes to a file of its own, read only when something went wrong: a
    # pipe no one reads would block a worker that logs more than it holds.
    logs: list[IO[bytes]] = []
    files = contextlib.ExitStack()  # closed (and so deleted) once the run is over

    async def start_worker(i: int) -> asyncio.subprocess.Process:
        logs.append(files.enter_context(tempfile.TemporaryFile()))  # noqa: SIM115 (files closes it)
        return await spawn_worker(
            url,
            *_worker_args(sc, i, seed, shaped=net is not None, late=i in late),
            env=env,
            stdin=asyncio.subprocess.PIPE,
            stderr=logs[-1],
            wrap=None if net is None else functools.partial(net.command, i),
        )

    try:
        # a scenario's joiners start now too and wait for their time to connect (Churn)
        for i in range(len(sc.all_workers)):
            procs.append(await start_worker(i))
        # The clock starts once every worker has joined and pushed once (its jit is compiled),
        # and then SETTLE_ROUNDS more times: the first to join ran its profile and its first
        # steps while the others compiled, and the policy built at t = 0 times each worker by
        # its pushes (policies.profiling.profile_from_facts), which then reflect the whole
        # cluster at work, not the join.
        deadline = time.monotonic() + JOIN_TIMEOUT_S
        await _wait_joined(engine, sc.n - len(late), procs, logs, deadline)
        settled = {wid: f.clock + SETTLE_ROUNDS for wid, f in engine.members.facts.items()}
        await _wait_joined(engine, sc.n - len(late), procs, logs, deadline, settled)
        await engine.queue.call(lambda: _restart(engine, recorder, policy, initial))
        kept = keeper_for(engine.host.policy, evals)
        try:
            churn = Churn(sc, procs, net)
            return await _measure(
                sc, policy, seed, lr, daemon, recorder, on_time, procs, kept, churn, late
            )
        finally:
            if kept is not None:
                kept.close()
    finally:
        for p in procs:
            if p.stdin is not None:
                p.stdin.close()
        await stop_processes(procs)
        await daemon.stop()
        files.close()


def _tail(log: IO[bytes], chars: int = 800) -> str:
    """The last ``chars`` of what a worker wrote to its stderr file so far."""
    log.seek(0, os.SEEK_END)
    log.seek(max(0, log.tell() - chars))
    return log.read().decode(errors="replace")


async def _wait_joined(
    engine: Engine,
    n: int,
    procs: Sequence[asyncio.subprocess.Process],
    logs: Sequence[IO[bytes]],
    deadline: float,
    clocks: dict[int, int] | None = None,
) -> None:
    """Wait until ``n`` workers have joined and each has pushed once, or (``clocks``) each has
    reached its clock there; RuntimeError with the workers' errors past ``deadline`` (monotonic
    s) or when one exits."""

    def ready() -> bool:
        facts = engine.members.facts
        if len(facts) < n or any(f.samples == 0 for f in facts.values()):
            return False
        return clocks is None or all(facts[w].clock >= c for w, c in clocks.items() if w in facts)

    while not ready():
        if time.monotonic() > deadline or any(p.returncode is not None for p in procs):
            late = time.monotonic() > deadline  # then every worker's last words, else the exited
            errors = [
                _tail(log)
                for p, log in zip(procs, logs, strict=True)
                if late or p.returncode is not None
            ]
            raise RuntimeError(
                f"{len(engine.members.facts)} of {n} workers joined, "
                f"{sum(f.samples > 0 for f in engine.members.facts.values())} pushed, within "
                f"{JOIN_TIMEOUT_S:g} s; worker errors: {errors}"
            )
        await asyncio.sleep(0.05)


def _restart(
    engine: Engine,
    recorder: Recorder,
    policy: PolicySpec,
    initial: tuple[dict[str, Any], Any, int],
) -> None:
    """The run's fresh start at t = 0 (module docstring), on the engine's task: a new policy of
    the same spec (observed again), then the initial parameters and optimizer state under a new
    version."""
    engine.swap_policy(policy.name, policy.build_params())
    engine.host.policy = recorder.wrap(engine.host.policy)
    params, opt_state, _ = initial
    engine.store.restore(params, opt_state, engine.store.version + 1)


class Churn:
    """A scenario's ``[[events]]`` in a real run (the module docstring): worker processes
    stopped at their times from t = 0. ``procs`` is the run's list of worker processes, worker
    i's at index i, joiners included: each connects at its time by itself (the module
    docstring), so a join here is only reported."""

    def __init__(
        self,
        sc: Scenario,
        procs: Sequence[asyncio.subprocess.Process],
        net: links_mod.NetnsLinks | None,
    ) -> None:
        self.sc, self.procs, self.net = sc, procs, net
        self.done: list[tuple[float, str]] = []  # (s from t = 0, what happened)

    async def run(self, now: Callable[[], float], wall_t0: float) -> None:
        """Carry out every event at its time; ``now()``: seconds since t = 0; ``wall_t0``: the
        wall-clock time of t = 0 a joiner is told."""
        for e in self.sc.events:
            await asyncio.sleep(max(0.0, e.at_s - now()))
            if isinstance(e, Join):  # its process connects by itself now (--emulate-join-at)
                what = f"w{e.worker} joins"
            else:
                proc = self.procs[e.worker]
                if e.how == "crash":
                    if self.net is not None:  # a machine that vanishes: nothing more gets out
                        self.net.down(e.worker)
                    with contextlib.suppress(ProcessLookupError):
                        proc.kill()
                else:
                    with contextlib.suppress(ProcessLookupError):
                        proc.send_signal(signal.SIGTERM)
                what = f"w{e.worker} {'crashed (SIGKILL)' if e.how == 'crash' else 'stopped (SIGTERM)'}"
            self.done.append((now(), what))
            print(f"hetd bench: t = {now():.2f} s: {what}", file=sys.stderr)


async def _measure(
    sc: Scenario,
    policy: PolicySpec,
    seed: int,
    lr: float,
    daemon: Daemon,
    recorder: Recorder,
    on_time: Callable[[float], None],
    procs: Sequence[asyncio.subprocess.Process],
    kept: KeptSnapshots | None,
    churn: Churn | None = None,
    late: frozenset[int] = frozenset(),
) -> RunResult:
    """Train for the budget from the moment every worker has joined, sampling the engine; the
    workers' emulation schedules start at the same moment. With ``kept`` the evaluations are
    deferred (the module docstring): evaluated after the budget, the workers stopped first;
    without, they run live."""
    engine = daemon.engine
    evaluate = engine.evaluations.evaluator
    assert evaluate is not None  # build_engine always sets one
    by_name = {f.name: wid for wid, f in engine.members.facts.items()}
    wids = {str(i): by_name[f"w{i}"] for i in range(sc.n) if i not in late}
    start = engine.clock.now()

    def joined() -> None:
        """Joiners (and the memory-poor workers) get their ids once they join (each a name of
        the scenario's, w<i>)."""
        for i in range(len(sc.all_workers)):
            if str(i) not in wids:
                wid = next((w for w, f in engine.members.facts.items() if f.name == f"w{i}"), None)
                if wid is not None:
                    wids[str(i)] = wid

    def anchor() -> None:
        # the daemon evaluates (or keeps) at t = k × eval_interval_s from here, as the simulator
        engine.evaluations.anchor(start)
        if kept is not None:
            engine.evaluations.keep(kept, engine.host.policy)
            kept(engine.store.snapshot(), start)  # t = 0's parameters

    await engine.queue.call(anchor)
    cpu0 = _cpu_s()
    wall_t0 = time.time() - (engine.clock.now() - start)
    await _start_schedules(procs, wall_t0)
    events = None
    if churn is not None and sc.events:
        events = asyncio.create_task(churn.run(lambda: engine.clock.now() - start, wall_t0))
    offset = start - engine.started_at
    # the device's idle time is the budget less the compute it reported (not the daemon's
    # pull-to-release wait, which counts a pipelined worker idle while it computes), as the
    # simulator counts it; not the idle each push reports either, whose first one after t = 0
    # carries the wait before it (the warm-up's)
    busy0 = {w: recorder.compute_s.get(wid, 0.0) for w, wid in wids.items()}
    samples0 = sum(engine.members.facts[wid].samples for wid in wids.values())  # joiners start at 0
    bytes0 = [
        (s.bytes_in, s.bytes_out, s.pushes, s.releases) for s in engine.members.stats.values()
    ]
    if kept is None:
        loss0, acc0 = await asyncio.to_thread(evaluate, engine.store.snapshot())
    trace = Trace(timeline={str(i): [] for i in range(len(sc.all_workers))})
    last_share = -math.inf
    t = 0.0
    moved0 = sum(b[0] + b[1] for b in bytes0)
    # bytes pushed + pulled since t = 0, sampled at every poll (bytes to target reads them at TTA)
    bytes_curve: list[list[float]] = [[0.0, 0.0]]
    while t < sc.budget_s:
        await asyncio.sleep(POLL_S)
        t = min(sc.budget_s, engine.clock.now() - start)
        joined()
        if events is not None and events.done():
            events.result()  # raises what went wrong starting or stopping a worker
        moved = sum(s.bytes_in + s.bytes_out for s in engine.members.stats.values()) - moved0
        bytes_curve.append([t, float(moved)])
        if t - last_share >= sc.eval_interval_s:
            last_share = t
            sizes = {
                w: f.batch_size for w, wid in wids.items() if (f := engine.members.facts.get(wid))
            }
            total = sum(sizes.values()) or 1
            trace.shares.append((t, {w: b / total for w, b in sizes.items()}))
            on_time(t)
    cpu = _cpu_s() - cpu0
    if events is not None and not events.done():  # an event past the budget never happens
        events.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await events
    if kept is not None:

        def last() -> None:
            assert kept is not None  # narrowed above; mypy does not carry it into the closure
            kept(engine.store.snapshot(), start + sc.budget_s)  # the final parameters
            engine.evaluations.keep(
                lambda snap, taken: None, engine.host.policy
            )  # keep nothing more

        await engine.queue.call(last)
    busy1 = dict(recorder.compute_s)  # at the end of the budget (pushes may arrive later)
    names = {wid: w for w, wid in wids.items()}
    for wid, spans in recorder.spans().items():
        if wid in names:
            trace.timeline[names[wid]] = [
                (t0 - start, min(t1, start + sc.budget_s) - start, "busy")
                for t0, t1 in spans
                if t1 > start and t0 < start + sc.budget_s
            ]
    if kept is None:
        final_loss, final_acc = await asyncio.to_thread(evaluate, engine.store.snapshot())
        evals = [(0.0, loss0, acc0)]  # (t, loss, accuracy) on the run's clock
        evals += [
            (e[0] - offset, e[1], e[2])
            for e in engine.evaluations.evals
            if 0 < e[0] - offset < sc.budget_s
        ]
        evals.append((sc.budget_s, final_loss, final_acc))
    stats = list(engine.members.stats.values())
    pushes = sum(s.pushes for s in stats) - sum(b[2] for b in bytes0)
    if kept is not None:
        await asyncio.to_thread(kept.wait)  # the last copies, so that the report counts them
    _report(policy, seed, kept, cpu, pushes, sc.budget_s)
    idle: dict[str, float] = {}
    staleness: list[int] = []
    samples = 0
    for w, wid in wids.items():
        f = engine.members.facts.get(wid) or engine.members.departed.get(wid)
        if f is None:
            continue
        busy = busy1.get(wid, 0.0) - busy0.get(w, 0.0)
        idle[w] = min(1.0, max(0.0, 1.0 - busy / _present_s(sc, int(w))))
        samples += f.samples
        staleness += engine.members.stats[
            wid
        ].staleness  # the engine keeps each worker's last ≤ 4096
    mean, p95 = staleness_stats(staleness)
    up = sum(s.bytes_in for s in stats) - sum(b[0] for b in bytes0)
    down = sum(s.bytes_out for s in stats) - sum(b[1] for b in bytes0)
    releases = sum(s.releases for s in stats) - sum(b[3] for b in bytes0)
    if kept is not None:  # stop the workers first: the evaluations have the host to themselves
        await stop_processes(list(procs))
        began = time.monotonic()
        done = await asyncio.to_thread(kept.evaluate, evaluate)
        evals = [(t - start, loss, acc) for t, loss, acc in done if 0 <= t - start <= sc.budget_s]
        print(
            f"hetd bench: {len(done)} kept evaluations in {time.monotonic() - began:.1f} s",
            file=sys.stderr,
        )
    return RunResult(
        policy=policy.label,
        scenario=sc.name,
        seed=seed,
        lr=lr,
        tta_s=time_to_target(evals, sc.target_accuracy, sc.target_loss),
        final_accuracy=evals[-1][2],
        samples_per_s=(samples - samples0) / sc.budget_s,
        idle_fraction=idle,
        staleness_mean=mean,
        staleness_p95=p95,
        bytes_up=up,
        bytes_down=down,
        pushes=pushes,
        releases=releases,
        curve=[[t, acc] for t, _, acc in evals],
        bytes_curve=bytes_curve,
        trace=trace,
        stages=[[t - offset, st] for t, st in engine.host.stages],
        evals="live" if kept is None else "deferred",
    )


def _present_s(sc: Scenario, i: int) -> float:
    """Seconds of the budget worker ``i`` was in the run (churn: from its join to its leave)."""
    start = next((e.at_s for e in sc.events if isinstance(e, Join) and e.worker == i), 0.0)
    end = next((e.at_s for e in sc.events if not isinstance(e, Join) and e.worker == i), None)
    return max(1e-9, min(sc.budget_s, sc.budget_s if end is None else end) - start)


def keeper_for(running: Policy, opts: EvalOptions) -> KeptSnapshots | None:
    """The keeper of a run's deferred evaluations, or None to evaluate live: ``opts.mode`` is
    live, or the running policy reads ``Eval`` events (said on standard error)."""
    if opts.mode != "deferred":
        return None
    if running.reads_evals:
        print(
            f"hetd bench: {running.name} reads Eval events (e.g. its stages follow the loss): "
            "its evaluations stay live",
            file=sys.stderr,
        )
        return None
    return KeptSnapshots(opts.cap_bytes, threaded=True)  # the engine's task only hands it over


def _cpu_s() -> float:
    """CPU seconds of this process (the daemon, its threads and the bench's sampling)."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _report(
    policy: PolicySpec,
    seed: int,
    kept: KeptSnapshots | None,
    cpu_s: float,
    pushes: int,
    budget_s: float,
) -> None:
    """One line on standard error: the run's evaluation mode and the daemon's CPU per update."""
    how = "live"
    if kept is not None:
        how = f"deferred ({len(kept)} kept, {kept.spilled} spilled to disk past the cap)"
    per = f"{cpu_s / pushes * 1e3:.1f} ms" if pushes else "–"
    print(
        f"hetd bench: {policy.label} seed {seed}: evaluations {how}; daemon process CPU "
        f"{cpu_s:.1f} s in {budget_s:g} s ({cpu_s / budget_s:.2f} of a core), {pushes} updates "
        f"({pushes / budget_s:.1f}/s), {per} CPU per update",
        file=sys.stderr,
    )


def run_real(
    sc: Scenario,
    policy: PolicySpec,
    seed: int,
    lr: float,
    on_time: Callable[[float], None],
    links: str = "emulated",
    evals: EvalOptions = EvalOptions(),
    observe: Callable[[Engine], None] | None = None,
) -> RunResult:
    """One real run (blocking): daemon + worker processes for ``sc.budget_s`` s, on loopback with
    emulated links, or (``links="netns"``, root) each worker behind its own shaped link
    (:mod:`hetd.bench.links`); evaluations deferred or live (``evals``, the module docstring);
    churn as the scenario's ``[[events]]`` say (:class:`Churn`). ``observe``: handed the
    daemon's engine before any worker starts."""
    return asyncio.run(_run(sc, policy, seed, lr, on_time, links, evals, observe))
