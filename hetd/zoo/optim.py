"""Optimizers by name, for the three places that train: the daemon's gradient optimizer, the
workers' inner optimizer for local steps, and the daemon's outer optimizer for their deltas.

A spec is ``name`` or ``name:key=value,key=value`` (``"adam"``, ``"nesterov:lr=0.7,momentum=0.9"``).
Names: ``sgd``, ``momentum`` (heavy ball, 0.9), ``nesterov`` (0.9) and ``adam``; keys: ``lr``,
``momentum`` (sgd family), ``b1``, ``b2``, ``eps`` (adam). A spec without ``lr`` takes the learning
rate the caller passes (the config's), so ``inner_optimizer = "adam"`` follows ``lr``.
``delayed_nesterov`` (keys ``lr``, ``momentum``, ``period``) is an outer optimizer only
(:mod:`hetd.zoo.outer`): the momentum moves once per ``period`` deltas, for ``diloco_async``.

Local-step training in the style of DiLoCo: each worker runs ``inner`` for its local steps, keeping
the inner state across rounds, and pushes ``Δ = θ_end − θ_start``; the daemon feeds the
pseudo-gradient ``−Δ`` to ``outer``. ``sgd`` at lr 1.0, the default outer optimizer, adds Δ as it is
(plain averaging with the policy's weight).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # optax (and JAX under it) loads when a transformation is built, not when a
    import optax  # config is checked: the daemon listens before it imports JAX


NAMES = ("sgd", "momentum", "nesterov", "adam", "delayed_nesterov")
_KEYS = {
    "sgd": {"lr", "momentum"},
    "momentum": {"lr", "momentum"},
    "nesterov": {"lr", "momentum"},
    "adam": {"lr", "b1", "b2", "eps"},
    "delayed_nesterov": {"lr", "momentum", "period"},  # outer only (hetd.zoo.outer)
}
_DEFAULT_MOMENTUM = {"sgd": 0.0, "momentum": 0.9, "nesterov": 0.9}


@dataclass(frozen=True, slots=True)
class OptimizerSpec:
    """A parsed optimizer spec; ``lr`` None means "the learning rate the caller gives"."""

    name: str
    lr: float | None = None
    options: tuple[tuple[str, float], ...] = field(default=())

    def with_default_lr(self, lr: float) -> OptimizerSpec:
        """This spec, its learning rate filled in with ``lr`` when it names none."""
        return self if self.lr is not None else OptimizerSpec(self.name, lr, self.options)

    def build(self, lr: float | None = None) -> optax.GradientTransformation:
        """The optax transformation (``lr``: used when the spec names no learning rate)."""
        import optax

        rate = self.lr if self.lr is not None else lr
        if rate is None:
            raise ValueError(f"optimizer {self.name!r} needs a learning rate")
        opts = dict(self.options)
        if self.name == "delayed_nesterov":
            from hetd.zoo.outer import delayed_nesterov

            period = int(opts.get("period", 1.0))  # an integer >= 1: parse_optimizer checked
            return delayed_nesterov(rate, opts.get("momentum", 0.9), period)
        if self.name == "adam":
            return optax.adam(
                rate, b1=opts.get("b1", 0.9), b2=opts.get("b2", 0.999), eps=opts.get("eps", 1e-8)
            )
        momentum = opts.get("momentum", _DEFAULT_MOMENTUM[self.name])
        return optax.sgd(
            rate, momentum=momentum or None, nesterov=self.name == "nesterov" and momentum > 0
        )

    def injectable(self) -> optax.GradientTransformation:
        """The transformation with its learning rate as an injected hyperparameter
        (``state.hyperparams["learning_rate"]``), so one compiled step serves any rate."""
        import optax

        opts = dict(self.options)
        if self.name == "delayed_nesterov":
            raise ValueError("delayed_nesterov is an outer optimizer; local steps cannot use it")
        if self.name == "adam":
            return optax.inject_hyperparams(optax.adam)(
                learning_rate=self.lr,
                b1=opts.get("b1", 0.9),
                b2=opts.get("b2", 0.999),
                eps=opts.get("eps", 1e-8),
            )
        momentum = opts.get("momentum", _DEFAULT_MOMENTUM[self.name])
        return optax.inject_hyperparams(optax.sgd, static_args=("momentum", "nesterov"))(
            learning_rate=self.lr,
            momentum=momentum or None,
            nesterov=self.name == "nesterov" and momentum > 0,
        )

    @property
    def plain_sgd(self) -> bool:
        """Whether this is SGD without momentum (no optimizer state at all)."""
        return self.name == "sgd" and not dict(self.options).get("momentum")

    def without_lr(self) -> OptimizerSpec:
        """The same family and options, the learning rate left open."""
        return OptimizerSpec(self.name, None, self.options)

    def __str__(self) -> str:
        parts = ([f"lr={self.lr:g}"] if self.lr is not None else []) + [
            f"{k}={v:g}" for k, v in self.options
        ]
        return self.name + (":" + ",".join(parts) if parts else "")


def parse_optimizer(spec: str) -> OptimizerSpec:
    """Parse ``name[:key=value,...]``; a bad spec raises ValueError naming what is valid."""
    name, _, rest = spec.strip().partition(":")
    name = name.strip()
    if name not in NAMES:
        raise ValueError(f"unknown optimizer {name!r}; known: {', '.join(NAMES)}")
    lr: float | None = None
    options: list[tuple[str, float]] = []
    for item in filter(None, (p.strip() for p in rest.split(","))):
        key, eq, text = item.partition("=")
        key = key.strip()
        if not eq or key not in _KEYS[name]:
            raise ValueError(
                f"optimizer {spec!r}: bad option {item!r}; {name} takes "
                + ", ".join(f"{k}=NUMBER" for k in sorted(_KEYS[name]))
            )
        try:
            value = float(text)
        except ValueError:
            raise ValueError(f"optimizer {spec!r}: {key} must be a number, got {text!r}") from None
        if not math.isfinite(value) or value < 0 or (key == "lr" and value == 0):
            raise ValueError(f"optimizer {spec!r}: {key} must be finite and positive")
        if key == "lr":
            lr = value
        else:
            options.append((key, value))
    period = dict(options).get("period", 1.0)
    if period != int(period) or period < 1:
        raise ValueError(f"optimizer {spec!r}: period must be an integer >= 1, got {period:g}")
    return OptimizerSpec(name, lr, tuple(sorted(options)))


def make_optimizer(spec: str, lr: float | None = None) -> optax.GradientTransformation:
    """The optax transformation for a spec (``lr``: the rate when the spec names none)."""
    return parse_optimizer(spec).build(lr)
