"""Heterogeneity scenarios as data: load, validate and expand a TOML or JSON scenario file.

Owns :class:`Scenario` (what is trained, by which emulated workers, for how long) and its parts,
churn included (:class:`Join`, :class:`Leave`: workers that arrive, or go away cleanly or by
crash, while the run goes on), the packaged scenarios (``hetd/sim/scenarios/*.toml``,
docs/benchmark.md), and :func:`load_scenario`, which takes a packaged name or a path. Validation is
strict: an unknown key or a value of the wrong type raises :class:`ScenarioError` naming the file,
the place and the key, and listing the valid keys. Both ``hetd sim``/``hetd bench --mode sim`` and
``--mode real`` read the same :class:`Scenario`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from hetd.config import DOWNLINK_MODES
from hetd.zoo.optim import parse_optimizer

INF = math.inf


class ScenarioError(ValueError):
    """A bad scenario file, key or value; the message names where and what."""


@dataclass(frozen=True, slots=True)
class Stragglers:
    """Transient slow episodes: each step outside an episode starts one with probability ``p``;
    an episode slows ``mean_len`` steps on average (geometric length) by ``factor``."""

    p: float = 0.0  # probability per step
    factor: float = 5.0  # × step time during an episode
    mean_len: float = 10.0  # steps

    def slow_fraction(self) -> float:
        """Long-run fraction of steps inside an episode: p·L / (p·L + 1 − p)."""
        if self.p <= 0:
            return 0.0
        pl = self.p * self.mean_len
        return pl / (pl + 1.0 - self.p)

    def mean_factor(self) -> float:
        """Long-run mean multiplier of a step's time."""
        return 1.0 + self.slow_fraction() * (self.factor - 1.0)


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    """One emulated worker (after ``count`` expansion)."""

    slowdown: float = 1.0  # × base step time
    bandwidth: float = 1e9  # bytes/s of its link, both directions (inf: free)
    latency_s: float = 0.0  # s added to every transfer
    memory: int | None = None  # bytes reported as the device's free memory
    # s its profile reports for compiling a new pipeline stage shape (None: reports none, and a
    # stage compiles in no time)
    compile_s: float | None = None
    stragglers: Stragglers = field(default_factory=Stragglers)
    name: str = ""  # what a leave may call it by ("": by its index only)


@dataclass(frozen=True, slots=True)
class Shift:
    """A regime shift: from ``at_s`` (or ``at_fraction`` of the budget) on, ``worker`` (an index
    into the expanded worker list) runs at ``slowdown``."""

    worker: int
    slowdown: float
    at_s: float | None = None
    at_fraction: float | None = None

    def time(self, budget_s: float) -> float:
        """When the shift happens, in seconds from the start."""
        return self.at_s if self.at_s is not None else float(self.at_fraction or 0.0) * budget_s


LEAVE_HOW = ("clean", "crash")  # says bye (SIGTERM) | vanishes (SIGKILL; the heartbeat finds out)


@dataclass(frozen=True, slots=True)
class Join:
    """Churn: at ``at_s`` a new worker, ``spec``, starts and joins the running cluster. It is
    worker ``worker`` of the scenario: the initial workers are 0..n-1, joiners follow in the
    order of their events."""

    at_s: float  # s from the run's start
    worker: int  # its index among all the scenario's workers
    spec: WorkerSpec


@dataclass(frozen=True, slots=True)
class Leave:
    """Churn: at ``at_s`` worker ``worker`` goes away, ``"clean"`` (it says bye, as a worker does
    on SIGTERM) or by ``"crash"`` (it falls silent; the daemon finds out by the heartbeat
    timeout)."""

    at_s: float  # s from the run's start
    worker: int  # an index among all the scenario's workers (a name is resolved at load)
    how: str  # one of LEAVE_HOW


ChurnEvent = Join | Leave


