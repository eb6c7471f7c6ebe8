"""Heterogeneity emulation: make a fast box act like a slow one (slow-down, regime shifts, transient
stragglers, link bandwidth and latency). Pure arithmetic on measured times; time is injected (a
``now`` argument, or a :class:`ScheduleClock` built on a clock the caller gives) and the caller does
the sleeping.

The rules are the simulator's (``hetd.sim.agent``, ``hetd.sim.compute.Straggler``), so that a real
run of a scenario charges what a simulated one does:

* a step over ``samples`` samples that starts at schedule time ``t`` lasts
  ``max(real compute, base_step_s × samples / base_batch × slowdown(t) × straggle)``, where
  ``slowdown(t)`` is the initial slow-down or that of the last shift at or before ``t`` (shifts at
  the same time apply in the order given) and ``straggle`` is ``straggle_factor`` inside a slow
  episode and 1 outside it. The host's real compute is a floor (it cannot go faster), never
  multiplied: the simulator charges the emulated device's time alone, proportional to the samples,
  while the host's own time has a fixed part per step (a whole micro-batch for a share of 4
  samples, dispatch, the shared cores' load) that a slow-down of 4 would turn into four times as
  much. Without a base step (``base_step_s = 0``) the slow-down multiplies the real compute;
* each step outside an episode starts one with probability ``stragglers``; an episode lasts a
  geometric number of steps with mean ``straggle_mean`` (the step that starts it included);
* every message on the link (a push one way, a parameter frame the other, a pipeline stage's
  activations and their gradients both ways) takes ``latency_s + bytes / bandwidth`` more;
* a pipeline stage's work (blocks ``[lo, hi)`` of a block-structured model) is charged as the
  simulator's pipeline charges it: a micro-batch of ``m`` samples costs the stage's share of the
  model's compute (its blocks' parameters over all of them) × ``m`` × the seconds per sample,
  one third for its forward and two for its backward (:meth:`Emulation.stage_seconds`);
* memory (``memory``, bytes): a whole-model step needs the parameters, their gradients and one
  micro-batch's activations (:func:`whole_step_bytes`, the simulator's rule); a worker asked for
  one that does not fit fails it with :class:`OutOfMemory`, as a memory-poor device's
  allocation fails, and leaves (:meth:`Emulation.check_whole_step`). Pipeline stages hold only
  their blocks and run.

Schedule time is seconds since the schedule's *origin*. Before the origin is known, or before it
arrives, the worker runs at its initial slow-down with no shift and no straggle episode: the
schedule begins at its origin, as the simulator's begins at its t = 0.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from workers.errors import FatalError

_UNITS = {
    "": 1.0,
    "b": 1.0,
    "kb": 1e3,
    "mb": 1e6,
    "gb": 1e9,
    "kib": 1024.0,
    "mib": 1024.0**2,
    "gib": 1024.0**3,
}

BEFORE = -math.inf  # schedule time before the origin (or while it is not known)
ORIGIN_MODES = ("first-step", "stdin")  # besides a Unix time


class OutOfMemory(FatalError):
    """A whole-model step that does not fit the memory the worker emulates: the worker leaves,
    as one whose device runs out of memory does."""


def whole_step_bytes(shapes: Mapping[str, Sequence[int]], micro: int) -> float:
    """Bytes a whole-model step needs: float32 parameters and their gradients, and one
    micro-batch of ``micro`` samples' activations (each block's output, for a block-structured
    model, :func:`hetd.zoo.shapes.block_facts`; none for any other). The simulator's worker
    counts the same (``hetd.sim.agent.EmuWorker.fits``)."""
    from hetd.zoo.shapes import block_facts

    n_params = sum(math.prod(s) for s in shapes.values())
    acts = sum(a for _, a, _ in block_facts({k: tuple(v) for k, v in shapes.items()}))
    return 8.0 * n_params + micro * acts


def parse_rate(text: str) -> float:
    """``"20MB/s"``, ``"500kB/s"``, ``"1e6"`` -> bytes per second; bad text raises ValueError."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*([a-zA-Z]*)\s*(?:/s)?\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"bad rate {text!r}: use e.g. 20MB/s, 500kB/s or a number of bytes/s")
    rate = float(m.group(1)) * _UNITS[m.group(2).lower()]
    if rate <= 0:
        raise ValueError(f"rate must be > 0, got {text!r}")
    return rate


def _number(text: str, what: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"{what} must be a number, got {text!r}") from None
    if not math.isfinite(value):
        raise ValueError(f"{what} must be finite, got {text!r}")
    return value


def parse_shift(text: str) -> tuple[float, float]:
    """``"T:X"`` -> ``(T, X)``: from ``T`` s of schedule time on the slow-down is ``X`` (T >= 0,
    X >= 1); bad text raises ValueError."""
    t, sep, x = text.partition(":")
    if not sep:
        raise ValueError(
            f"bad shift {text!r}: use T:X (seconds from the origin, slow-down), e.g. 10:3"
        )
    at = _number(t.strip(), f"shift {text!r}: the time")
    slowdown = _number(x.strip(), f"shift {text!r}: the slow-down")
    if at < 0:
        raise ValueError(f"shift {text!r}: the time must be >= 0 s")
    if slowdown < 1:
        raise ValueError(f"shift {text!r}: the slow-down must be >= 1")
    return at, slowdown


