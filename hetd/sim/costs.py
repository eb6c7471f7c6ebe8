"""What the simulator charges besides compute and links: a cost profile measured on a machine.

Owns :class:`CostProfile` (the costs a real run pays on the daemon and on the workers, in seconds,
read by :mod:`hetd.sim.server_model`, :mod:`hetd.sim.loop` and :mod:`hetd.sim.agent`),
:data:`FIELDS` (each cost's unit and meaning, docs/benchmark.md "The cost profile"), and the
JSON file: :func:`load_costs`, :func:`write_costs`, :meth:`CostProfile.from_json` (strict: a
missing, unknown or bad field raises :class:`CostError` naming it). ``hetd calibrate``
(:mod:`hetd.bench.calibrate`) measures a profile with the real code paths.

The default profile, :class:`CostProfile()` with every cost zero, charges nothing: the simulator
then gives exactly the results it gave before profiles existed (``tests/golden`` pins them). A
calibrated profile is opt-in (``hetd sim/bench --costs FILE`` or a scenario's ``costs`` key). Costs
are fixed numbers, so a run with a given profile is as deterministic as one without.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

FORMAT = "hetd-costs"
VERSION = 1
OFF_LOOP_BYTES = 256 * 1024  # the daemon's sessions decode bigger push frames in a thread

# name -> (unit, meaning); the order is the file's. "/param" figures are per scalar parameter of the
# model; a per-codec figure is a map from codec name (``none``, ``int8``, ...) to the value.
FIELDS: dict[str, tuple[str, str]] = {
    "message_s": (
        "s",
        "daemon: the engine's work for one worker message (facts, policy, bookkeeping, the ack), "
        "optimizer step and parameter frames excluded",
    ),
    "push_decode_s_per_param": (
        "s/param by codec",
        "daemon: decoding a push frame and checking its tensors (wire.decode + ingest); on the "
        "engine's loop for frames up to off_loop_bytes, in a thread beside it for bigger ones",
    ),
    "apply_s": (
        "s per update by kind",
        "daemon: one queued update applied and its version snapshotted: 'grad' (optimizer step), "
        "'delta' (outer step), 'grad:int8' and 'delta:int8' (int8 dequantized inside the step)",
    ),
    "buffer_s_per_param": (
        "s/param",
        "daemon: adding a push into a round's buffer (synchronous policies), per push",
    ),
    "publish_s_per_param": (
        "s/param by codec",
        "daemon: encoding one parameter frame: 'none' a full frame, a lossy codec a delta against "
        "a worker's reference; once per frame, shared by every worker it goes to",
    ),
    "worker_encode_s_per_param": (
        "s/param by codec",
        "worker: encoding its push (codec with error feedback, the push frame) after computing",
    ),
    "worker_decode_s_per_param": (
        "s/param by codec",
        "worker: decoding a parameter frame and applying it to what it holds before its next step",
    ),
    "worker_step_s": (
        "s",
        "worker: fixed time per step outside compute and codecs (thread hops, the emulated "
        "sleep's overshoot)",
    ),
    "eval_s": (
        "s",
        "daemon: one evaluation of the global model; it runs in a thread, so it stalls nothing "
        "but its result is recorded this much later",
    ),
    "profile_s": (
        "s",
        "worker: the profile exchange when it joins (the requested steps really computed, one "
        "encode); null: charge the profile steps as emulated steps",
    ),
    "exchange_s": (
        "s",
        "worker: what one step's round trip on loopback costs beyond everything above and the "
        "scenario's link (websocket framing and copies, thread hops, the host's scheduler), "
        "fitted from a real daemon and one real worker; the same on every step. It delays the "
        "push's arrival: a worker without pipeline waits for it, a pipelined one computes meanwhile",
    ),
    "release_stagger_s": (
        "s",
        "daemon: when one batch releases several workers, the k-th (k = 0, 1, ...) gets its "
        "parameters k times this later (frames are written one at a time, the woken workers "
        "share the host's cores); fitted from a real synchronous round of all the workers",
    ),
    "off_loop_bytes": (
        "bytes",
        "the daemon decodes push frames bigger than this in a thread (not a measurement: the "
        "daemon's constant, recorded with the figures)",
    ),
}
_PER_CODEC = (
    "push_decode_s_per_param",
    "publish_s_per_param",
    "worker_encode_s_per_param",
    "worker_decode_s_per_param",
)
# fields a profile written before they existed may lack: they are read as 0 (charge nothing)
OPTIONAL = ("exchange_s", "release_stagger_s")
APPLY_KEYS = ("grad", "delta", "grad:int8", "delta:int8")
_TOP = ("format", "version", "about", "costs", "units")


class CostError(ValueError):
    """A bad cost profile, or a figure the profile lacks; the message says which."""


def codec_name(spec: str) -> str:
    """A codec spec's name: ``"int8:block=1024"`` -> ``"int8"``."""
    return spec.split(":", 1)[0].strip()