@dataclass(frozen=True, slots=True)
class Scenario:
    """A whole experiment: data, model, batch, the workers and how they change, target and budget."""

    name: str
    dataset: str
    model: str
    workers: tuple[WorkerSpec, ...]
    description: str = ""
    dataset_kwargs: Mapping[str, Any] = field(default_factory=dict)
    model_kwargs: Mapping[str, Any] = field(default_factory=dict)
    global_batch: int = 128  # samples per round across workers; each worker starts at B/N
    base_batch: int = 32  # the batch that takes base_step_s on a slowdown-1 worker
    base_step_s: float = 0.01  # s per step of base_batch samples at slowdown 1
    target_accuracy: float = 0.9
    # > 0: the target is this test loss instead (TTA: when the loss first comes down to it,
    # interpolated between evaluations; hetd.sim.results.time_to_target), e.g. a language model's
    target_loss: float = 0.0
    budget_s: float = 30.0  # s of (virtual or wall) training time
    eval_interval_s: float = 0.5  # s between evaluations of the global model (not charged)
    tick_s: float = 0.25  # s between engine ticks
    lr: float = 0.1  # the daemon optimizer's learning rate
    lr_grid: tuple[float, ...] = (0.05, 0.1, 0.2)  # candidates for --tune-lr
    optimizer: str = "sgd"  # the daemon's, as [train] optimizer (a spec: sgd | momentum | adam ...)
    worker_lr: float = 0.0  # the inner optimizer's lr when its spec names none; 0: the run's lr
    inner_optimizer: str = ""  # local-step plans' optimizer, as [train]; "": optimizer's family
    outer_optimizer: str = "auto"  # how deltas are applied, as [train] ("auto": the policy's)
    micro_batch: int = 0  # examples per compiled call on workers; 0: batch_per_worker
    codec: str = "none"  # preferred codec
    downlink: str = "auto"  # lossy codecs' parameters: auto (by link speed), delta, full
    shifts: tuple[Shift, ...] = ()
    events: tuple[ChurnEvent, ...] = ()  # joins and leaves, in time order
    costs: str = ""  # a cost profile file for the simulator (hetd calibrate); "": charge none
    # s of silence after which the daemon drops a worker: real mode's daemon, and the simulator's
    # engine when the scenario has churn (without, no emulated worker ever falls silent)
    heartbeat_timeout_s: float = 30.0
    # s of virtual time between a planner's forecasts for a policy that reads them (auto), as
    # [policy] plan_every_s; 0: none
    plan_every_s: float = 30.0

    @property
    def n(self) -> int:
        """Number of workers at the start (joiners not counted)."""
        return len(self.workers)

    @property
    def all_workers(self) -> tuple[WorkerSpec, ...]:
        """Every worker of the run: the initial ones, then the joiners in event order (so a
        worker's index here is the one events, shifts and results use)."""
        return self.workers + tuple(e.spec for e in self.events if isinstance(e, Join))

    def present_at(self, t: float) -> list[int]:
        """The indices of the workers in the run at ``t``: joined at or before it, not left at
        or before it."""
        here = set(range(self.n))
        for e in self.events:
            if e.at_s <= t:
                if isinstance(e, Join):
                    here.add(e.worker)
                else:
                    here.discard(e.worker)
        return sorted(here)

    @property
    def peak_workers(self) -> int:
        """The most workers in the run at one time."""
        return max([self.n, *(len(self.present_at(e.at_s)) for e in self.events)])

    @property
    def target_text(self) -> str:
        """The target for people: "accuracy 0.9" or "loss 2.4 (3.46 bits per byte)"."""
        if self.target_loss > 0:
            return f"loss {self.target_loss:g} ({self.target_loss / math.log(2):.2f} bits per byte)"
        return f"accuracy {self.target_accuracy:g}"

    @property
    def batch_per_worker(self) -> int:
        """The initial per-worker batch: B/N (at least 1)."""
        return max(1, self.global_batch // max(1, self.n))

    def slowdown_at(self, worker: int, t: float) -> float:
        """``worker``'s slow-down at time ``t`` (the last shift at or before ``t`` wins)."""
        value = self.all_workers[worker].slowdown
        for s in sorted(self.shifts, key=lambda s: s.time(self.budget_s)):
            if s.worker == worker and s.time(self.budget_s) <= t:
                value = s.slowdown
        return value


# --- validation ------------------------------------------------------------------------------------


def _num(x: Any) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool)


def _int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


Check = Callable[[Any], bool]

OPTIMIZER_HELP = "an optimizer spec: sgd | momentum | nesterov | adam [:lr=..,momentum=..]"


def _is_optimizer(spec: str) -> bool:
    try:
        parse_optimizer(spec)
    except ValueError:
        return False
    return True