def parse_origin(text: str) -> str | float:
    """``"first-step"``, ``"stdin"`` or a Unix time (seconds since the epoch, >= 0)."""
    if text in ORIGIN_MODES:
        return text
    try:
        epoch = float(text)
    except ValueError:
        epoch = math.nan
    if not (math.isfinite(epoch) and epoch >= 0):
        raise ValueError(
            f"bad origin {text!r}: use first-step, stdin or a Unix time in seconds, e.g. 1700000000"
        )
    return epoch


def origin_from_wall(epoch: float, wall_now: float, mono_now: float) -> float:
    """The reading of a monotonic clock that showed ``mono_now`` when the wall clock showed
    ``wall_now``, at the wall-clock instant ``epoch``."""
    return mono_now - (wall_now - epoch)


class ScheduleClock:
    """Schedule time: seconds since the origin, on the injected monotonic clock ``monotonic``.

    ``origin`` is the reading of ``monotonic`` that is time 0, or None while it is not known (it
    may be set later with :meth:`set_origin`, from another thread: one float assignment). With
    ``first_step`` an unknown origin becomes the start of the first step that asks."""

    def __init__(
        self,
        monotonic: Callable[[], float],
        origin: float | None = None,
        first_step: bool = False,
    ) -> None:
        self._monotonic = monotonic
        self.origin = origin
        self.first_step = first_step

    def set_origin(self, at: float) -> None:
        """Time 0 is the reading ``at`` of the monotonic clock."""
        self.origin = at

    def started(self, elapsed: float) -> float:
        """Schedule time at which an interval of ``elapsed`` s that ends now began
        (:data:`BEFORE` while the origin is not known)."""
        began = self._monotonic() - elapsed
        if self.origin is None:
            if not self.first_step:
                return BEFORE
            self.origin = began
        return began - self.origin

    def until(self, t: float) -> float | None:
        """Seconds from now until schedule time ``t`` (<= 0 once it has passed); None while the
        origin is not known."""
        if self.origin is None:
            return None
        return self.origin + t - self._monotonic()


