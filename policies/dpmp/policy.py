"""The ``dpmp`` policy: synchronous rounds over replicas whose structure the controller plans
(docs/policies.md §11).

Each round the controller (:func:`policies.dpmp.controller.plan_round`) takes every worker the
engine knows (the view's replicas and data-parallel workers, and the replicas' later stages),
the model's blocks and the global batch, and gives the replicas: data-parallel workers with their
share of the batch (a plan's ``batch_size``), the pipeline replicas (a ``Regroup`` the
engine's replica driver carries out), the idle rest. The round is bsp over the working replicas
only: every push is buffered with its samples as weight, the round is flushed when each working
replica has pushed once, then the next round is planned and its replicas are released. The
realised round time and cost (busy workers × ``price`` × seconds) go back to the controller's
Lyapunov queues; the structure changes only with the hysteresis of :mod:`policies.dpmp.groups`
(``period``, ``keep``), at once when a member is lost.

A pipeline shape that has pushed no step yet is *warming*: its stages compile their kernels on
(or, with ``hetd-worker``, ahead of) its first step, seconds on a CPU, and the rounds go on
without it until that step's push comes in (buffered into the round then under way); from the
next round on it is one of the working replicas. What the compile took (the first step less
the median of the next ones) is each member's ``compile_s``, which the hysteresis charges to a
move to new shapes (:func:`policies.dpmp.groups.switch_cost`).

What a worker is, for the planner: seconds per sample from its pushes (else from its profile;
else, for a worker only pipeline stages have timed, from its replica's measured steps,
:mod:`policies.dpmp.calibrate`; the median of the others while none of these is known), its
reported free memory (``free_mem``: the daemon reads it from the hello and the pushes;
``hetd-worker --emulate-memory`` sets it), and its measured link both ways (the median of the
measured links while its own is not measured).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from policies.dpmp.calibrate import stage_speed
from policies.dpmp.controller import DpmpConfig, DpmpState, ReplicaSpec, end_round, plan_round
from policies.dpmp.costs import Block, WorkerSpec
from policies.dpmp.groups import GroupConfig, GroupState, evaluate
from policies.dpmp.lyapunov import LyapunovConfig
from policies.registry import register
from policies.types import (
    Buffer,
    ClusterView,
    Decision,
    Event,
    Flush,
    Join,
    Leave,
    Policy,
    Pull,
    Push,
    Regroup,
    Release,
    ReplicaShape,
    SetPlan,
    WorkerFacts,
)

PROBE = 4  # samples per round for a data-parallel worker the plan left without work
KEPT = 6  # a replica's measured steps kept (the median of all but its first calibrates its stages)
OVERHEADS = 12  # data-parallel steps whose fixed work is kept (the least is the figure)
MIN_OVERHEADS = 3  # ... before it is used
DEFAULT_SAMPLE_S = 1e-3  # s per sample of a worker nobody has measured yet (only shares matter)

ShapeKey = tuple[tuple[int, ...], tuple[int, ...], int]  # a replica's (members, cuts, micro)


def _key(p: ReplicaShape) -> ShapeKey:
    return (tuple(p.members), tuple(p.cuts), p.micro)


@dataclass(frozen=True, slots=True)
class DpmpPolicyState:
    """The controller's state and the current round."""

    ctl: DpmpState = field(default_factory=DpmpState)
    working: tuple[int, ...] = ()  # the round's replicas (heads and data-parallel workers)
    warming: tuple[int, ...] = ()  # heads of new pipeline shapes on their first step (not waited)
    pushed: frozenset[int] = frozenset()  # ... that pushed this round
    released: frozenset[int] = frozenset()  # ... released at its start (their steps are timed)
    pipelines: tuple[ReplicaShape, ...] = ()  # the pipeline replicas the plan runs
    started: float | None = None  # when the round began (None: no round yet)
    tau: float = 0.0  # s, the round's predicted time
    reason: str = ""  # why the structure is what it is
    structure: str = ""  # the round's replicas, for status pages
    # a running replica's (members, cuts, micro) -> its last steps as (wall s, samples)
    measured: Mapping[ShapeKey, tuple[tuple[float, int], ...]] = field(default_factory=dict)
    speeds: Mapping[int, float] = field(default_factory=dict)  # s/sample of stage-only workers
    cut: bool = False  # the structure was planned with the model's blocks (not as one block)
    # the last data-parallel steps' fixed work (s): release to push less compute and transfers
    overheads: tuple[float, ...] = ()
    firsts: Mapping[ShapeKey, float] = field(default_factory=dict)  # s, a new shape's first step
    compiles: Mapping[int, float] = field(default_factory=dict)  # s, a worker's last stage compile

    def describe(self) -> dict[str, Any]:
        return {
            "round": self.ctl.round,
            "working": list(self.working),
            "warming": list(self.warming),
            "pushed": sorted(self.pushed),
            "pipelines": [
                {
                    "members": list(p.members),
                    "cuts": list(p.cuts),
                    "micro": p.micro,
                    "micro_batches": p.micro_batches,
                }
                for p in self.pipelines
            ],
            "predicted_round_s": self.tau,
            "reason": self.reason,
            "structure": self.structure,
            "queues": list(self.ctl.lyapunov.queues),
            "stage_speeds": {str(w): v for w, v in sorted(self.speeds.items())},
            "step_overhead_s": step_overhead(self),
            "compile_s": {str(w): v for w, v in sorted(self.compiles.items())},
        }


