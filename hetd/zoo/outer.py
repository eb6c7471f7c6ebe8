"""Outer optimizers of our own for asynchronous local SGD (docs/policies.md §13).

Owns :func:`delayed_nesterov`, an optax ``GradientTransformation``. Asynchronous DiLoCo applies one
worker's pseudo-gradient at a time; a Nesterov momentum stepped on each of them would take N
momentum steps per round of N workers, each on a fraction of the round. Delayed Nesterov (Liu et
al. 2024) keeps the momentum still between arrivals and steps it once per ``period`` arrivals, on
their sum. With ``period`` = N and each input already scaled by ``1/N`` (the policy's weight), one
round of N arrivals moves the parameters exactly as one synchronous Nesterov step on their mean:
``m ← μ·m + Σg``, ``θ ← θ − lr·(Σg + μ·m)``.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax


class DelayedNesterovState(NamedTuple):
    """The momentum ``m``, the inputs buffered since it last moved ``b``, and the arrivals
    counted modulo the period."""

    arrivals: jax.Array  # int32 scalar, counted modulo the period
    momentum: Any  # pytree like the parameters
    buffer: Any


def delayed_nesterov(lr: float, momentum: float, period: int) -> optax.GradientTransformation:
    """Each update ``g`` (a weighted pseudo-gradient) takes a plain step ``−lr·g`` and joins the
    buffer; every ``period``-th update also moves the momentum, ``m ← μ·m + b``, adds the Nesterov
    look-ahead ``−lr·μ·m`` and empties the buffer."""
    if not lr > 0 or not 0 <= momentum < 1:
        raise ValueError(
            f"delayed_nesterov needs lr > 0 and 0 <= momentum < 1, got {lr}, {momentum}"
        )
    if not isinstance(period, int) or period < 1:
        raise ValueError(f"delayed_nesterov needs an int period >= 1, got {period!r}")

    def init(params: Any) -> DelayedNesterovState:
        def zeros() -> Any:  # two trees: the store donates the state's buffers, each once
            return jax.tree.map(lambda p: jnp.zeros_like(p, jnp.float32), params)

        return DelayedNesterovState(jnp.zeros((), jnp.int32), zeros(), zeros())

    def update(
        updates: Any, state: DelayedNesterovState, params: Any = None
    ) -> tuple[Any, DelayedNesterovState]:
        del params
        count = state.arrivals + 1
        fire = count >= period
        buffer = jax.tree.map(lambda b, g: b + g, state.buffer, updates)
        mom = jax.tree.map(
            lambda m, b: jnp.where(fire, momentum * m + b, m), state.momentum, buffer
        )
        out = jax.tree.map(
            lambda g, m: -lr * (g + jnp.where(fire, momentum * m, jnp.zeros_like(m))), updates, mom
        )
        buffer = jax.tree.map(lambda b: jnp.where(fire, jnp.zeros_like(b), b), buffer)
        return out, DelayedNesterovState(jnp.where(fire, 0, count), mom, buffer)

    return optax.GradientTransformation(init, update)