@dataclass
class Emulation:
    """How much slower than the hardware this worker should behave.

    ``slowdown`` multiplies every step's nominal time (``base_step_s`` per ``base_batch``
    samples; the real compute only when it is longer; without a base step, the real compute)
    until a regime shift in
    ``shifts`` (``(t, slowdown)``: from schedule time ``t`` on) replaces it; ``bandwidth``
    (bytes/s) caps the link and ``latency_s`` is added to every message on it, both ways;
    ``stragglers`` is the chance per step that a slow episode (``straggle_factor`` ×, geometric
    length with mean ``straggle_mean`` steps) begins (docs/benchmark.md, scenario S2); ``seed``
    fixes the episodes; ``clock`` gives a step's schedule time when the caller does not;
    ``bad_pushes`` injects faults: the chance that a push carries NaN, which the daemon refuses;
    ``join_at_s``: the schedule time of the worker's first connection (a scenario's joiner: it
    starts, fetches the setup and builds its trainer before, and connects then; None: at once).
    """

    slowdown: float = 1.0
    base_step_s: float = 0.0  # s per step of base_batch samples, before the slow-down
    base_batch: int = 32
    memory: int | None = None  # bytes of free memory to report instead of the real figure
    bandwidth: float | None = None
    latency_s: float = 0.0  # s added to each message's transfer, both directions
    stragglers: float = 0.0
    straggle_factor: float = 5.0
    straggle_mean: float = 10.0
    shifts: Sequence[tuple[float, float]] = ()  # (schedule time s, slow-down from then on)
    bad_pushes: float = 0.0  # chance that a push carries NaN (fault injection: refused, not fatal)
    seed: int = 0
    join_at_s: float | None = None  # schedule time of the first connection (None: at once)
    clock: ScheduleClock | None = None  # None: every step is before the origin unless told
    _left: int = 0  # steps left in the current slow episode
    _rng: np.random.Generator = field(default_factory=lambda: np.random.default_rng(0))
    _fault_rng: np.random.Generator = field(default_factory=lambda: np.random.default_rng(0))

    def __post_init__(self) -> None:
        if not 1.0 <= self.slowdown < math.inf:
            raise ValueError(f"slowdown must be >= 1, got {self.slowdown}")
        if not 0.0 <= self.base_step_s < math.inf:
            raise ValueError(f"base step time must be >= 0, got {self.base_step_s}")
        if not 0.0 <= self.stragglers <= 1.0:
            raise ValueError(f"stragglers must be a probability, got {self.stragglers}")
        if not 1.0 <= self.straggle_factor < math.inf:
            raise ValueError(f"straggle factor must be >= 1, got {self.straggle_factor}")
        if not 1.0 <= self.straggle_mean < math.inf:
            raise ValueError(f"straggle mean must be >= 1 step, got {self.straggle_mean}")
        if not 0.0 <= self.latency_s < math.inf:
            raise ValueError(f"latency must be >= 0 s, got {self.latency_s}")
        if not 0.0 <= self.bad_pushes <= 1.0:
            raise ValueError(f"bad pushes must be a probability, got {self.bad_pushes}")
        for at, slowdown in self.shifts:
            if not (0.0 <= at < math.inf and 1.0 <= slowdown < math.inf):
                raise ValueError(
                    f"a shift needs a time >= 0 and a slow-down >= 1, got {at}:{slowdown}"
                )
        if self.join_at_s is not None and not 0.0 <= self.join_at_s < math.inf:
            raise ValueError(f"join time must be >= 0 s, got {self.join_at_s}")
        # Stable: shifts at the same time apply in the order given (the simulator's rule).
        self.shifts = tuple(sorted(self.shifts, key=lambda s: s[0]))
        self._rng = np.random.default_rng(self.seed)
        self._fault_rng = np.random.default_rng([self.seed, 1])

    def corrupt_push(self) -> bool:
        """Whether the next push should carry NaN (its own random stream: faults do not change
        the straggler pattern)."""
        return self.bad_pushes > 0 and bool(self._fault_rng.random() < self.bad_pushes)

    def slowdown_at(self, t: float) -> float:
        """The slow-down at schedule time ``t`` (:data:`BEFORE`: the initial one)."""
        value = self.slowdown
        for at, slowdown in self.shifts:
            if at <= t:
                value = slowdown
        return value

    def _straggle(self, t: float) -> float:
        """The next step's straggle multiplier; one draw per step from the origin on."""
        if t < 0:  # before the origin (BEFORE included)
            return 1.0
        if self._left == 0 and self.stragglers > 0 and self._rng.random() < self.stragglers:
            self._left = int(self._rng.geometric(1.0 / self.straggle_mean))
        if self._left > 0:
            self._left -= 1
            return self.straggle_factor
        return 1.0

    def step_seconds(
        self, compute_s: float, samples: int | None = None, now: float | None = None
    ) -> float:
        """The emulated duration of a step over ``samples`` that really took ``compute_s``:
        ``base_step_s × samples/base_batch`` times the slow-down at ``now`` and any straggle, or
        the real compute when that is longer (module docstring); without a base step, the real
        compute times them. ``now`` is the step's start in schedule time; None asks ``clock``
        (the step ended just now); a negative time (:data:`BEFORE` with no clock) is before the
        origin."""
        if now is None:
            now = self.clock.started(compute_s) if self.clock is not None else BEFORE
        factor = self.slowdown_at(now) * self._straggle(now)
        if self.base_step_s <= 0:
            return compute_s * factor
        base = self.base_step_s * (samples if samples is not None else self.base_batch)
        return max(compute_s, base / self.base_batch * factor)

    def stage_seconds(self, compute_s: float, samples: float, now: float | None = None) -> float:
        """The emulated duration of pipeline-stage work worth ``samples`` whole-model samples
        (the stage's share of the model's compute × the micro-batch × 1/3 for a forward, 2/3
        for a backward) that really took ``compute_s``: as :meth:`step_seconds`, with the
        slow-down at ``now`` and no straggle draw (episodes count whole-model steps)."""
        if now is None:
            now = self.clock.started(compute_s) if self.clock is not None else BEFORE
        factor = self.slowdown_at(now)
        if self.base_step_s <= 0:
            return compute_s * factor
        return max(compute_s, self.base_step_s * samples / self.base_batch * factor)

    def check_whole_step(self, shapes: Mapping[str, Sequence[int]], micro: int) -> None:
        """Raise :class:`OutOfMemory` when a whole-model step of the model of parameter
        ``shapes`` at micro-batch ``micro`` (:func:`whole_step_bytes`) does not fit the
        emulated ``memory`` (never without one)."""
        if self.memory is None:
            return
        need = whole_step_bytes(shapes, micro)
        if need > self.memory:
            raise OutOfMemory(
                f"out of memory: a whole-model step needs {need / 1e6:.2f} MB (parameters, "
                f"gradients and a {micro}-sample micro-batch's activations) and this worker has "
                f"{self.memory / 1e6:.2f} MB (--emulate-memory); it can run pipeline stages only"
            )

    def join_wait_s(self) -> float | None:
        """Seconds left before the first connection (0 once it may connect, and always without
        ``join_at_s``); None while the origin it counts from is not known."""
        if self.join_at_s is None:
            return 0.0
        if self.clock is None:
            return None
        left = self.clock.until(self.join_at_s)
        return None if left is None else max(0.0, left)

    def transfer_seconds(self, nbytes: int) -> float:
        """Extra seconds to move one message of ``nbytes`` over the emulated link: its latency
        plus the bytes over the bandwidth cap (0 with neither)."""
        return self.latency_s + (0.0 if self.bandwidth is None else nbytes / self.bandwidth)
