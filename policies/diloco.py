"""The DiLoCo family (docs/policies.md §13): local SGD with an outer optimizer, sync and async.

``diloco`` runs synchronous outer rounds: every worker takes ``H`` inner steps from the same global
parameters, with a batch sized (as LB-BSP sizes it, §7) so that all finish together; the daemon
takes the sample-weighted mean of their pseudo-gradients and applies it once, through the outer
optimizer (``[train] outer_optimizer``; ``"auto"``, the default, resolves through
:func:`outer_for`: DiLoCo's ``nesterov:lr=0.7,momentum=0.9`` over an SGD-family inner optimizer,
plain averaging over adam).

``diloco_async`` never holds anyone: each worker's ``H_i = max(h_min, round(H · c_min / c_i))``
follows its measured step time ``c_i`` (DyLU), so every worker's round takes about as long, and each
delta is applied on arrival with weight ``1/√(1+τ') / N``, ``τ'`` the versions beyond the other
workers' one arrival each (:func:`staleness_factor`). The weight goes *into* the outer optimizer
(a one-push buffer flushed at once, not ``Apply``, which scales the optimizer's output), so with a
configured ``delayed_nesterov:...,period=N`` the momentum sees the weighted deltas. Its default
outer optimizer is plain averaging (:func:`outer_for`: an outer gain above 1 on stale deltas
slows it down).

Pure: no I/O, no clock, no arrays.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from policies import profiling as prof
from policies.compose import release_waiting
from policies.finish import Timing, quantized
from policies.profiling import ProfilingConfig, WorkerTrack, freeze, is_int
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
    Push,
    SetPlan,
    Tick,
)

# The outer optimizer each policy is meant to run with ([train] outer_optimizer = "auto", the
# default; docs/policies.md §13). The policies do not set it: it is the daemon's configuration, and
# a policy's parameters are only its factory's (a PATCH rebuilds the policy from them).
SYNC_OUTER = "nesterov:lr=0.7,momentum=0.9"
# Liu et al.'s delayed Nesterov for diloco_async, N the number of workers: configured only, no
# longer the default (outer_for; docs/policies.md §13.2).
ASYNC_OUTER = "delayed_nesterov:lr=0.7,momentum=0.9,period=N"
PLAIN_OUTER = "sgd:lr=1"  # deltas added as they are (with the policy's weight)
AUTO_OUTER = "auto"  # the configuration's default: outer_for decides
# Inner optimizers whose step is the gradient times a learning rate: their pseudo-gradient is a sum
# of gradients, which an outer momentum accelerates. An adaptive one (adam) already takes steps of
# about its learning rate per coordinate; Nesterov at 0.7/0.9 moves up to 0.7/(1-0.9) = 7 times the
# mean pseudo-gradient on top of that, which overshoots within the tens of rounds a run has.
_SGD_FAMILY = ("sgd", "momentum", "nesterov")


def outer_for(policy: str, params: Mapping[str, Any], workers: int, inner: str = "sgd") -> str:
    """The outer optimizer for ``policy`` (a registered name, with its factory ``params``), run by
    ``workers`` workers whose inner optimizer is ``inner`` (a spec such as ``"adam:lr=0.002"``):
    for ``diloco`` (and a ``quorum`` around it) DiLoCo's Nesterov when the inner optimizer is of
    the SGD family; plain averaging (:data:`PLAIN_OUTER`) for an adaptive inner optimizer, for
    ``diloco_async`` whatever its inner optimizer, and for every other policy.
    The one place that decides: ``hetd serve``, the simulator and the benchmark all resolve
    ``outer_optimizer = "auto"`` through it.

    Why not delayed Nesterov (:data:`ASYNC_OUTER`) for ``diloco_async`` [D]: an outer step larger
    than the deltas' mean accelerates a synchronous round, whose deltas all start from the
    parameters it moves; an asynchronous delta starts ``N − 1`` arrivals back, and its worker
    restarted before the round's other deltas (and the momentum's look-ahead) were in, so a gain
    above 1 overshoots. Measured (docs/benchmark.md, sim, 3 seeds): plain averaging reached the
    target sooner than delayed Nesterov on S1 (2.83 against 3.34 s), S3b (3.27 against 3.68)
    and S6_5x (3.00 against 4.93); a plain outer lr of 1.5 or 2 was slower still. ``workers``:
    unused since (a configured delayed Nesterov names its own period)."""
    del workers
    if policy == "quorum":
        policy = str(params.get("policy", "diloco"))
    if inner.split(":", 1)[0].strip() not in _SGD_FAMILY:
        return PLAIN_OUTER
    if policy == "diloco":
        return SYNC_OUTER
    return PLAIN_OUTER


def _check_codec(codec: object) -> None:
    if codec is not None and not (isinstance(codec, str) and codec.strip()):
        raise ValueError(f"codec must be a codec spec such as 'int8', or None, got {codec!r}")


def _check_h(name: str, value: object) -> None:
    if not is_int(value, 1):
        raise ValueError(f"{name} must be an int >= 1 (inner steps per outer round), got {value!r}")


# --- diloco (synchronous) ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class DilocoState:
    """Per worker: the timing of one inner step at its batch (EWMA fit ``a + c·b``), its batch and
    the local steps announced to it; ``fresh`` until the first event told the engine every plan."""

    timing: Mapping[int, Timing]
    batches: Mapping[int, int]
    rounds: int = 0  # outer rounds completed (flushed)
    fresh: bool = True
    steps: Mapping[int, int] = field(default_factory=dict)


def equal_finish_batches(
    total: int,
    timing: Mapping[int, Timing],
    workers: Sequence[int],
    b_min: int,
    quantum: int,
) -> dict[int, int]:
    """Per-step batches summing to ``total`` whose predicted step times ``a_i + c_i·b_i`` are
    equal (§7's solve, in quanta of ``quantum`` samples, 0: automatic). Workers without a timing
    take the mean per-sample cost of the others (or 1 s per sample when none has one)."""
    fits = [timing.get(w, Timing()).fit() for w in workers]
    known = [f for f in fits if f is not None]
    c_mean = sum(f[1] for f in known) / len(known) if known else 1.0
    a = [f[0] if f else 0.0 for f in fits]
    c = [f[1] if f else c_mean for f in fits]
    lo = [min(b_min, total) for _ in workers]
    hi = [total for _ in workers]
    return dict(zip(workers, quantized(total, a, c, lo, hi, quantum), strict=True))


@register("diloco")
def diloco(
    H: int = 50,
    global_batch: int | None = None,
    b_min: int = 4,
    eps: float = 0.05,
    quantum: int = 0,
    shares: bool = True,
    calibrate: bool = True,
    codec: str | None = None,
    balance: str = "steps",
) -> Policy:
    """DiLoCo (Douillard et al. 2023): synchronous outer rounds of inner steps that every worker
    ends together; the round's deltas averaged by samples and applied once through the outer
    optimizer (``outer_optimizer = "auto"``: :func:`outer_for`). ``global_batch``: samples per
    inner step in total (None: the config's). ``balance``: how the workers end together:
    ``"steps"`` (every worker at ``B/N``; the fastest runs ``H`` inner steps and each other as
    many as end its round with it, its transfers on its measured link included,
    :func:`finish_together_steps`) or ``"batch"`` (``H`` steps each, the batches sized so that
    all finish together, §7's solve). ``shares=False`` (with ``"batch"``): ``B/N`` and ``H``
    each, the paper's setting, where the round waits for the slowest.
    ``calibrate``: a worker whose step time is not known yet (no push, no profile) runs rounds of
    one inner step, so the first ``H``-step round is already sized to finish together instead of
    waiting ``H`` steps for the slowest worker at ``B/N``. ``codec``: the pseudo-gradients' codec
    (e.g. ``"int8"``, with the worker's error feedback; None: the configuration's); a dense one
    (int8, int4, bf16, fp16) also carries the worker's parameters, as outer steps against what
    it holds (the engine's downlink)."""
    _check_h("H", H)
    _check_codec(codec)
    if global_batch is not None and not is_int(global_batch, 1):
        raise ValueError(f"global_batch must be a positive int or None, got {global_batch!r}")
    if not is_int(b_min, 1):
        raise ValueError(f"b_min must be an int >= 1, got {b_min!r}")
    if not (isinstance(eps, int | float) and math.isfinite(eps) and eps >= 0):
        raise ValueError(f"eps must be a finite number >= 0, got {eps!r}")
    if not is_int(quantum, 0):
        raise ValueError(f"quantum must be an int >= 0 (0: automatic), got {quantum!r}")
    if not isinstance(shares, bool):
        raise ValueError(f"shares must be true or false, got {shares!r}")
    if not isinstance(calibrate, bool):
        raise ValueError(f"calibrate must be true or false, got {calibrate!r}")
    if balance not in ("batch", "steps"):
        raise ValueError(f"balance must be 'batch' or 'steps', got {balance!r}")
    by_steps = balance == "steps"

    fields: dict[str, Any] = {"push_kind": "delta"} | ({"codec": codec} if codec else {})

    def step_counts(st: DilocoState, view: ClusterView) -> dict[int, int]:
        """Each worker's inner steps: ``H``, or with ``balance="steps"`` the count that ends its
        round with the fastest worker's (:func:`finish_together_steps`: step time at its batch,
        and the round's push and pull on its measured link); a worker without a timing gets
        ``H``. A change within ``eps`` of the announced count keeps it (no re-plan per round
        for the timing's noise)."""
        if not by_steps:
            return dict.fromkeys(view.workers, H)
        step_s, comm_s = {}, {}
        for w, f in view.workers.items():
            fit = st.timing.get(w, Timing()).fit()
            b = st.batches.get(w, f.batch_size)
            step_s[w] = 0.0 if fit is None else max(0.0, fit[0] + fit[1] * b)
            comm_s[w] = round_trip_s(f.push_bytes, f.link_bps)
        want = finish_together_steps(step_s, comm_s, H)
        for w, n in want.items():
            old = st.steps.get(w)
            if old is not None and old != 1 and abs(n - old) <= eps * old:
                want[w] = old
        return want

    def profiled(st: DilocoState, view: ClusterView) -> DilocoState:
        """Timings seeded from the engine's profile exchange for workers that have none yet."""
        t = dict(st.timing)
        for w, f in view.workers.items():
            sample_s = (f.profile or {}).get("sample_s")
            if w not in t and isinstance(sample_s, int | float) and 0 < sample_s < math.inf:
                b = max(1, f.batch_size)
                t[w] = Timing().add(float(b), float(sample_s) * b)
        return st if len(t) == len(st.timing) else replace(st, timing=freeze(t))

    def local_steps(st: DilocoState, view: ClusterView, joined: int | None) -> list[SetPlan]:
        """Announce ``H`` (1 while a worker's speed is unknown, with ``calibrate``) on a change,
        and to a worker that (re)joined."""
        out: list[SetPlan] = []
        counts = step_counts(st, view)
        for w in sorted(view.workers):
            want = counts[w] if (not calibrate or w in st.timing) else 1
            if st.steps.get(w) != want or w == joined:
                out.append(SetPlan(w, {"local_steps": want, **fields}))
        return out

    def init(view: ClusterView) -> DilocoState:
        return DilocoState(freeze({}), freeze({w: f.batch_size for w, f in view.workers.items()}))

    def plan(st: DilocoState, view: ClusterView, force: bool) -> tuple[list[Decision], DilocoState]:
        workers = sorted(view.workers)
        if not workers:
            return [], st
        total = global_batch or view.global_batch
        current = {w: st.batches.get(w, max(1, total // len(workers))) for w in workers}
        fits = {w: st.timing.get(w, Timing()).fit() for w in workers}
        times = [(f[0] + f[1] * current[w]) for w, f in fits.items() if f is not None] or [1.0]
        imbalance = max(times) / max(1e-12, min(times))
        force = force or sum(current.values()) != total
        if not force and (imbalance <= 1 + eps or by_steps):
            return [], st
        if shares and not by_steps:
            sizes = equal_finish_batches(total, st.timing, workers, b_min, quantum)
        else:  # B/N each, the remainder to the lowest ids
            q, r = divmod(total, len(workers))
            sizes = {w: max(1, q + (1 if i < r else 0)) for i, w in enumerate(workers)}
        out: list[Decision] = [
            SetPlan(w, {"batch_size": b}) for w, b in sizes.items() if current.get(w) != b
        ]
        return out, replace(st, batches=freeze(sizes))

    def update(
        event: Event, state: DilocoState, view: ClusterView
    ) -> tuple[Sequence[Decision], DilocoState]:
        st = profiled(state, view)
        head: list[Decision] = []
        out: list[Decision] = []
        lo = view.min_clock()
        if isinstance(event, Push) and event.worker in view.workers:
            head.append(Buffer(float(event.samples), group=view.workers[event.worker].clock))
            if event.samples > 0 and event.steps > 0:
                t = dict(st.timing)
                per_step = event.samples / event.steps
                t[event.worker] = t.get(event.worker, Timing()).add(
                    per_step, event.compute_s / event.steps
                )
                st = replace(st, timing=freeze(t))
        if isinstance(event, Leave):
            st = replace(
                st, batches=freeze({w: b for w, b in st.batches.items() if w in view.workers})
            )
        # Round r is complete once every active worker pushed its r-th delta (a leave may complete it).
        if (
            view.workers
            and isinstance(event, Push | Leave | Tick)
            and (view.buffered or isinstance(event, Push))
        ):
            out.append(Flush(normalize=True, upto=lo))
        round_done = isinstance(event, Push) and view.workers[event.worker].clock == lo
        if st.fresh or round_done or isinstance(event, Join | Leave):
            decisions, st = plan(st, view, force=st.fresh or isinstance(event, Join | Leave))
            out.extend(decisions)
        if round_done:
            st = replace(st, rounds=st.rounds + 1)
        steps = local_steps(st, view, event.worker if isinstance(event, Join) else None)
        if steps or st.fresh:
            announced = {w: st.steps[w] for w in view.workers if w in st.steps}
            announced.update({d.worker: int(d.fields["local_steps"]) for d in steps})
            st = replace(st, steps=freeze(announced), fresh=False)
        out = [*steps, *out]
        out.extend(release_waiting(view, lambda f: f.clock <= lo))
        return [*head, *out], st

    params = {
        "H": H,
        "global_batch": global_batch,
        "b_min": b_min,
        "eps": eps,
        "quantum": quantum,
        "shares": shares,
        "calibrate": calibrate,
        "codec": codec,
        "balance": balance,
    }
    return Policy("diloco", init, update, params)


def round_trip_s(push_bytes: float | None, link_bps: float | None) -> float:
    """A local-SGD round's transfers on one link: its push and a pull of about as many bytes
    (a pseudo-gradient and an outer step, in the same codec), at the measured rate; 0 unknown."""
    if not push_bytes or not link_bps or not (0 < link_bps < math.inf):
        return 0.0
    return 2.0 * float(push_bytes) / float(link_bps)


def finish_together_steps(
    step_s: Mapping[int, float], comm_s: Mapping[int, float], H: int
) -> dict[int, int]:
    """Inner steps per worker so that every round ends together, transfers included: the worker
    with the shortest step runs ``H`` and its round lasts ``T = H·t_f + m_f``; each other runs
    ``round((T − m_i) / t_i)`` steps, between 1 and ``H`` (``t`` the step time, ``m`` the
    round's transfers). DyLU (:func:`local_steps_for`) when no link is known. A worker whose step
    time is unknown (0) runs ``H``."""
    known = {w: t for w, t in step_s.items() if t > 0 and math.isfinite(t)}
    if not known:
        return dict.fromkeys(step_s, H)
    fastest = min(known, key=lambda w: (known[w], w))
    span = H * known[fastest] + comm_s.get(fastest, 0.0)
    return {
        w: min(H, max(1, round((span - comm_s.get(w, 0.0)) / known[w]))) if w in known else H
        for w in step_s
    }


# --- diloco_async -------------------------------------------------------------------------------------


def local_steps_for(
    step_s: Mapping[int, float],
    H: int,
    h_min: int,
    h_max: int,
    unknown: int | None = None,
) -> dict[int, int]:
    """DyLU: ``H_i = max(h_min, round(H · c_min / c_i))`` (at most ``h_max``), ``c_i`` the step
    time; the fastest worker runs ``H`` steps and every worker's round takes about as long.
    A worker whose step time is unknown (0) runs ``unknown`` steps (None: ``H``)."""
    blind = H if unknown is None else unknown
    known = {w: c for w, c in step_s.items() if c > 0 and math.isfinite(c)}
    if not known:
        return dict.fromkeys(step_s, blind)
    c_min = min(known.values())
    return {
        w: min(h_max, max(h_min, round(H * c_min / known[w]))) if w in known else blind
        for w in step_s
    }


def staleness_factor(tau: int, workers: int = 1) -> float:
    """``1/√(1+τ')`` (Liu et al. 2024), ``τ' = τ − (workers − 1)`` the versions applied since the
    work's base beyond the other workers' one arrival each. Deltas are applied on arrival, so a
    worker on time finds its base overtaken by the ``workers − 1`` others (τ = N − 1 with every
    worker at the same cadence): that is the schedule, not staleness, and weighing it down by
    ``1/√N`` would move the model by half a synchronous round per round at N = 4."""
    return 1.0 / math.sqrt(1.0 + max(0, tau - max(0, workers - 1)))


@dataclass(frozen=True, slots=True)
class DilocoAsyncState:
    """Profiles and speed tracks (``policies.profiling``), each worker's current ``H_i``, the
    re-plans so far (their reasons), the arrivals applied, and whether the plans were announced."""

    tracks: Mapping[int, WorkerTrack]
    steps: Mapping[int, int]
    replans: tuple[str, ...] = ()
    arrivals: int = 0
    fresh: bool = True

    def shifted(self, dt: float) -> DilocoAsyncState:
        """The same state with its profiles' engine-clock times moved by ``dt`` s."""
        return replace(self, tracks=prof.shift_tracks(self.tracks, dt))

    def describe(self) -> dict[str, Any]:
        """Plain values for status pages."""
        return {
            "policy": "diloco_async",
            "arrivals": self.arrivals,
            "replans": list(self.replans),
            "workers": [
                {"worker": w, "H": self.steps.get(w), **prof.profile_row(t)}
                for w, t in sorted(self.tracks.items())
            ],
        }


_KEEP = 16  # re-plan reasons kept


@register("diloco_async")
def diloco_async(
    H: int = 50,
    h_min: int = 1,
    max_local_steps: int = 10_000,
    staleness: bool = True,
    profile_pushes: int = 2,
    trim: float = 0.2,
    drift: float = 0.3,
    drift_patience: int = 3,
    alpha: float = 0.5,
    calibrate: bool = True,
    codec: str | None = None,
) -> Policy:
    """Asynchronous local SGD (Liu et al. 2024): the fastest worker runs ``H`` inner steps, the
    others ``H_i = max(h_min, round(H · c_min / c_i))``; each delta is applied on arrival with weight
    ``1/√(1+τ') / N`` (``τ' = τ − (N − 1)``, :func:`staleness_factor`; ``staleness=False``:
    ``1/N``), fed into the outer optimizer (``outer_optimizer = "auto"``: plain averaging,
    :func:`outer_for`; Liu et al.'s ``delayed_nesterov:lr=0.7,momentum=0.9,period=N`` when
    configured); never holds; re-plans on a join, a leave
    or a speed drift. Until a worker has a profile (the engine's profile exchange, else its first
    ``profile_pushes`` pushes) it runs ``h_min`` steps (``calibrate=False``: ``H``), so a slow
    worker's first delta is not ``H`` of its steps late. ``codec``: the deltas' codec (None: the
    configuration's)."""
    _check_h("H", H)
    _check_h("h_min", h_min)
    _check_h("max_local_steps", max_local_steps)
    if h_min > max_local_steps or max_local_steps < H:
        raise ValueError(
            f"need h_min <= max_local_steps and H <= max_local_steps, got {H}, {h_min}"
        )
    if not isinstance(staleness, bool):
        raise ValueError(f"staleness must be true or false, got {staleness!r}")
    if not isinstance(calibrate, bool):
        raise ValueError(f"calibrate must be true or false, got {calibrate!r}")
    _check_codec(codec)
    blind = h_min if calibrate else H
    fields: dict[str, Any] = {"push_kind": "delta"} | ({"codec": codec} if codec else {})
    pcfg = ProfilingConfig(profile_pushes, trim, drift, drift_patience, alpha)

    def step_times(st: DilocoAsyncState, view: ClusterView) -> dict[int, float]:
        out = {}
        for w, f in view.workers.items():
            t = st.tracks.get(w)
            p = None if t is None else t.profile
            out[w] = p.step_s(f.batch_size) if p is not None else 0.0
        return out

    def init(view: ClusterView) -> DilocoAsyncState:
        tracks = prof.init_tracks(view, pcfg)
        st = DilocoAsyncState(tracks, freeze({}))
        return replace(
            st,
            steps=freeze(local_steps_for(step_times(st, view), H, h_min, max_local_steps, blind)),
        )

    def update(
        event: Event, state: DilocoAsyncState, view: ClusterView
    ) -> tuple[Sequence[Decision], DilocoAsyncState]:
        tracks, ch = prof.track(state.tracks, event, view, pcfg)
        st = replace(state, tracks=tracks)
        head: list[Decision] = []
        if isinstance(event, Push) and event.worker in view.workers:
            w = staleness_factor(event.staleness(view), view.n) if staleness else 1.0
            # A one-push buffer flushed at once: the weight scales the outer optimizer's *input*.
            head += [
                Buffer(w / max(1, view.n), group=0),
                Flush(normalize=False, scale=1.0, upto=None),
            ]
            st = replace(st, arrivals=st.arrivals + 1)
        out: list[Decision] = []
        joined = event.worker if isinstance(event, Join) and event.worker in view.workers else None
        if st.fresh or ch.replan or ch.joined or joined is not None:
            steps = local_steps_for(step_times(st, view), H, h_min, max_local_steps, blind)
            for w in sorted(view.workers):
                if st.fresh or w == joined or steps[w] != st.steps.get(w):
                    out.append(SetPlan(w, {"local_steps": steps[w], **fields}))
            reason = "start" if st.fresh else (ch.reason() or "join")
            st = replace(
                st, steps=freeze(steps), replans=(*st.replans, reason)[-_KEEP:], fresh=False
            )
        out.extend(release_waiting(view, lambda f: True))
        return [*head, *out], st

    params = {
        "H": H,
        "h_min": h_min,
        "max_local_steps": max_local_steps,
        "staleness": staleness,
        "profile_pushes": profile_pushes,
        "trim": trim,
        "drift": drift,
        "drift_patience": drift_patience,
        "alpha": alpha,
        "calibrate": calibrate,
        "codec": codec,
    }
    return Policy("diloco_async", init, update, params)


__all__ = [
    "ASYNC_OUTER",
    "AUTO_OUTER",
    "PLAIN_OUTER",
    "SYNC_OUTER",
    "DilocoAsyncState",
    "DilocoState",
    "diloco",
    "diloco_async",
    "equal_finish_batches",
    "finish_together_steps",
    "local_steps_for",
    "outer_for",
    "round_trip_s",
    "staleness_factor",
]
