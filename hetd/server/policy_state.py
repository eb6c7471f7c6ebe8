"""A policy's state in a checkpoint: the tagged tree it is saved as, and how it comes back.

A policy state is saved as a tagged tree (:func:`state_tree`: its dataclasses, tuples and mappings
by type) with the engine clock it was taken at; a restore rebuilds it (:func:`from_state_tree`)
and moves its times to the new clock (:func:`shift_times`), so every built-in policy resumes where
it was, in the stage it was in. A state that is not a tree of those types falls back to flax's
state dict, or to None (the policy's ``init`` rebuilds it). :mod:`hetd.server.checkpoint` writes
and reads the files these trees go in.
"""

from __future__ import annotations

import dataclasses
import logging
import sys
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

import numpy as np
from flax import serialization

log = logging.getLogger("hetd.server.checkpoint")  # the checkpoint's own log lines, as before


def plain(tree: Any, copy: bool = True) -> Any:
    """A plain tree (str keys, lists) with host numpy leaves: copies, unless ``copy`` is False (the
    leaves are copies already: the file is written off the engine task, after its next steps)."""
    if isinstance(tree, Mapping):
        return {str(k): plain(v, copy) for k, v in tree.items()}
    if isinstance(tree, list | tuple):
        return [plain(v, copy) for v in tree]
    if hasattr(tree, "shape") and hasattr(tree, "dtype"):
        return np.array(tree, copy=True) if copy else np.asarray(tree)
    return tree


_WARNED: set[str] = set()  # policies whose unserialisable state was reported once


_TAG = "__hetd__"  # marks a node of a policy state tree (below): what the node was


def _qualname(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


def _class(name: str) -> type:
    """The class ``module:qualname`` names, from a module already imported (a checkpoint never
    makes us import anything); a dataclass or a named tuple, else ValueError."""
    module_name, _, qualname = name.partition(":")
    target: Any = sys.modules.get(module_name)
    if target is None:
        raise ValueError(f"class {name} is not loaded")
    for part in qualname.split("."):
        target = getattr(target, part, None)
    if not isinstance(target, type) or not (
        dataclasses.is_dataclass(target)
        or (issubclass(target, tuple) and hasattr(target, "_fields"))
    ):
        raise ValueError(f"{name} is not a dataclass or a named tuple")
    return target


def state_tree(state: Any) -> Any:
    """A policy state as a plain tree flax's msgpack writes: numbers, strings, None and numpy
    arrays as they are; dataclasses, named tuples, tuples, lists, sets and mappings (any keys) as
    maps tagged with what they were, so :func:`from_state_tree` gives the same types back.
    TypeError for anything else."""
    if state is None or isinstance(state, bool | int | float | str | bytes | np.ndarray):
        return state
    if dataclasses.is_dataclass(state) and not isinstance(state, type):
        fields = {f.name: state_tree(getattr(state, f.name)) for f in dataclasses.fields(state)}
        return {_TAG: "dataclass", "class": _qualname(type(state)), "fields": fields}
    if isinstance(state, tuple) and hasattr(type(state), "_fields"):
        items = [state_tree(x) for x in state]
        return {_TAG: "namedtuple", "class": _qualname(type(state)), "items": items}
    if isinstance(state, tuple | list | set | frozenset):
        return {_TAG: type(state).__name__, "items": [state_tree(x) for x in state]}
    if isinstance(state, Mapping):
        pairs = [[state_tree(k), state_tree(v)] for k, v in state.items()]
        return {_TAG: "mapping", "readonly": isinstance(state, MappingProxyType), "items": pairs}
    raise TypeError(f"a {type(state).__name__} in a policy state cannot be saved")


def from_state_tree(tree: Any) -> Any:
    """The policy state :func:`state_tree` made the tree of; ValueError or TypeError when it does
    not fit the classes loaded here (a changed policy version)."""
    if not isinstance(tree, dict):
        return tree
    kind = tree.get(_TAG)
    if kind == "dataclass":
        cls = _class(str(tree["class"]))
        values = {str(k): from_state_tree(v) for k, v in tree["fields"].items()}
        fields = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - set(fields))
        if unknown:
            raise TypeError(f"{cls.__name__} has no fields {unknown}")
        obj = cls(**{k: v for k, v in values.items() if fields[k].init})
        for k, v in values.items():
            if not fields[k].init:
                object.__setattr__(obj, k, v)
        return obj
    if kind == "namedtuple":
        return _class(str(tree["class"]))(*(from_state_tree(x) for x in tree["items"]))
    if kind in ("tuple", "list", "set", "frozenset"):
        items = [from_state_tree(x) for x in tree["items"]]
        return {"tuple": tuple, "list": list, "set": set, "frozenset": frozenset}[kind](items)
    if kind == "mapping":
        d = {from_state_tree(k): from_state_tree(v) for k, v in tree["items"]}
        return MappingProxyType(d) if tree.get("readonly") else d
    raise ValueError(f"not a policy state tree node: {sorted(map(str, tree))}")