def own_speed(view: ClusterView, f: WorkerFacts) -> float | None:
    """Seconds per sample of worker ``f`` as timed by itself: its pushes, else its profile
    (None: neither has timed it)."""
    # Its pushes first: they follow its speed as it changes (a transient straggler); the
    # profile run measured it once, at its join. A replica's head pushes the whole replica's
    # steps, and a later stage none: their profile stands for them.
    if f.sample_s is not None and f.sample_s > 0 and f.worker not in view.replicas:
        return f.sample_s
    measured = (f.profile or {}).get("sample_s")
    if measured is not None and measured > 0:
        return float(measured)
    return None


def worker_specs(
    view: ClusterView,
    price: float,
    speeds: Mapping[int, float] | None = None,
    step_s: float = 0.0,
    compiles: Mapping[int, float] | None = None,
) -> dict[int, WorkerSpec]:
    """What the planner knows of every worker: the view's and the replicas' later stages'.
    ``speeds``: s/sample of workers known only by their replica's steps (used when the worker
    has not timed itself); ``step_s``: the fixed work of a step (:func:`step_overhead`);
    ``compiles``: s a new stage shape's compile took the workers that ran one
    (:func:`compile_times`)."""
    facts: dict[int, WorkerFacts] = {**view.workers, **view.stage_workers}
    known_speeds = speeds or {}

    def own(f: WorkerFacts) -> float | None:
        return own_speed(view, f) or known_speeds.get(f.worker)

    known = [s for f in facts.values() if (s := own(f)) is not None]
    fallback = statistics.median(known) if known else DEFAULT_SAMPLE_S
    # A link nobody measured (a worker that has only run stages pushes nothing of its own) is
    # taken as the median of the measured ones, as an unknown speed is: unweighed (infinite),
    # a pipeline's transfers would be charged to its stages' compute when their speed is
    # calibrated from its steps, and the split would give it too little.
    links = [f.link_bps for f in facts.values() if f.link_bps is not None and f.link_bps > 0]
    link_guess = statistics.median(links) if links else math.inf
    specs = {}
    for wid, f in facts.items():
        link = f.link_bps if f.link_bps is not None and f.link_bps > 0 else link_guess
        mem = float(f.free_mem) if f.free_mem is not None and f.free_mem > 0 else math.inf
        specs[wid] = WorkerSpec(
            wid,
            own(f) or fallback,
            mem_bytes=mem,
            bw_up=link,
            bw_down=link,
            price=price,
            stages=f.stages,
            step_s=step_s,
            compile_s=(compiles or {}).get(wid),
        )
    return specs


