"""How ``auto`` names its candidates and weighs a forecast of them.

Owns the candidate syntax (``name[:key=value;...]``, values in JSON, as a planner reads the same
parameter), the identity of a candidate (:func:`key_of`: its name and the parameters that differ
from the factory's defaults), the log of the model's recent errors (:class:`ErrorLog`) and the
error-discounted ranking of a forecast's predictions (:func:`weigh`, :class:`Scored`,
:class:`Choice`). The switching itself is :mod:`policies.auto`. Pure: no I/O, no clock.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from policies.registry import make_policy, policy_names
from policies.types import Prediction

# The policies auto may switch among by default: gates, batch shares and local-step policies
# whose state is all in the policy. The DiLoCo family is left out: its outer optimizer is set by
# the engine's own swap, which a switch inside auto is not.
DEFAULT_CANDIDATES = ("bsp", "ssp", "asp", "lbbsp", "hps", "adsp", "ashl", "dssp")
NOT_CANDIDATES: Mapping[str, str] = MappingProxyType(
    {
        "auto": "auto cannot run inside itself",
        "diloco": "its outer optimizer is set by the engine's swap (swap to it with the engine)",
        "diloco_async": "its outer optimizer is set by the engine's swap (swap to it with the "
        "engine)",
        "quorum": "it wraps diloco, whose outer optimizer is set by the engine's swap",
        "staleness_weight": "a weight rule, not a gate: it releases nobody",
    }
)
RECENT_ERRORS = 4  # prediction errors kept per policy, and for the model as a whole

Params = tuple[tuple[str, Any], ...]  # (key, value), sorted by key
Key = tuple[str, tuple[tuple[str, str], ...]]  # name, (key, JSON value) that differ from defaults


def _value(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def parse_candidate(text: str) -> tuple[str, Params]:
    """One ``name[:key=value[;key=value...]]`` as (name, params); ValueError when malformed."""
    name, _, rest = text.strip().partition(":")
    if not name.strip():
        raise ValueError(f"candidate {text!r} has no policy name; e.g. ssp:staleness=4")
    params: dict[str, Any] = {}
    for pair in (p for p in rest.split(";") if p.strip()):
        key, eq, value = pair.partition("=")
        if not eq or not key.strip():
            raise ValueError(f"candidate {text!r}: parameter {pair!r} must look like key=value")
        params[key.strip()] = _value(value.strip())
    return name.strip(), tuple(sorted(params.items()))


def parse_candidates(spec: str | Sequence[str]) -> tuple[tuple[str, Params], ...]:
    """A comma-separated string or a sequence of candidates, each named once, in order."""
    items = spec.split(",") if isinstance(spec, str) else [str(s) for s in spec]
    out: list[tuple[str, Params]] = []
    for item in (s for s in items if s.strip()):
        c = parse_candidate(item)
        if c not in out:
            out.append(c)
    if not out:
        raise ValueError(f"no candidates in {spec!r}; e.g. {','.join(DEFAULT_CANDIDATES)!r}")
    return tuple(out)


def label(name: str, params: Params) -> str:
    """``name``, or ``name:key=value;...`` with JSON values (how a candidate is written)."""
    if not params:
        return name
    return name + ":" + ";".join(f"{k}={json.dumps(v)}" for k, v in params)


def key_of(name: str, params: Params) -> Key:
    """What makes two candidates the same policy: the name and the parameters that differ from
    the factory's defaults (``ssp`` and ``ssp:staleness=3`` are one). Raises the registry's
    error for an unknown name or a bad parameter."""
    given = make_policy(name, dict(params)).params
    defaults = make_policy(name).params
    missing = object()
    changed = sorted(
        (str(k), json.dumps(v, sort_keys=True, default=repr))
        for k, v in given.items()
        if defaults.get(k, missing) != v
    )
    return name, tuple(changed)


def canonical(key: Key) -> str:
    """A candidate's one label: its name and the parameters that differ from the defaults."""
    name, changed = key
    return name if not changed else name + ":" + ";".join(f"{k}={v}" for k, v in changed)


def check_candidates(cands: Iterable[tuple[str, Params]]) -> None:
    """Each candidate registered, buildable with its parameters and allowed in auto; raises
    ValueError saying which is not and why."""
    known = policy_names()
    for name, params in cands:
        if name in NOT_CANDIDATES:
            raise ValueError(f"candidate {name!r} cannot run under auto: {NOT_CANDIDATES[name]}")
        if name not in known:
            raise ValueError(f"unknown candidate {name!r}; known policies: {', '.join(known)}")
        key_of(name, params)  # raises on bad parameters


