"""A user's parameter pytree as the flat ``path -> array`` map the wire, the codecs and the store
address, and back.

The wire names each tensor by a ``/``-separated path; a Task's parameters may be any pytree (nested
dicts, lists, ``nnx.State`` turned pure, a NamedTuple). :class:`Layout` records the tree's
structure once (from ``init``'s result) and maps both ways: a dict key, a list index or an
attribute name each become one path segment, so ``{"dense": {"kernel": w}}`` is ``dense/kernel``
and ``[w0, w1]`` is ``0`` and ``1``. The leaves' order is JAX's, so ``unflatten(flatten(t))`` is
``t`` with the same structure.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np


def _segment(key: Any) -> str:
    """One path segment of a JAX key entry (DictKey, SequenceKey, GetAttrKey, FlattenedIndexKey)."""
    for attr in ("key", "idx", "name"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


class Layout:
    """The structure of one parameter pytree: its leaves' paths, shapes and tree definition."""

    def __init__(self, tree: Any) -> None:
        """``tree``: a pytree of arrays (``init``'s result). ValueError if two leaves get the same
        path, a leaf is not a floating-point array, or there is no leaf at all."""
        leaves, treedef = jax.tree_util.tree_flatten_with_path(tree)
        self.treedef: Any = treedef
        if not leaves:
            raise ValueError("the parameters have no arrays (init returned an empty tree)")
        names: list[str] = []
        shapes: dict[str, tuple[int, ...]] = {}
        for path, leaf in leaves:
            name = "/".join(_segment(k) for k in path) or "param"
            if name in shapes:
                raise ValueError(f"two parameters share the path {name!r}; rename one")
            dtype = np.dtype(getattr(leaf, "dtype", np.asarray(leaf).dtype))
            if not np.issubdtype(dtype, np.floating):
                raise ValueError(
                    f"parameter {name!r} is {dtype}, not a floating-point array: hetd trains "
                    "float parameters only (keep integer state, such as step counters, outside "
                    "init's tree)"
                )
            names.append(name)
            shapes[name] = tuple(int(d) for d in np.shape(leaf))
        self.names: tuple[str, ...] = tuple(names)
        self.shapes: Mapping[str, tuple[int, ...]] = shapes

    def flatten(self, tree: Any) -> dict[str, Any]:
        """``tree`` (this layout's structure) as ``{path: leaf}``."""
        leaves = self.treedef.flatten_up_to(tree)
        return dict(zip(self.names, leaves, strict=True))

    def unflatten(self, flat: Mapping[str, Any]) -> Any:
        """``{path: leaf}`` back into the user's structure."""
        return self.treedef.unflatten([flat[name] for name in self.names])

    @property
    def size(self) -> int:
        """Number of scalar parameters."""
        return sum(int(np.prod(s)) for s in self.shapes.values())

    def fingerprint(self, name: str) -> str:
        """A short hash of a task's name and its parameters' paths and shapes: two processes
        that disagree on it would train different models."""
        blob = json.dumps([name, sorted((k, list(v)) for k, v in self.shapes.items())])
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


def shape_diff(
    ours: Mapping[str, Sequence[int]], theirs: Mapping[str, Sequence[int]], limit: int = 3
) -> str:
    """The first few differences between two ``{path: shape}`` maps, in words."""
    out: list[str] = []
    for path in sorted(set(ours) | set(theirs)):
        a, b = ours.get(path), theirs.get(path)
        if a is None:
            out.append(f"{path} only theirs")
        elif b is None:
            out.append(f"{path} only ours")
        elif tuple(a) != tuple(b):
            out.append(f"{path} {tuple(a)} against {tuple(b)}")
    more = f" and {len(out) - limit} more" if len(out) > limit else ""
    return ", ".join(out[:limit]) + more if out else "none"
