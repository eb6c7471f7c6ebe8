"""Statistical efficiency: what one applied sample is worth, kept apart from how fast it arrives.

Owns :class:`Efficiency` (the discount of a push by its staleness, its local steps and the size
of the update it is part of, and its weight), :class:`NoiseScale` (the gradient noise scale
from pairs of gradients at the same parameters) and :func:`effective_samples`. The timing twin
(:mod:`policies.twin`) counts samples; a planner multiplies them by this model to compare
policies that trade freshness for speed. The forms are our design [D]; the class defaults are
guesses, and the constants per optimizer family (:data:`PLAIN_SGD`, :data:`ADAM`) are fitted
offline to the samples each policy needed to reach a target in the simulator, not online.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol


class AppliedPush(Protocol):
    """The facts of one applied push the model needs (:class:`policies.twin.Applied` has them)."""

    @property
    def samples(self) -> int: ...  # samples of the push (batch × local steps)

    @property
    def steps(self) -> int: ...  # local steps (1: a gradient)

    @property
    def staleness(self) -> int: ...  # applied updates between its base and its arrival

    @property
    def update_samples(self) -> int: ...  # samples of the whole update it was part of

    @property
    def weight(self) -> float: ...  # its weight against an even share, times its lr_scale


@dataclass(frozen=True, slots=True)
class Efficiency:
    """What an applied sample is worth, relative to a fresh one in a small synchronous step [D].

    A push of ``samples`` samples counts ``samples × ρ_τ × ρ_H × E × S``:

    * ``ρ_τ = 1 / (1 + kappa_staleness · τ)``: a gradient computed ``τ`` updates ago;
    * ``ρ_H = 1 / (1 + kappa_local · (H − 1))``: a delta of ``H`` local steps (one step: 1);
    * ``E = (φ + M0) / (φ + M)`` (Pollux's statistical efficiency): an update whose steps take
      ``M`` samples each (its samples over its local steps: an aggregate of deltas is ``H``
      steps of the summed batch, not one step of everything) against one of ``M0 = base_batch``,
      with ``φ = noise_scale`` the gradient noise scale in samples; ``noise_scale=None`` leaves
      it out (``E = 1``);
    * ``S = (M0 / M) ** batch_exponent``: the same update size ``M`` against ``M0`` without a
      noise scale, for an optimizer that normalizes its steps (Adam): at a fixed learning rate
      each step moves the model about as far whatever its batch, and only its signal grows with
      ``M`` (as ``√M`` where the noise dominates: the square-root scaling rule of Adam), so a
      sample of an update of ``M`` samples is worth ``M^(-1/2)`` (``batch_exponent`` 0.5,
      :data:`ADAM`); 0 leaves it out.

    With ``weighted`` the count is also multiplied by the push's ``weight``: how much of a step it
    made against an even share (1 for a push applied with ``1/N`` of N workers, or inside a mean
    weighted by samples), times its worker's learning-rate scale. Under plain SGD a step moves the
    model in proportion to its weight and learning rate: ashl weighs a fast worker's pushes by its
    data share, above ``1/N``, and the samples it applies count for more than adsp's, which are
    applied at ``1/N`` (simulator, seed 0 of two six- and four-worker SGD clusters with spread
    speeds and slow links: ashl reached the target at 0.56-0.57 of adsp's applied samples and at
    0.73-0.76 of their weighted count; asp, applied at ``1/N`` as adsp is, at 0.97-1.01 of both).
    Under Adam, which normalizes a step's size, the weight still ordered ashl above adsp in the
    simulator (:data:`ADAM`). With a
    noise scale as well, ``E`` is still taken over the update's samples per step; a push at
    ``1/N`` averages its noise as a mean does, so its own batch over its weight would be the
    better measure there [D, not built].

    The default constants are guesses that order policies the way staleness and local steps are
    known to hurt, and nothing more. A planner is meant to fit them to what it observes (progress
    per effective sample, per policy) before it trusts a ranking.
    """

    kappa_staleness: float = 0.1
    kappa_local: float = 0.05
    noise_scale: float | None = None  # φ, samples
    base_batch: int = 32  # M0, samples
    batch_exponent: float = 0.0  # of (M0 / M): an update's size counted without a noise scale
    weighted: bool = False  # count each sample times its push's weight (its step's share)

    def __post_init__(self) -> None:
        for name in ("kappa_staleness", "kappa_local", "batch_exponent"):
            v = getattr(self, name)
            if not (isinstance(v, int | float) and v >= 0 and math.isfinite(v)):
                raise ValueError(f"{name} must be a finite number >= 0, got {v!r}")
        if self.noise_scale is not None and not self.noise_scale >= 0:
            raise ValueError(
                f"noise_scale must be >= 0 samples (or None to leave it out), "
                f"got {self.noise_scale!r}"
            )
        if not self.base_batch >= 1:
            raise ValueError(f"base_batch must be >= 1 sample, got {self.base_batch!r}")

    def factor(self, staleness: int, steps: int, update_samples: int) -> float:
        """The worth of one applied sample of a push with these facts: 1 for a fresh gradient
        of ``base_batch`` samples, in (0, 1] for any push without ``noise_scale`` and
        ``batch_exponent``; with either, above 1 for updates of fewer than ``base_batch`` samples
        per step and below it for larger ones."""
        rho_t = 1.0 / (1.0 + self.kappa_staleness * max(0, staleness))
        rho_h = 1.0 / (1.0 + self.kappa_local * max(0, steps - 1))
        e = 1.0
        per_step = max(1.0, update_samples / max(1, steps))
        if self.noise_scale is not None:
            e = (self.noise_scale + self.base_batch) / (self.noise_scale + per_step)
        if self.batch_exponent:
            e *= (self.base_batch / per_step) ** self.batch_exponent
        return rho_t * rho_h * e

    def worth(self, push: AppliedPush) -> float:
        """``push.samples`` × :meth:`factor` of its facts (× its ``weight`` when weighted)."""
        w = self.factor(push.staleness, push.steps, push.update_samples)
        if self.weighted:
            w *= max(0.0, push.weight)
        return push.samples * w


# Optimizer families (hetd.zoo.optim's names and the common adaptive ones) by how a stale or
# many-step update fares under them [D]; a family in neither keeps the class defaults.
ADAPTIVE = frozenset({"adam", "adamw", "adafactor", "adagrad", "lamb", "lion", "rmsprop"})
PLAIN = frozenset({"sgd", "momentum", "nesterov", "delayed_nesterov"})
# Plain SGD's model [D]: staleness and local steps nearly free. Evidence, simulator (one seed
# each, docs/policies.md §14): under SGD, samples to the target per policy against lbbsp's (fresh,
# one step) — asp (staleness about 3) 0.99, ashl on S1 1.07 and on S4 (tens of local steps over
# slow links) 1.0.
# The momentum forms keep it: the data did not show staleness or a push's weight costing more per
# unit under momentum (sim, 3 seeds, five heavy-ball and Nesterov clusters of our own, momentum
# 0.5 and 0.9, and two plain-SGD controls at the same lr / (1 - momentum);
# docs/results/2026-11-29-auto-momentum.md). lbbsp's samples to the target over ashl's were 1.32
# and 1.29 at momentum 0.9 against 1.27 and 1.24 in the controls, asp's 1.00 and 1.15 against 0.76
# and 1.19; ashl's over adsp's 1.11-1.43 where this model says 1.32-1.52 (ashl was the best fixed
# policy on all five). Kappas scaled by 1 / (1 - momentum) raised the squared log error over the
# eleven ratios of four clusters from 2.23 to 3.40, a weight counted as w^(1 - momentum) to 2.58.
# What momentum 0.9 did cost is hps's pipelined staleness: 0.52 and 0.54 of lbbsp's samples
# against 0.77 and 0.75 in the controls (this model: 0.97), where asp, staler in updates a quarter
# the size, lost nothing; a discount per version cannot tell the two apart, and the share of a
# full step each stale update makes is not in the facts this model sees [D, not built].
PLAIN_SGD = (0.02, 0.002)  # kappa_staleness, kappa_local
# Adam's model [D]: each update a step of about the learning rate whatever its batch, so a sample
# of an update of M samples is worth M^(-1/2) (the square-root rule: only the step's signal grows
# with M), and a gradient computed tau such steps ago is discounted at 0.8 a step; a local step
# costs nothing. Why: hps (pipelined lbbsp: every round one to two versions stale) needed 1.9x
# lbbsp's samples on peer_adam (sim, 3 seeds; without pipelining exactly lbbsp's), 2.1x with
# Adam's b1 = 0 (so not its momentum), where asp, three times as stale in updates of a quarter
# the samples, needed 1.5x: a per-update discount of staleness alone cannot order the two, the
# update's size must count. Fitted on the samples lbbsp needed over each policy's (sim, 3 seeds)
# on peer_adam and two Adam clusters of our own (six workers of slow-downs 1-6, three of 1-3):
# asp 0.66, 0.68, 0.83; ashl 0.74, 0.81, 0.83; adsp 0.72, 0.57, 0.74; hps 0.52 (peer_adam);
# this model at the first forecast gives 0.73, 0.66, 0.93; 0.74, 0.65, 0.85; 0.59, 0.50, 0.67;
# 0.56, where the model before it (staleness 0.1 a version, no size term) gave hps 0.90 and
# the squared log error summed over the ten was 0.38 against 0.14.
ADAM = (0.8, 0.0, 0.5)  # kappa_staleness, kappa_local, batch_exponent


def for_optimizer(spec: str | None) -> Efficiency:
    """The efficiency model for training with the optimizer ``spec`` (``name[:options]``; the
    workers' for local steps, which is the daemon's family unless set apart): plain SGD and its
    momentum forms barely discount staleness and local steps; under an adaptive optimizer (Adam)
    a sample of a large update is worth less and staleness costs far more (:data:`ADAM`); both
    count a push by its weight; a name not known (or none) keeps the class defaults. [D]"""
    name = (spec or "").partition(":")[0].strip().lower()
    if name in PLAIN:
        return Efficiency(kappa_staleness=PLAIN_SGD[0], kappa_local=PLAIN_SGD[1], weighted=True)
    if name in ADAPTIVE:
        return Efficiency(
            kappa_staleness=ADAM[0], kappa_local=ADAM[1], batch_exponent=ADAM[2], weighted=True
        )
    return Efficiency()


@dataclass(frozen=True, slots=True)
class NoiseScale:
    """The gradient noise scale ``φ = tr(Σ) / |G|²`` (McCandlish et al., 2018: the "simple"
    noise scale, in samples), estimated from pairs of gradients computed on the same parameters
    (two pushes at the same base version) from independent batches of ``b1`` and ``b2`` samples.

    For such a pair ``E[g1·g2] = |G|²`` and ``E|g1 − g2|² = tr(Σ)·(1/b1 + 1/b2)``: each pair gives
    an unbiased estimate of both, from three numbers the caller reduces the tensors to (the
    squared norms and the dot product, :meth:`add`). One pair's estimates are noisy (the dot
    product may be negative), so the two are averaged apart, with exponential forgetting
    (``decay`` per pair: the noise scale grows as training goes on), and ``φ`` is their ratio
    once ``min_pairs`` pairs came and the averaged signal is positive."""

    signal: float = 0.0  # |G|², averaged
    noise: float = 0.0  # tr(Σ), averaged
    weight: float = 0.0  # Σ of the forgetting weights of the pairs so far
    pairs: int = 0
    decay: float = 0.95  # each pair's weight against the next one's
    min_pairs: int = 4

    def __post_init__(self) -> None:
        if not 0.0 <= self.decay < 1.0:
            raise ValueError(f"decay must be in [0, 1), got {self.decay!r}")
        if not self.min_pairs >= 1:
            raise ValueError(f"min_pairs must be >= 1, got {self.min_pairs!r}")

    def add(self, sq1: float, sq2: float, dot: float, b1: int, b2: int) -> NoiseScale:
        """With one more pair: ``sq1 = |g1|²``, ``sq2 = |g2|²``, ``dot = g1·g2``, the gradients'
        batches ``b1`` and ``b2`` (samples; each gradient the mean over its batch). A pair that
        is not finite, or a batch below one sample, changes nothing."""
        if not (b1 >= 1 and b2 >= 1 and all(math.isfinite(x) for x in (sq1, sq2, dot))):
            return self
        diff = max(0.0, sq1 + sq2 - 2.0 * dot)
        noise = diff / (1.0 / b1 + 1.0 / b2)
        w = self.weight * self.decay
        total = w + 1.0
        return NoiseScale(
            (self.signal * w + dot) / total,
            (self.noise * w + noise) / total,
            total,
            self.pairs + 1,
            self.decay,
            self.min_pairs,
        )

    @property
    def value(self) -> float | None:
        """``φ`` in samples, or None before ``min_pairs`` pairs or while the averaged signal is
        not positive (the gradients' mean not told apart from their noise yet)."""
        if self.pairs < self.min_pairs or not self.signal > 0:
            return None
        return self.noise / self.signal


def effective_samples(applied: Iterable[AppliedPush], efficiency: Efficiency) -> float:
    """Σ :meth:`Efficiency.worth` over the applied pushes."""
    return sum(efficiency.worth(a) for a in applied)
