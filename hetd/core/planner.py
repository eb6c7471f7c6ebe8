"""The planner behind a policy that reads forecasts (``auto``): each candidate policy run forward on a
snapshot of the cluster by the timing twin, and what it would be worth, as one
:class:`~policies.types.Forecast`.

Owns :class:`Candidate` and :func:`parse_candidates` (what the policy's ``candidates`` parameter
names), :class:`PlannerConfig` (the horizon and the statistical-efficiency model), :func:`snapshot`
(the view with mappings the engine no longer changes, taken on the engine task) and :func:`plan`,
which returns the forecast and the candidates the twin refused. Pure of I/O: the clock that
measures its CPU time is passed in, and it logs nothing (the caller says what it refused).

The daemon takes the snapshot on the engine task, runs :func:`plan` in a worker thread and hands
the forecast back as a :class:`hetd.core.commands.Forecast` command; the simulator runs it
synchronously at fixed virtual times (docs/design.md, "Forecasts").
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from hetd.core.entries import EngineConfig
from policies import auto_choice
from policies.efficiency import Efficiency, for_optimizer
from policies.twin import TwinConfig, TwinError, run_twin
from policies.twin_worker import speed
from policies.types import ClusterView, Forecast, Policy, Prediction

# The candidates when the policy names none: auto's own default list, so that both plan over the
# same ones.
DEFAULT_CANDIDATES = auto_choice.DEFAULT_CANDIDATES
NEVER = frozenset({"auto", "dpmp"})  # names a planner does not run (itself; pipeline replicas)


@dataclass(frozen=True, slots=True)
class Candidate:
    """A registered policy name and its parameters, as the twin builds it."""

    name: str
    params: tuple[tuple[str, Any], ...] = ()  # (key, value), sorted by key

    @property
    def label(self) -> str:
        """``name``, or ``name:key=value;key=value`` (how it was written)."""
        if not self.params:
            return self.name
        return self.name + ":" + ";".join(f"{k}={json.dumps(v)}" for k, v in self.params)


def parse_candidate(text: str) -> Candidate:
    """One ``name[:key=value[;key=value...]]``, in auto's syntax (:mod:`policies.auto_choice`:
    values in JSON, else strings). Raises ValueError on a malformed parameter."""
    return Candidate(*auto_choice.parse_candidate(text))


def parse_candidates(spec: str | Sequence[str] | None) -> tuple[Candidate, ...]:
    """The candidates a policy's ``candidates`` parameter names: a comma-separated string or a
    sequence of strings, each ``name[:key=value[;key=value...]]`` (``None`` or empty:
    :data:`DEFAULT_CANDIDATES`). A candidate named twice counts once. Raises ValueError on a
    malformed item; unknown names are found when they run (:func:`plan` refuses them)."""
    if spec is None:
        items: Sequence[str] = DEFAULT_CANDIDATES
    elif isinstance(spec, str):
        items = [s for s in spec.split(",") if s.strip()] or DEFAULT_CANDIDATES
    else:
        items = [str(s) for s in spec if str(s).strip()] or DEFAULT_CANDIDATES
    out: list[Candidate] = []
    for item in items:
        c = parse_candidate(item)
        if c not in out:
            out.append(c)
    return tuple(out)


def candidates_of(policy: Policy) -> tuple[Candidate, ...]:
    """The candidates ``policy`` plans among (its ``candidates`` parameter)."""
    return parse_candidates(policy.params.get("candidates"))


@dataclass(frozen=True, slots=True)
class PlannerConfig:
    """How far each candidate is run forward and what an applied sample is worth."""

    horizon_s: float = 10.0  # s of the cluster's time at most per candidate
    # ... and no further than this many pushes of every worker (bounds the twin's CPU: a
    # 10 s horizon at 16 workers costs up to 1.5 s a candidate, 20 rounds far less); None: time
    horizon_rounds: int | None = 20
    efficiency: Efficiency = field(default_factory=Efficiency)
    twin: TwinConfig | None = None  # costs the facts do not carry (its horizon is replaced)
    # The batch every candidate starts with, as a switch starts it: the default plan's (the
    # daemon's [train] batch_size; auto's switch and the engine's swap both put every plan back
    # to it). None: each worker's current batch (the running policy's shares, e.g. lbbsp's).
    default_batch: int | None = None

    def __post_init__(self) -> None:
        if not (0 < self.horizon_s < math.inf):
            raise ValueError(f"horizon_s must be > 0 and finite (seconds), got {self.horizon_s!r}")
        if self.horizon_rounds is not None and not self.horizon_rounds >= 1:
            raise ValueError(f"horizon_rounds must be >= 1 (or None), got {self.horizon_rounds!r}")
        if self.default_batch is not None and not self.default_batch >= 1:
            raise ValueError(f"default_batch must be >= 1 (or None), got {self.default_batch!r}")

    @classmethod
    def for_engine(cls, config: EngineConfig, n_params: int | None = None) -> PlannerConfig:
        """The planner of an engine run with ``config``: candidates start on its default batch,
        and an applied sample is worth what the efficiency model of its workers' optimizer
        (the welcome's ``inner_optimizer``) says (:func:`policies.efficiency.for_optimizer`).
        ``n_params``, the model's parameter count (the engine's store's), sizes a full frame:
        4 bytes a parameter. Without it the twin infers the frame from the bytes the workers
        pushed, which are the running policy's codec's: after ashl's top-k deltas or hps's
        bits it charged every candidate the compressed frame (on S7 at 20 s, with ashl's
        pushes at 0.53-0.87 of a frame, asp was predicted at 253 samples/s where the whole
        frame gives 210, hps 208 where it gives 169)."""
        train = config.welcome.get("train") if isinstance(config.welcome, Mapping) else None
        spec = train.get("inner_optimizer") if isinstance(train, Mapping) else None
        if n_params is not None and not n_params >= 1:
            raise ValueError(f"n_params must be >= 1 (or None), got {n_params!r}")
        return cls(
            default_batch=config.batch_size,
            efficiency=for_optimizer(spec if isinstance(spec, str) else None),
            twin=None if n_params is None else TwinConfig(model_bytes=4.0 * n_params),
        )

    def twin_config(self) -> TwinConfig:
        base = self.twin or TwinConfig()
        batch = self.default_batch if self.default_batch is not None else base.batch_size
        return dataclasses.replace(
            base, horizon_s=self.horizon_s, horizon_rounds=self.horizon_rounds, batch_size=batch
        )


class Planned(NamedTuple):
    """What :func:`plan` found: the forecast, and each candidate left out with the reason."""

    forecast: Forecast
    refused: tuple[tuple[str, str], ...]  # (candidate label, why)


def snapshot(view: ClusterView) -> ClusterView:
    """``view`` with its mappings copied: the engine's view reads its live tables, which change
    under a planner running in another thread. Take it on the engine task."""
    return dataclasses.replace(
        view,
        workers=dict(view.workers),
        replicas=dict(view.replicas),
        stage_workers=dict(view.stage_workers),
    )


def untimed(view: ClusterView) -> tuple[int, ...]:
    """The workers of ``view`` the twin cannot time yet (no ``sample_s``, ``compute_s`` or
    profile: a newcomer before its profile exchange or first push). A planner waits for none."""
    out = []
    for w, f in sorted(view.workers.items()):
        try:
            speed(f)
        except TwinError:
            out.append(w)
    return tuple(out)


def predict(view: ClusterView, candidate: Candidate, config: PlannerConfig) -> Prediction:
    """One candidate run forward by the twin; raises what the twin raises (see :func:`plan`)."""
    r = run_twin(view, candidate.name, dict(candidate.params), config.twin_config())
    applied = r.applied_samples_per_s
    worth = r.effective_samples_per_s(config.efficiency) / applied if applied > 0 else 0.0
    return Prediction(candidate.name, candidate.params, applied, worth, r.staleness_mean)


def plan(
    view: ClusterView,
    candidates: Sequence[Candidate],
    config: PlannerConfig,
    cpu_clock: Callable[[], float],
) -> Planned:
    """Run every candidate forward from ``view`` (a :func:`snapshot`) and return the forecast
    of those the twin could run, in the candidates' order, with the CPU seconds it took as
    ``cpu_clock`` counts them (the daemon's thread: ``time.thread_time``).

    A candidate the twin refuses is left out and named in ``refused``, never raised: a worker
    without timing facts yet, a decision it does not model (pipeline replicas), an unknown name
    or parameter, or an error of the policy's own ``init`` or ``update`` (a swap to it would fail
    too). ``auto`` and ``dpmp`` are always left out."""
    start = cpu_clock()
    predictions: list[Prediction] = []
    refused: list[tuple[str, str]] = []
    for c in candidates:
        if c.name in NEVER:
            refused.append((c.label, f"{c.name} is not a candidate a planner runs"))
            continue
        try:
            predictions.append(predict(view, c, config))
        except Exception as exc:  # a candidate that cannot run is left out
            refused.append((c.label, f"{type(exc).__name__}: {exc}"))
    cost = max(0.0, cpu_clock() - start)
    forecast = Forecast(view.now, config.horizon_s, tuple(predictions), cost)
    return Planned(forecast, tuple(refused))


def describe_forecast(forecast: Forecast) -> dict[str, Any]:
    """A forecast as plain values for status pages: each prediction's goodput and its parts,
    best first."""
    ranked = sorted(forecast.predictions, key=lambda p: -p.goodput)
    return {
        "at_s": forecast.now,
        "horizon_s": forecast.horizon_s,
        "cost_s": forecast.cost_s,
        "predictions": [
            {
                "candidate": Candidate(p.name, p.params).label,
                "goodput": p.goodput,
                "samples_per_s": p.samples_per_s,
                "efficiency": p.efficiency,
                "staleness": p.staleness,
            }
            for p in ranked
        ],
    }