@dataclass(frozen=True)
class CostProfile:
    """Seconds a real run pays that the scenario does not describe (see :data:`FIELDS`)."""

    message_s: float = 0.0
    push_decode_s_per_param: Mapping[str, float] = field(default_factory=dict)
    apply_s: Mapping[str, float] = field(default_factory=dict)
    buffer_s_per_param: float = 0.0
    publish_s_per_param: Mapping[str, float] = field(default_factory=dict)
    worker_encode_s_per_param: Mapping[str, float] = field(default_factory=dict)
    worker_decode_s_per_param: Mapping[str, float] = field(default_factory=dict)
    worker_step_s: float = 0.0
    eval_s: float = 0.0
    profile_s: float | None = None
    exchange_s: float = 0.0
    release_stagger_s: float = 0.0
    off_loop_bytes: int = OFF_LOOP_BYTES
    about: Mapping[str, Any] = field(default_factory=dict)  # what was measured, where, when

    # --- the figures as the simulator asks for them ------------------------------------------

    def _per_codec(self, name: str, table: Mapping[str, float], codec: str) -> float:
        if not table:
            return 0.0  # the default profile: nothing charged
        for key in (codec, codec_name(codec)):
            if key in table:
                return table[key]
        raise CostError(
            f"the cost profile has no {name} for codec {codec!r} (it has "
            f"{', '.join(sorted(table))}); run hetd calibrate again"
        )

    def push_decode(self, codec: str, n_params: int) -> float:
        """s to decode and check one push in ``codec`` on the daemon."""
        return self._per_codec("push_decode_s_per_param", self.push_decode_s_per_param, codec) * (
            n_params
        )

    def apply(self, kind: str, int8: bool = False) -> float:
        """s to apply one update of ``kind`` (``grad``/``delta``); ``int8``: fused int8."""
        if not self.apply_s:
            return 0.0
        key = f"{kind}:int8" if int8 and f"{kind}:int8" in self.apply_s else kind
        if key not in self.apply_s:
            raise CostError(f"the cost profile has no apply_s for {key!r}")
        return self.apply_s[key]

    def publish(self, codec: str, n_params: int) -> float:
        """s to encode one parameter frame whose tensors are in ``codec``."""
        return self._per_codec("publish_s_per_param", self.publish_s_per_param, codec) * n_params

    def worker_encode(self, codec: str, n_params: int) -> float:
        """s a worker spends encoding a push in ``codec``."""
        table = self.worker_encode_s_per_param
        return self._per_codec("worker_encode_s_per_param", table, codec) * n_params

    def worker_decode(self, codec: str, n_params: int) -> float:
        """s a worker spends decoding and applying a parameter frame in ``codec``."""
        table = self.worker_decode_s_per_param
        return self._per_codec("worker_decode_s_per_param", table, codec) * n_params

    # --- the file --------------------------------------------------------------------------------

    def to_json(self) -> dict[str, Any]:
        """The profile as its JSON document (``format``, ``version``, ``about``, ``costs``,
        ``units``)."""
        costs: dict[str, Any] = {}
        for name in FIELDS:
            value = getattr(self, name)
            costs[name] = dict(value) if isinstance(value, Mapping) else value
        return {
            "format": FORMAT,
            "version": VERSION,
            "about": dict(self.about),
            "costs": costs,
            "units": {name: unit for name, (unit, _) in FIELDS.items()},
        }

    @classmethod
    def from_json(cls, doc: Any, source: str = "<costs>") -> CostProfile:
        """A profile from its JSON document, checked: every field of :data:`FIELDS` present,
        none unknown, each a finite number >= 0 or a map of them (empty: nothing charged)."""
        if not isinstance(doc, Mapping):
            raise CostError(f"{source}: a cost profile is a JSON object, got {type(doc).__name__}")
        unknown = sorted(set(doc) - set(_TOP))
        if unknown:
            raise CostError(
                f"{source}: unknown top-level key(s) {', '.join(map(repr, unknown))}; "
                f"valid: {', '.join(_TOP)}"
            )
        if doc.get("format") != FORMAT or doc.get("version") != VERSION:
            raise CostError(
                f"{source}: not a hetd cost profile of version {VERSION} (format "
                f"{doc.get('format')!r}, version {doc.get('version')!r}; want {FORMAT!r}, "
                f"{VERSION}); write one with hetd calibrate"
            )
        costs = doc.get("costs")
        if not isinstance(costs, Mapping):
            raise CostError(
                f"{source}: 'costs' must be an object of the fields {', '.join(FIELDS)}"
            )
        missing = [k for k in FIELDS if k not in costs and k not in OPTIONAL]
        extra = sorted(set(costs) - set(FIELDS))
        if missing or extra:
            parts = []
            if missing:
                parts.append(f"missing {', '.join(map(repr, missing))}")
            if extra:
                parts.append(f"unknown {', '.join(map(repr, extra))}")
            raise CostError(f"{source}: costs: {'; '.join(parts)}; the fields: {', '.join(FIELDS)}")
        units = doc.get("units", {})
        if not isinstance(units, Mapping):
            raise CostError(f"{source}: 'units' must be an object of field -> unit")
        for name, unit in units.items():
            if name in FIELDS and unit != FIELDS[name][0]:
                raise CostError(
                    f"{source}: units[{name!r}] is {unit!r}, but hetd reads {name} in "
                    f"{FIELDS[name][0]!r}"
                )
        about = doc.get("about", {})
        if not isinstance(about, Mapping):
            raise CostError(f"{source}: 'about' must be an object")
        values: dict[str, Any] = {}
        for name in FIELDS:
            where = f"{source}: costs.{name}"
            if name not in costs:  # an OPTIONAL field of an older profile
                continue
            value = costs[name]
            if name in _PER_CODEC or name == "apply_s":
                values[name] = _table(where, value)
            elif name == "profile_s" and value is None:
                values[name] = None
            elif name == "off_loop_bytes":
                if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                    raise CostError(f"{where} must be an integer >= 0 (bytes), got {value!r}")
                values[name] = value
            else:
                values[name] = _seconds(where, value)
        for key in ("grad", "delta"):
            if values["apply_s"] and key not in values["apply_s"]:
                raise CostError(f"{source}: costs.apply_s lacks {key!r} (it needs grad and delta)")
        bad = sorted(set(values["apply_s"]) - set(APPLY_KEYS))
        if bad:
            raise CostError(
                f"{source}: costs.apply_s has unknown key(s) {', '.join(map(repr, bad))}; "
                f"valid: {', '.join(APPLY_KEYS)}"
            )
        return cls(about=dict(about), **values)