# key -> (type test, type name, value test, value rule)
_TOP: dict[str, tuple[Check, str, Check, str]] = {
    "name": (lambda v: isinstance(v, str), "string", lambda v: bool(v), "non-empty"),
    "description": (lambda v: isinstance(v, str), "string", lambda v: True, ""),
    "dataset": (lambda v: isinstance(v, str), "string", lambda v: bool(v), "non-empty"),
    "dataset_kwargs": (lambda v: isinstance(v, Mapping), "table", lambda v: True, ""),
    "model": (lambda v: isinstance(v, str), "string", lambda v: bool(v), "non-empty"),
    "model_kwargs": (lambda v: isinstance(v, Mapping), "table", lambda v: True, ""),
    "global_batch": (_int, "int", lambda v: v >= 1, ">= 1"),
    "base_batch": (_int, "int", lambda v: v >= 1, ">= 1"),
    "base_step_s": (_num, "number", lambda v: 0 < v < INF, "> 0"),
    "target_accuracy": (_num, "number", lambda v: 0 < v <= 1, "in (0, 1]"),
    "target_loss": (_num, "number", lambda v: 0 <= v < INF, ">= 0 (0: the accuracy target)"),
    "budget_s": (_num, "number", lambda v: 0 < v < INF, "> 0"),
    "eval_interval_s": (_num, "number", lambda v: 0 < v < INF, "> 0"),
    "tick_s": (_num, "number", lambda v: 0 < v < INF, "> 0"),
    "lr": (_num, "number", lambda v: 0 < v < INF, "> 0"),
    "lr_grid": (
        lambda v: isinstance(v, list | tuple) and all(_num(x) for x in v),
        "list of numbers",
        lambda v: len(v) > 0 and all(0 < x < INF for x in v),
        "non-empty, each > 0",
    ),
    "optimizer": (lambda v: isinstance(v, str), "string", _is_optimizer, OPTIMIZER_HELP),
    "inner_optimizer": (
        lambda v: isinstance(v, str),
        "string",
        lambda v: v == "" or _is_optimizer(v),
        '"" or ' + OPTIMIZER_HELP,
    ),
    "outer_optimizer": (
        lambda v: isinstance(v, str),
        "string",
        lambda v: v == "auto" or _is_optimizer(v),
        '"auto" or ' + OPTIMIZER_HELP,
    ),
    "micro_batch": (
        lambda v: isinstance(v, int) and not isinstance(v, bool),
        "integer",
        lambda v: v >= 0,
        ">= 0 (0: the per-worker batch)",
    ),
    "worker_lr": (_num, "number", lambda v: 0 <= v < INF, ">= 0 (0: the run's lr)"),
    "codec": (lambda v: isinstance(v, str), "string", lambda v: bool(v), "non-empty"),
    "downlink": (
        lambda v: isinstance(v, str),
        "string",
        lambda v: v in DOWNLINK_MODES,
        f"one of {', '.join(DOWNLINK_MODES)}",
    ),
    "workers": (
        lambda v: isinstance(v, list),
        "array of tables",
        lambda v: len(v) > 0,
        "non-empty",
    ),
    "shifts": (lambda v: isinstance(v, list), "array of tables", lambda v: True, ""),
    "events": (lambda v: isinstance(v, list), "array of tables", lambda v: True, ""),
    "heartbeat_timeout_s": (
        _num,
        "number",
        lambda v: 0 < v < INF,
        "> 0 s: the daemon drops a worker silent this long (a crash is found so; the simulator "
        "times out only with [[events]])",
    ),
    "plan_every_s": (
        _num,
        "number",
        lambda v: 0 <= v < INF,
        ">= 0 s between a planner's forecasts for a policy that reads them (auto); 0: none",
    ),
    "costs": (
        lambda v: isinstance(v, str),
        "string",
        lambda v: True,
        "the path of a cost profile (hetd calibrate), relative to the scenario file",
    ),
}
_REQUIRED = ("name", "dataset", "model", "workers")