def shift_times(state: Any, dt: float) -> Any:
    """A policy state with its engine-clock times moved by ``dt`` s: every object with a
    ``shifted(dt)`` method (the built-in policies' states) is replaced by what it returns, through
    tuples, lists and mappings (composed policies). A checkpoint keeps times relative to when it
    was taken: restored under a new process's clock, a time is as long before now as it was."""
    if dt == 0:
        return state
    shifted = getattr(state, "shifted", None)
    if callable(shifted) and not isinstance(state, type):
        return shifted(dt)
    if isinstance(state, tuple) and hasattr(type(state), "_fields"):
        return type(state)(*(shift_times(x, dt) for x in state))
    if isinstance(state, tuple | list):
        return type(state)(shift_times(x, dt) for x in state)
    if isinstance(state, MappingProxyType):
        return MappingProxyType({k: shift_times(v, dt) for k, v in state.items()})
    if isinstance(state, dict):
        return {k: shift_times(v, dt) for k, v in state.items()}
    return state


def policy_state_tree(name: str, state: Any) -> Any:
    """A policy's state as a msgpack-able tree (:func:`state_tree`; failing that, flax's state
    dict), or None (it is then rebuilt by init)."""
    try:
        tree = state_tree(state)
        serialization.msgpack_serialize({"s": tree})
    except Exception:
        pass
    else:
        return tree
    try:
        tree = plain(serialization.to_state_dict(state))
        serialization.msgpack_serialize({"s": tree})
    except Exception as exc:
        # flax serialises dicts, tuples, NamedTuples, arrays and flax.struct dataclasses; for any
        # other state, init(view) rebuilds a valid one from the restored clocks (as on a swap).
        if name not in _WARNED:
            _WARNED.add(name)
            log.warning(
                "policy %s: its state is not serialisable (%s); a restore rebuilds it with "
                "init(view)",
                name,
                exc,
            )
        return None
    return tree


def revive_policy_state(name: str, dt: float, fresh: Any, saved: Any) -> Any:
    """Policy ``name``'s saved state tree (:func:`state_tree`, or an older checkpoint's flax state
    dict with ``fresh``, its init's, as the template) as its own state, its engine-clock times
    moved by ``dt`` s (:func:`shift_times`); on any mismatch (a changed policy version)
    ``fresh``, with a warning."""
    try:
        if isinstance(saved, dict) and _TAG in saved:
            restored = shift_times(from_state_tree(saved), dt)
        elif fresh is None:
            return fresh
        else:
            restored = shift_times(serialization.from_state_dict(fresh, saved), dt)
        if type(restored) is not type(fresh):
            raise TypeError(f"{type(restored).__name__} is not {type(fresh).__name__}")
    except Exception as exc:  # a changed policy version: its init rebuilds a valid state
        log.warning("policy %s: saved state not restored (%s); rebuilt by init", name, exc)
        return fresh
    return restored
