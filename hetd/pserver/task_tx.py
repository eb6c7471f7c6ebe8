"""A Task's own optimizer run slice by slice, on the user's own tree.

The daemon runs a Task's optimizer on the user's tree, rebuilt from the flat map at each call
(:meth:`hetd.zoo.task.Bound.flat_optimizer`), so that masks, labels and per-parameter schedules
written for that structure apply. A slice holds only some tensors, and only some rows of the big
ones, so that wrapper cannot rebuild the tree from it. :func:`on_tree` can: it calls the
optimizer on the whole tree, each tensor the slice holds in its place and every other one an
empty stand-in of the same number of dimensions (no values, so no work); a slice that holds
several blocks of one tensor makes one such call per block (a *round*), each with its own
optimizer state. A mask that reads a leaf's ``ndim`` or its place in the tree sees what it sees
on the whole model; an elementwise optimizer then computes each value as the single store does,
bit for bit.

An optimizer is made per slice: :data:`SliceOptimizer` is ``(partition map, pserver) ->
optax.GradientTransformation``; :func:`plain` is one that ignores the map (the config's
optimizers, which already see flat maps).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax.numpy as jnp
import optax

from hetd.pserver.partition import Part, PartitionMap
from hetd.zoo.trees import Layout

SliceOptimizer = Callable[[PartitionMap, int], optax.GradientTransformation]


def plain(tx: optax.GradientTransformation) -> SliceOptimizer:
    """``tx`` itself for every slice (it reads any flat map as it comes)."""
    return lambda pmap, server: tx


def on_tree(layout: Layout, tx: optax.GradientTransformation) -> SliceOptimizer:
    """``tx`` (a Task's own, written for the tree ``layout`` describes) for each slice, on the
    user's tree with stand-ins for what the slice does not hold."""

    def make(pmap: PartitionMap, server: int) -> optax.GradientTransformation:
        if set(pmap.shapes) != set(layout.names):
            raise ValueError("the partition map's tensors are not the task's parameters")
        return _slice_tx(layout, tx, _rounds(pmap.of(server)), pmap.shapes)

    return make


def _rounds(parts: tuple[Part, ...]) -> list[dict[str, str]]:
    """The slice's parts in rounds of at most one part per tensor: ``path -> part key``."""
    rounds: list[dict[str, str]] = []
    seen: dict[str, int] = {}
    for p in parts:
        r = seen.get(p.path, 0)
        seen[p.path] = r + 1
        if r == len(rounds):
            rounds.append({})
        rounds[r][p.path] = p.key
    return rounds


def _slice_tx(
    layout: Layout,
    tx: optax.GradientTransformation,
    rounds: list[dict[str, str]],
    shapes: Mapping[str, tuple[int, ...]],
) -> optax.GradientTransformation:
    def fill(flat: Mapping[str, Any], held: Mapping[str, str]) -> Any:
        """The user's tree: the round's parts in place, empty stand-ins elsewhere."""
        leaves = {
            path: flat[held[path]] if path in held else _stand_in(shapes[path], flat)
            for path in layout.names
        }
        return layout.unflatten(leaves)

    def init_fn(params: Any) -> Any:
        return tuple(tx.init(fill(params, held)) for held in rounds)

    def update_fn(updates: Any, state: Any, params: Any = None) -> tuple[Any, Any]:
        out: dict[str, Any] = {}
        states = []
        for held, s in zip(rounds, state, strict=True):
            tree_params = None if params is None else fill(params, held)
            new, s = tx.update(fill(updates, held), s, tree_params)
            flat = layout.flatten(new)
            out.update({key: flat[path] for path, key in held.items()})
            states.append(s)
        return out, tuple(states)

    return optax.GradientTransformation(init_fn, update_fn)


def _stand_in(shape: tuple[int, ...], flat: Mapping[str, Any]) -> Any:
    """No values with ``shape``'s number of dimensions (a scalar: one zero, whose update is
    thrown away), in the slice's dtype."""
    dtype = next(iter(flat.values())).dtype if flat else jnp.float32
    return jnp.zeros((0, *shape[1:]) if shape else (), dtype)