_WORKER: dict[str, tuple[Check, str, Check, str]] = {
    "slowdown": (_num, "number", lambda v: 0 < v < INF, "> 0"),
    "bandwidth": (_num, "number", lambda v: v > 0, "> 0 bytes/s (inf: free)"),
    "latency_s": (_num, "number", lambda v: 0 <= v < INF, ">= 0"),
    "memory": (_int, "int", lambda v: v >= 0, ">= 0 bytes"),
    "compile_s": (_num, "number", lambda v: 0 <= v < INF, ">= 0 s"),
    "stragglers": (lambda v: isinstance(v, Mapping), "table", lambda v: True, ""),
    "count": (_int, "int", lambda v: v >= 1, ">= 1"),
    "name": (
        lambda v: isinstance(v, str),
        "string",
        lambda v: bool(v) and not v.isdigit(),
        "non-empty, not a number, unique; only with count = 1 (a leave may name it)",
    ),
}
# a joiner is one worker: the same keys but count
_JOIN = {k: v for k, v in _WORKER.items() if k != "count"}
_EVENT: dict[str, tuple[Check, str, Check, str]] = {
    "at_s": (_num, "number", lambda v: 0 <= v < INF, ">= 0 s from the start, before 'budget_s'"),
    "join": (
        lambda v: isinstance(v, Mapping),
        "table",
        lambda v: True,
        "a new worker, with the keys of a [[workers]] table but 'count'",
    ),
    "leave": (
        lambda v: _int(v) or isinstance(v, str),
        "int or string",
        lambda v: not _int(v) or v >= 0,
        "the worker that goes: its index among all workers (initial ones, then joiners in "
        "event order) or its name",
    ),
    "how": (
        lambda v: isinstance(v, str),
        "string",
        lambda v: v in LEAVE_HOW,
        '"clean" (it says bye, as on SIGTERM) or "crash" (it falls silent: SIGKILL in real mode)',
    ),
}
_STRAGGLERS: dict[str, tuple[Check, str, Check, str]] = {
    "p": (_num, "number", lambda v: 0 <= v <= 1, "in [0, 1]"),
    "factor": (_num, "number", lambda v: 1 <= v < INF, ">= 1"),
    "mean_len": (_num, "number", lambda v: 1 <= v < INF, ">= 1 step"),
}
_SHIFT: dict[str, tuple[Check, str, Check, str]] = {
    "worker": (_int, "int", lambda v: v >= 0, ">= 0"),
    "slowdown": (_num, "number", lambda v: 0 < v < INF, "> 0"),
    "at_s": (_num, "number", lambda v: 0 <= v < INF, ">= 0"),
    "at_fraction": (_num, "number", lambda v: 0 <= v <= 1, "in [0, 1]"),
}


def keys_help() -> list[str]:
    """Every key a scenario file may hold, one line each with its type and rule, by table (what
    ``hetd bench --help`` lists; made from the rules themselves, so none is left out)."""

    def lines(
        rules: Mapping[str, tuple[Check, str, Check, str]], indent: str, tables: tuple[str, ...]
    ) -> list[str]:
        out = []
        for key, (_, type_name, _, rule) in rules.items():
            if key in tables:  # listed below, with their own keys
                continue
            required = ", required" if rules is _TOP and key in _REQUIRED else ""
            out.append(f"{indent}{key} ({type_name}{required}){': ' + rule if rule else ''}")
        return out

    return [
        "top level:",
        *lines(_TOP, "  ", ("workers", "shifts", "events")),
        "[[workers]] (required, one table per kind of worker):",
        *lines(_WORKER, "  ", ("stragglers",)),
        "  stragglers = { ... } (a table):",
        *lines(_STRAGGLERS, "    ", ()),
        "[[shifts]] (each: worker, slowdown, and at_s or at_fraction):",
        *lines(_SHIFT, "  ", ()),
        "[[events]] (churn, in time order; each: at_s, and join, or leave with how):",
        *lines(_EVENT, "  ", ()),
    ]


def _checked(
    where: str, raw: Any, rules: Mapping[str, tuple[Check, str, Check, str]]
) -> dict[str, Any]:
    """``raw`` as a dict whose keys are all known and whose values pass their rules."""
    if not isinstance(raw, Mapping):
        raise ScenarioError(f"{where}: must be a table, got {type(raw).__name__}")
    unknown = sorted(set(raw) - set(rules))
    if unknown:
        raise ScenarioError(
            f"{where}: unknown key{'s' if len(unknown) > 1 else ''} "
            f"{', '.join(map(repr, unknown))}; valid keys: {', '.join(sorted(rules))}"
        )
    for key, value in raw.items():
        is_type, type_name, ok, rule = rules[key]
        if not is_type(value):
            raise ScenarioError(
                f"{where}: {key!r} must be a {type_name}, got {value!r} ({type(value).__name__})"
            )
        if not ok(value):
            raise ScenarioError(f"{where}: {key!r} must be {rule}, got {value!r}")
    return dict(raw)