@dataclass(frozen=True, slots=True)
class ErrorLog:
    """Recent checks of the model's throughput predictions: the ratio ``realized / predicted``
    over a window between two forecasts, per policy (by label) and for all together.

    What a prediction is discounted by is the *shortfall* its policy showed, ``1 − ratio`` when it
    delivered less than predicted, the median of its recent checks (one transient window, such
    as the flush and profile after a switch, does not rule alone). A policy that delivered at
    least what was predicted is not discounted, and never credited beyond its prediction: so
    running a policy cannot make it look worse than one not running that was predicted as
    wrongly (the old ``|realized − predicted|`` rule charged a policy for beating its
    prediction, and the running policy's fresh error against another's stale one made auto flip
    between two). A policy never run takes the model's median shortfall."""

    by_policy: Mapping[str, tuple[float, ...]] = field(default_factory=lambda: MappingProxyType({}))
    recent: tuple[float, ...] = ()  # the last RECENT_ERRORS ratios of any policy

    def add(self, policy: str, realized: float, predicted: float) -> ErrorLog:
        """With one more check of ``policy`` (samples/s realized and predicted)."""
        r = max(0.0, realized) / predicted
        mine = (*self.by_policy.get(policy, ())[-(RECENT_ERRORS - 1) :], r)
        return ErrorLog(
            MappingProxyType({**self.by_policy, policy: mine}),
            (*self.recent[-(RECENT_ERRORS - 1) :], r),
        )

    def error_for(self, policy: str) -> float:
        """The shortfall a prediction of ``policy`` is discounted by, in [0, 1]: ``1 −`` the
        median of its own recent ratios, else (never checked) of the model's, 0 when that
        median is at least 1 or there is none."""
        ratios = self.by_policy.get(policy) or self.recent
        if not ratios:
            return 0.0
        return min(1.0, max(0.0, 1.0 - statistics.median(ratios)))

    def describe(self) -> dict[str, Any]:
        """Each policy's recent ratios (realized / predicted) and the model's, as plain values."""
        return {
            "by_policy": {k: list(v) for k, v in sorted(self.by_policy.items())},
            "recent": list(self.recent),
        }


@dataclass(frozen=True, slots=True)
class Scored:
    """One prediction as auto weighed it."""

    name: str
    params: Params
    key: Key
    label: str
    samples_per_s: float  # predicted samples applied per second
    goodput: float  # predicted useful samples per second (× efficiency)
    error: float  # the shortfall it was discounted by (ErrorLog.error_for)
    discounted: float  # goodput × (1 − error)

    def describe(self) -> dict[str, Any]:
        """As plain values."""
        return {
            "policy": self.label,
            "samples_per_s": self.samples_per_s,
            "goodput": self.goodput,
            "error": self.error,
            "discounted": self.discounted,
        }


@dataclass(frozen=True, slots=True)
class Choice:
    """What auto made of one forecast: the candidates weighed (best first) and why it switched
    or stayed."""

    at: float  # s, engine clock
    running: str  # the label of the policy running when the forecast came
    scored: tuple[Scored, ...]
    chosen: str | None  # the label switched to; None: it stayed
    why: str

    def describe(self) -> dict[str, Any]:
        """As plain values."""
        return {
            "at_s": self.at,
            "running": self.running,
            "candidates": [s.describe() for s in self.scored],
            "chosen": self.chosen,
            "why": self.why,
        }


def weigh(
    predictions: Iterable[Prediction],
    allowed: frozenset[Key],
    errors: ErrorLog,
    failed: frozenset[str],
) -> tuple[Scored, ...]:
    """The predictions of allowed candidates (not among the labels in ``failed``), each
    discounted by its error (:meth:`ErrorLog.error_for`), best first (ties: by label). A
    prediction that names no buildable policy is left out."""
    out: list[Scored] = []
    seen: set[Key] = set()
    for p in predictions:
        params = tuple(sorted(p.params))
        try:
            key = key_of(p.name, params)
        except ValueError:
            continue
        name = canonical(key)
        if key not in allowed or key in seen or name in failed:
            continue
        seen.add(key)
        goodput = max(0.0, p.goodput)
        e = errors.error_for(name)
        out.append(
            Scored(p.name, params, key, name, p.samples_per_s, goodput, e, goodput * (1 - e))
        )
    return tuple(sorted(out, key=lambda s: (-s.discounted, s.label)))


__all__ = [
    "DEFAULT_CANDIDATES",
    "NOT_CANDIDATES",
    "Choice",
    "ErrorLog",
    "Key",
    "Scored",
    "canonical",
    "check_candidates",
    "key_of",
    "label",
    "parse_candidate",
    "parse_candidates",
    "weigh",
]