def whole_model_bytes(view: ClusterView) -> float:
    """A model that is not block-structured, as the planner's one block: as big as the largest
    push measured (0 before any: its memory and its transfers are then not weighed)."""
    sizes = [f.push_bytes for f in view.workers.values() if f.push_bytes]
    return max(sizes, default=0.0)


def probed(specs: Sequence[ReplicaSpec]) -> list[ReplicaSpec]:
    """The plan with every data-parallel worker it left without work given :data:`PROBE`
    samples, taken from the largest data-parallel share. Its speed is measured by its pushes
    only: one planned out while it was slow (a transient straggler) would stay idle for good on
    the speed it had then. (LB-BSP keeps the same floor, ``b_min``.)"""
    out = list(specs)
    for i, spec in enumerate(out):
        if spec.batch > 0 or len(spec.members) != 1:
            continue
        dp = [j for j, s in enumerate(out) if len(s.members) == 1 and s.batch >= 2 * PROBE]
        if not dp:
            break
        j = max(dp, key=lambda k: out[k].batch)
        out[j] = replace(out[j], batch=out[j].batch - PROBE)
        out[i] = replace(spec, batch=PROBE)
    return out


def measure(st: DpmpPolicyState, push: Push) -> DpmpPolicyState:
    """A running pipeline replica's step, timed: its head's push carries the step's wall time
    from the driver's release to the last part; the round waits from its start to the push, and
    a step released at the round's start is timed so. (In real mode the head's work around a replica step,
    cutting and encoding the stages' slices before, decoding and checking the parts after,
    took 20-100 ms beyond the driver's wall, and the round waited on the replica for it.)"""
    shape = next((p for p in st.pipelines if p.members[0] == push.worker), None)
    if shape is None or push.samples < 1 or not push.compute_s > 0:
        return st
    wall = push.compute_s
    if st.started is not None and push.worker in st.released - st.pushed:
        wall = max(wall, push.now - st.started)
    key = _key(shape)
    kept = (*st.measured.get(key, ())[-(KEPT - 1) :], (wall, push.samples))
    firsts = st.firsts if key in st.measured else {**st.firsts, key: wall}
    return replace(st, measured={**st.measured, key: kept}, firsts=firsts)


def compile_times(st: DpmpPolicyState) -> DpmpPolicyState:
    """What a new pipeline shape's compile took, once the shape has stepped again: its first
    step (the stages compile on it) less the median of the later ones, for every member (the
    slowest member's compile is the step's). The planner charges it to a move to new shapes
    (:func:`policies.dpmp.groups.switch_cost`)."""
    compiles, firsts = dict(st.compiles), dict(st.firsts)
    for p in st.pipelines:
        key = _key(p)
        later = st.measured.get(key, ())[1:]
        first = firsts.get(key)
        if first is None or not later:
            continue
        took = max(0.0, first - statistics.median(w for w, _ in later))
        compiles.update(dict.fromkeys(p.members, took))
        del firsts[key]
    return replace(st, compiles=compiles, firsts=firsts)


def overhead(
    st: DpmpPolicyState, push: Push, view: ClusterView, blocks: Sequence[Block], price: float
) -> DpmpPolicyState:
    """A data-parallel step released at the round's start, timed from then to its push: what it
    took beyond its own compute and the transfers of the whole model both ways (the planner's
    prediction of it) is fixed work per step, the head's and the host's handling of its frames.
    A pipeline replica's measured steps carry the same work; without this figure the stage-speed
    calibration reads it as compute of the replica while the data-parallel workers' predictions
    leave it out, and the split gives them too much of the batch."""
    if (
        st.started is None
        or push.worker not in st.released - st.pushed  # released later: a join, a pull
        or any(p.members[0] == push.worker for p in st.pipelines)
        or push.samples < 1
        or not push.compute_s > 0
    ):
        return st
    spec = worker_specs(view, price, st.speeds).get(push.worker)
    if spec is None:
        return st
    params = sum(b.param_bytes for b in blocks)
    links = params / spec.bw_up + params / spec.bw_down + 2 * spec.lat_s
    extra = max(0.0, push.now - st.started - push.compute_s - links)
    return replace(st, overheads=(*st.overheads[-(OVERHEADS - 1) :], extra))