def from_mapping(raw: Mapping[str, Any], source: str = "<scenario>") -> Scenario:
    """Validate parsed TOML/JSON and build a :class:`Scenario` (workers expanded by ``count``)."""
    top = _checked(source, raw, _TOP)
    missing = [k for k in _REQUIRED if k not in top]
    if missing:
        raise ScenarioError(f"{source}: missing required key(s) {', '.join(map(repr, missing))}")
    workers: list[WorkerSpec] = []
    for i, w in enumerate(top.pop("workers")):
        where = f"{source}: workers[{i}]"
        wd = _checked(where, w, _WORKER)
        count = wd.pop("count", 1)
        if count > 1 and "name" in wd:
            raise ScenarioError(f"{where}: 'name' names one worker; give it with count = 1 only")
        workers.extend([_worker_spec(where, wd)] * count)
    events = _events(source, top.pop("events", []), workers, top.get("budget_s"))
    everyone = workers + [e.spec for e in events if isinstance(e, Join)]
    shifts: list[Shift] = []
    for i, s in enumerate(top.pop("shifts", [])):
        where = f"{source}: shifts[{i}]"
        sd = _checked(where, s, _SHIFT)
        for key in ("worker", "slowdown"):
            if key not in sd:
                raise ScenarioError(f"{where}: missing required key {key!r}")
        if ("at_s" in sd) == ("at_fraction" in sd):
            raise ScenarioError(f"{where}: give exactly one of 'at_s' or 'at_fraction'")
        if sd["worker"] >= len(everyone):
            raise ScenarioError(
                f"{where}: 'worker' is {sd['worker']} but there are only {len(everyone)} workers "
                f"(indices 0..{len(everyone) - 1}, after expanding 'count'; joiners follow)"
            )
        fields: dict[str, Any] = {k: float(v) if k != "worker" else v for k, v in sd.items()}
        shifts.append(Shift(**fields))
    floats = {k: float(v) for k, v in top.items() if _TOP[k][1] == "number"}
    if "lr_grid" in top:
        top["lr_grid"] = tuple(float(x) for x in top["lr_grid"])
    top.update(floats)
    for key in ("dataset_kwargs", "model_kwargs"):
        if key in top:
            top[key] = _frozen(top[key])
    sc = Scenario(workers=tuple(workers), shifts=tuple(shifts), events=tuple(events), **top)
    return validate(sc, source)


def _worker_spec(where: str, wd: dict[str, Any]) -> WorkerSpec:
    """A checked [[workers]] table (``count`` taken out) as its spec."""
    strag = Stragglers(**_checked(f"{where}.stragglers", wd.pop("stragglers", {}), _STRAGGLERS))
    values: dict[str, Any] = {k: v if k in ("memory", "name") else float(v) for k, v in wd.items()}
    return WorkerSpec(**values, stragglers=strag)


def _events(
    source: str, raw: list[Any], workers: list[WorkerSpec], budget: Any
) -> list[ChurnEvent]:
    """The [[events]] tables as joins and leaves, checked against the workers there are at each
    event's time: a leave names a worker in the run then, and one worker at least stays."""
    if budget is None:  # the dataclass's default
        budget = next(f.default for f in dataclasses.fields(Scenario) if f.name == "budget_s")
    budget = float(budget)
    names = {w.name: i for i, w in enumerate(workers) if w.name}
    if len(names) < sum(1 for w in workers if w.name):
        raise ScenarioError(f"{source}: two workers have the same 'name'")
    present = set(range(len(workers)))
    count = len(workers)
    out: list[ChurnEvent] = []
    last = 0.0
    for i, e in enumerate(raw):
        where = f"{source}: events[{i}]"
        ed = _checked(where, e, _EVENT)
        if "at_s" not in ed:
            raise ScenarioError(f"{where}: missing required key 'at_s'")
        at = float(ed["at_s"])
        if at >= budget:
            raise ScenarioError(f"{where}: 'at_s' ({at:g}) must be before 'budget_s' ({budget:g})")
        if at < last:
            raise ScenarioError(
                f"{where}: events must be in time order ('at_s' {at:g} comes after {last:g})"
            )
        last = at
        if ("join" in ed) == ("leave" in ed):
            raise ScenarioError(f"{where}: give exactly one of 'join' or 'leave'")
        if "join" in ed:
            if "how" in ed:
                raise ScenarioError(f"{where}: 'how' belongs to a leave, not a join")
            spec = _worker_spec(f"{where}.join", _checked(f"{where}.join", ed["join"], _JOIN))
            if spec.name:
                if spec.name in names:
                    raise ScenarioError(f"{where}.join: two workers are named {spec.name!r}")
                names[spec.name] = count
            out.append(Join(at, count, spec))
            present.add(count)
            count += 1
            continue
        if "how" not in ed:
            raise ScenarioError(
                f"{where}: a leave needs 'how': {' or '.join(map(repr, LEAVE_HOW))}"
            )
        who = ed["leave"]
        if isinstance(who, str):
            if who not in names:
                known = ", ".join(map(repr, names)) or "none: give workers a 'name'"
                raise ScenarioError(f"{where}: no worker is named {who!r} (names: {known})")
            who = names[who]
        if who not in present:
            alive = ", ".join(map(str, sorted(present)))
            raise ScenarioError(
                f"{where}: worker {who} is not in the run at {at:g} s (there: {alive})"
            )
        if len(present) == 1:
            raise ScenarioError(f"{where}: the last worker cannot leave; one must stay to train")
        present.discard(who)
        out.append(Leave(at, who, ed["how"]))
    return out