def _seconds(where: str, value: Any) -> float:
    if not isinstance(value, int | float) or isinstance(value, bool):
        raise CostError(f"{where} must be a number, got {value!r} ({type(value).__name__})")
    if not (math.isfinite(value) and value >= 0):
        raise CostError(f"{where} must be finite and >= 0, got {value!r}")
    return float(value)


def _table(where: str, value: Any) -> dict[str, float]:
    """A map of name -> seconds; an empty one charges nothing (the default profile's)."""
    if not isinstance(value, Mapping):
        raise CostError(f"{where} must be an object of name -> number, got {value!r}")
    return {str(k): _seconds(f"{where}[{k!r}]", v) for k, v in value.items()}


def load_costs(path: str | Path) -> CostProfile:
    """The cost profile in ``path`` (JSON written by ``hetd calibrate``), checked."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as exc:
        raise CostError(f"cannot read cost profile {p}: {exc.strerror}") from None
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        raise CostError(f"{p} is not valid JSON: {exc}") from None
    return CostProfile.from_json(doc, str(p))


def write_costs(path: str | Path, profile: CostProfile) -> None:
    """Write ``profile`` as JSON to ``path`` (checked by reading it back first)."""
    doc = profile.to_json()
    CostProfile.from_json(json.loads(json.dumps(doc)), str(path))
    p = Path(path)
    if p.parent != Path():
        p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(doc, indent=1) + "\n")