def step_overhead(st: DpmpPolicyState) -> float:
    """The fixed work of a step (s): the least of the last data-parallel steps' (0 before
    :data:`MIN_OVERHEADS` of them). A floor, not a median: what else a step meets (its worker's
    profile or compile after a join, a straggling moment) only adds to it, and a figure read too
    high would give the pipelines the data-parallel workers' shares, and with no share a worker
    pushes no step that could correct it."""
    if len(st.overheads) < MIN_OVERHEADS:
        return 0.0
    return min(st.overheads)


def calibrated(
    view: ClusterView, blocks: Sequence[Block], price: float, st: DpmpPolicyState
) -> dict[int, float]:
    """The speeds of the workers only pipeline stages have timed: per running replica with
    measured steps, its untimed members' speeds that predict each step as measured
    (:func:`policies.dpmp.calibrate.stage_speed`), the median over its kept steps."""
    speeds = dict(st.speeds)
    facts: dict[int, WorkerFacts] = {**view.workers, **view.stage_workers}
    for p in st.pipelines:
        # A shape's first step is left out: its stages compile then, and a speed read from it
        # would plan the replica away for good (no step of it would be measured again).
        steps = st.measured.get(_key(p), ())[1:]
        if not steps or any(w not in facts for w in p.members):
            continue
        guessed = frozenset(w for w in p.members if own_speed(view, facts[w]) is None)
        if not guessed:
            continue
        specs = worker_specs(view, price, speeds, step_overhead(st))
        group = [specs[w] for w in p.members]
        found: dict[int, list[float]] = {}
        for wall, samples in steps:
            count = max(1, samples // p.micro)
            for w, v in stage_speed(blocks, group, guessed, p.cuts, p.micro, count, wall).items():
                found.setdefault(w, []).append(v)
        speeds.update({w: statistics.median(vs) for w, vs in found.items()})
    return speeds


def warming_split(
    blocks: Sequence[Block],
    workers: Mapping[int, WorkerSpec],
    total: int,
    specs: Sequence[ReplicaSpec],
    measured: Mapping[ShapeKey, Any],
) -> tuple[list[ReplicaSpec], float | None]:
    """The plan with the round's batch split over the replicas that run in it while a new
    pipeline shape (none of its steps ``measured``) warms outside the round: its first step
    keeps its planned share, the others finish together on the whole batch (a round of theirs
    alone on their planned shares would leave the warming replica's part of the batch undone).
    Also the round's predicted time (None: nothing warms, the plan is unchanged)."""
    warm = {s.replica for s in specs if len(s.members) > 1 and _spec_key(s) not in measured}
    rest = [s for s in specs if s.replica not in warm and s.batch > 0]
    if not warm or not rest:
        return list(specs), None
    groups = tuple(sorted(tuple(sorted(s.members)) for s in rest))
    kept = [_spec_key(s) for s in rest if len(s.members) > 1]
    split = evaluate(blocks, workers, total, groups, kept=kept)
    if split is None:
        return list(specs), None
    sizes = {r.members: b for r, b in zip(split.replicas, split.split.sizes, strict=True)}
    out = [
        s if s.replica in warm or s.members not in sizes else replace(s, batch=sizes[s.members])
        for s in specs
    ]
    return out, split.tau


def _spec_key(s: ReplicaSpec) -> ShapeKey:
    return (tuple(s.members), tuple(s.cuts), s.micro)


def _blocks(view: ClusterView) -> list[Block]:
    """The model's blocks; a model that cannot be cut is one block (data parallel only)."""
    blocks = [Block(f"b{j:02d}", p, a, fl) for j, (p, a, fl) in enumerate(view.blocks)]
    return blocks or [Block("model", whole_model_bytes(view), 0.0, 1.0)]


def _dp_round(view: ClusterView) -> tuple[list[int], dict[int, int]]:
    """Every worker in the view data parallel with an equal share (no plan possible)."""
    working = sorted(view.workers)
    share = max(1, view.global_batch // max(1, len(working)))
    return working, dict.fromkeys(working, share)


@register("dpmp")
def dpmp(
    v: float = 10.0,
    budget: float = math.inf,
    price: float = 1.0,
    period: int = 50,
    keep: float = 0.75,
) -> Policy:
    """Joint data + model parallelism: ``v`` weighs the round time against the money queue,
    ``budget`` is the money per round (``price`` per busy worker-second; inf: no constraint),
    ``period`` and ``keep`` the regroup hysteresis (at most once per ``period`` rounds, for a
    predicted round ≤ ``keep`` × the current one)."""
    if not (0 < keep <= 1):
        raise ValueError(f"keep must be in (0, 1], got {keep}")
    if period < 1:
        raise ValueError(f"period must be >= 1, got {period}")
    if not (price > 0 and math.isfinite(price)):
        raise ValueError(f"price must be a positive finite number, got {price}")
    cfg = DpmpConfig(
        groups=GroupConfig(period=period, keep=keep),
        lyapunov=LyapunovConfig(v=v, budgets=(budget,)),
    )

    def init(view: ClusterView) -> DpmpPolicyState:
        return DpmpPolicyState()

    def plan(view: ClusterView, st: DpmpPolicyState) -> tuple[list[Decision], DpmpPolicyState]:
        """Start a round: structure, shares, releases."""
        st = compile_times(st)
        ctl = st.ctl
        whole = not view.blocks  # a model that cannot be cut: one block, data parallel only
        blocks = _blocks(view)
        shapes: list[ReplicaShape] = []
        specs: Sequence[ReplicaSpec] = ()
        speeds = calibrated(view, blocks, price, st)
        if not whole and not st.cut and ctl.groups.current is not None:
            # Planned before the blocks were known (a policy swap's trial view carries none):
            # no pipeline could be formed then, so the hysteresis has nothing to hold.
            ctl = replace(ctl, groups=GroupState())
        try:
            wspecs = worker_specs(view, price, speeds, step_overhead(st), st.compiles)
            planned, ctl = plan_round(blocks, wspecs, view.global_batch, ctl, cfg)
            specs, tau, reason = planned.replicas, planned.tau, planned.reason
            specs, warm_tau = warming_split(blocks, wspecs, view.global_batch, specs, st.measured)
            tau = tau if warm_tau is None else warm_tau
        except ValueError as exc:
            if not whole:  # nobody here can train the model: wait for workers that can
                wait = f"waiting: {exc}"
                return [], replace(st, ctl=ctl, working=(), started=None, reason=wait)
            tau, reason = 0.0, f"data parallel: {exc}"
        working: list[int] = []
        warming: list[int] = []
        batches: dict[int, int] = {}
        for spec in probed(specs):
            if spec.batch <= 0:
                continue
            if len(spec.members) == 1:
                working.append(spec.members[0])
                batches[spec.members[0]] = spec.batch
            else:
                shape = ReplicaShape(
                    spec.members,
                    spec.cuts,
                    spec.micro,
                    max(1, round(spec.batch / spec.micro)),
                    spec.inflight,
                )
                shapes.append(shape)
                # A shape with no step pushed yet runs its first one (its stages compile) outside
                # the round: no round waits on a compile.
                (working if _key(shape) in st.measured else warming).append(spec.members[0])
        if not working:  # nothing else to run: the round waits for the replicas' first steps
            working, warming = warming, []
        if not working:
            working, batches = _dp_round(view)
            shapes = []
        out: list[Decision] = []
        if shapes or view.replicas:
            out.append(Regroup(tuple(shapes)))
        for wid, b in batches.items():
            f = view.workers.get(wid)
            if f is not None and f.batch_size != b:
                out.append(SetPlan(wid, {"batch_size": b}))
        # A replica being formed is released by its driver, never here: if it is not formed,
        # a Release would run its head as a data-parallel worker (one that may not hold the
        # model). A running replica and the data-parallel workers are released when they wait.
        heads = {p.members[0]: p.members for p in shapes}
        for wid in working:
            f = view.workers.get(wid)
            if f is None or not f.waiting:
                continue
            if wid in heads and view.replicas.get(wid) != heads[wid]:
                continue
            out.append(Release(wid))
        desc = " ".join(
            f"[{'+'.join(map(str, s.members))} b={s.batch}]" for s in specs if s.batch > 0
        )
        new = replace(
            st,
            ctl=ctl,
            cut=not whole,
            speeds=speeds,
            measured={k: v for k, v in st.measured.items() if k in {_key(p) for p in shapes}},
            firsts={k: v for k, v in st.firsts.items() if k in {_key(p) for p in shapes}},
            working=tuple(working),
            warming=tuple(warming),
            pushed=frozenset(),
            released=frozenset(d.worker for d in out if isinstance(d, Release)),
            pipelines=tuple(shapes),
            started=view.now,
            tau=tau,
            reason=reason,
            structure=desc,
        )
        return out, new

    def update(
        event: Event, st: DpmpPolicyState, view: ClusterView
    ) -> tuple[Sequence[Decision], DpmpPolicyState]:
        out: list[Decision] = []
        if not isinstance(event, Join | Leave):
            # A planned pipeline replica that is not running (its driver gave up on a step, or
            # could not form it) is out of this round: the round must not wait for a push that
            # will not come, nor release its head as a data-parallel worker. The next round
            # plans it again. (Join and Leave also come while the driver regroups, before it
            # has formed what the plan asks for: they never count.)
            lost = [p for p in st.pipelines if view.replicas.get(p.members[0]) != p.members]
            if lost:
                gone = {p.members[0] for p in lost} - st.pushed
                st = replace(
                    st,
                    working=tuple(w for w in st.working if w not in gone),
                    pipelines=tuple(p for p in st.pipelines if p not in lost),
                )
        if isinstance(event, Push):
            out.append(Buffer(float(event.samples)))
            st = measure(st, event)
            st = overhead(st, event, view, _blocks(view), price)
            if event.worker in st.working:
                st = replace(st, pushed=st.pushed | {event.worker})
        elif isinstance(event, Leave) and event.worker in st.working:
            st = replace(st, working=tuple(w for w in st.working if w != event.worker))
        elif isinstance(event, Pull) and event.worker in st.working:
            f = view.workers.get(event.worker)
            if event.worker not in st.pushed and f is not None and f.waiting:
                out.append(Release(event.worker))  # it came back in the middle of its round
        present = [w for w in st.working if w in view.workers]
        done = st.started is not None and all(w in st.pushed for w in present)
        if st.started is not None and not done:
            return out, st
        if not view.workers:
            return out, st
        buffered = view.buffered + (1 if isinstance(event, Push) else 0)
        if buffered:
            out.append(Flush(normalize=True))
        if st.started is not None and present:
            took = max(0.0, view.now - st.started)
            busy = len(present) + sum(
                len(p.members) - (p.members[0] in present) for p in st.pipelines
            )
            st = replace(st, ctl=end_round(st.ctl, cfg, took, [took * price * busy]))
        decisions, st = plan(view, st)
        return out + decisions, st

    params = {"v": v, "budget": budget, "price": price, "period": period, "keep": keep}
    return Policy("dpmp", init, update, params)