def _frozen(value: Any) -> Any:
    """TOML arrays as tuples (hashable, so data sets cache), tables as dicts."""
    if isinstance(value, list | tuple):
        return tuple(_frozen(v) for v in value)
    if isinstance(value, Mapping):
        return {k: _frozen(v) for k, v in value.items()}
    return value


def validate(sc: Scenario, source: str = "<scenario>") -> Scenario:
    """Cross-field checks; returns ``sc`` unchanged when it is consistent."""
    if sc.global_batch < sc.n:
        raise ScenarioError(
            f"{source}: 'global_batch' ({sc.global_batch}) must be >= the number of workers "
            f"({sc.n}), so that each worker gets at least one sample per round"
        )
    everyone = len(sc.all_workers)
    for s in sc.shifts:
        if not 0 <= s.worker < everyone:
            raise ScenarioError(f"{source}: shift names worker {s.worker}; there are {everyone}")
    if sc.events and sc.global_batch < sc.peak_workers:
        raise ScenarioError(
            f"{source}: 'global_batch' ({sc.global_batch}) must be >= the most workers in the "
            f"run at once ({sc.peak_workers})"
        )
    if sc.eval_interval_s > sc.budget_s:
        raise ScenarioError(f"{source}: 'eval_interval_s' is longer than 'budget_s'")
    return sc


def replace(sc: Scenario, **changes: Any) -> Scenario:
    """A copy with some fields changed, checked again (e.g. ``budget_s`` from the command line)."""
    return validate(dataclasses.replace(sc, **changes), sc.name)


# --- files -------------------------------------------------------------------------------------------


def scenario_names() -> list[str]:
    """The packaged scenario names (file stems), sorted."""
    folder = resources.files("hetd.sim") / "scenarios"
    return sorted(p.name.rsplit(".", 1)[0] for p in folder.iterdir() if p.name.endswith(".toml"))


def load_file(path: str | Path) -> Scenario:
    """A scenario from a ``.toml`` or ``.json`` file."""
    p = Path(path)
    try:
        text = p.read_bytes()
    except OSError as exc:
        raise ScenarioError(f"cannot read scenario {p}: {exc.strerror}") from None
    sc = _parse(text, p.name, p.suffix.lower() == ".json")
    if sc.costs and not Path(sc.costs).is_absolute():  # a profile beside the scenario file
        sc = dataclasses.replace(sc, costs=str(p.parent / sc.costs))
    return sc


def _parse(text: bytes, source: str, is_json: bool) -> Scenario:
    try:
        raw = json.loads(text) if is_json else tomllib.loads(text.decode())
    except (json.JSONDecodeError, tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        kind = "JSON" if is_json else "TOML"
        raise ScenarioError(f"{source} is not valid {kind}: {exc}") from None
    if not isinstance(raw, Mapping):
        raise ScenarioError(f"{source}: the top level must be a table/object")
    return from_mapping(raw, source)


def load_scenario(spec: str) -> Scenario:
    """A packaged scenario by name (``S1``; case-insensitive) or a path to a TOML/JSON file."""
    path = Path(spec)
    if path.suffix.lower() in (".toml", ".json") or path.exists():
        return load_file(path)
    names = scenario_names()
    match = next((n for n in names if n.lower() == spec.lower()), None)
    if match is None:
        raise ScenarioError(
            f"unknown scenario {spec!r}; packaged scenarios: {', '.join(names)} "
            "(or give the path of a .toml/.json file)"
        )
    data = (resources.files("hetd.sim") / "scenarios" / f"{match}.toml").read_bytes()
    return _parse(data, f"{match}.toml", False)
