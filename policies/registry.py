"""Policy names: the registry of factories, its entry-point group, and building a policy by name.

Owns :func:`register` (built-in policies register at import), the entry-point group
``hetd.policies`` (other packages' factories, loaded on first use), :func:`policy_names`,
:func:`make_policy` and :class:`PolicyError`. A name is taken once: registering it again, or an
entry point with a name already taken, raises and says who holds it.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from importlib.metadata import EntryPoint, entry_points
from typing import Any

from policies.types import Policy

GROUP = "hetd.policies"  # the entry-point group other packages add policies to

Factory = Callable[..., Policy]
_REGISTRY: dict[str, Factory] = {}
_ENTRY_POINTS_LOADED = False


class PolicyError(ValueError):
    """An unknown policy name, parameters its factory does not accept, or a name taken twice."""


def _origin(factory: Factory) -> str:
    """Where a factory comes from, for clash messages: ``module.qualname``."""
    module = getattr(factory, "__module__", None) or "?"
    return f"{module}.{getattr(factory, '__qualname__', repr(factory))}"


def register(name: str) -> Callable[[Factory], Factory]:
    """Decorator: register a policy factory under ``name``; a name already taken raises
    :class:`PolicyError` naming both factories."""

    def deco(factory: Factory) -> Factory:
        old = _REGISTRY.get(name)
        if old is not None:
            raise PolicyError(
                f"policy name clash: {name!r} is registered by {_origin(old)}; "
                f"{_origin(factory)} cannot register it too"
            )
        _REGISTRY[name] = factory
        return factory

    return deco


def _load_entry_points() -> None:
    """Add the ``hetd.policies`` entry points to the registry, once. Any name clash (with a
    registered policy, or between two entry points) raises :class:`PolicyError` listing every
    clash, and nothing is added."""
    global _ENTRY_POINTS_LOADED
    if _ENTRY_POINTS_LOADED:
        return
    found: dict[str, EntryPoint] = {}
    clashes: list[str] = []
    for ep in entry_points(group=GROUP):
        seen = found.get(ep.name)
        if seen is not None:
            if seen.value != ep.value:  # the same one seen twice (two installs) is no clash
                clashes.append(f"{ep.name!r}: entry points {seen.value} and {ep.value}")
        elif ep.name in _REGISTRY:
            clashes.append(
                f"{ep.name!r}: registered {_origin(_REGISTRY[ep.name])} and entry point {ep.value}"
            )
        else:
            found[ep.name] = ep
    if clashes:
        raise PolicyError(
            f"policy name clash in the {GROUP!r} entry points: {'; '.join(clashes)} "
            "(each name may be taken once: rename the entry point)"
        )
    loaded = {name: ep.load() for name, ep in found.items()}
    _REGISTRY.update(loaded)
    _ENTRY_POINTS_LOADED = True


def policy_names() -> list[str]:
    """Every registered policy name, sorted."""
    _load_entry_points()
    return sorted(_REGISTRY)


def _unknown_params(name: str, factory: Factory, params: Mapping[str, Any]) -> str | None:
    """Why ``params`` do not fit ``factory``'s signature (unknown names, listing the valid ones),
    or None when they may (a factory taking ``**kwargs`` checks its own)."""
    try:
        sig = inspect.signature(factory)
    except (TypeError, ValueError):
        return None
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in sig.parameters.values()):
        return None
    valid = sorted(p.name for p in sig.parameters.values() if p.kind in kinds)
    unknown = sorted(str(k) for k in params if k not in valid)
    if not unknown:
        return None
    takes = f"valid parameters: {', '.join(valid)}" if valid else f"{name} takes no parameters"
    return f"unknown parameter(s) {', '.join(unknown)}; {takes}"


def make_policy(name: str, params: Mapping[str, Any] | None = None) -> Policy:
    """Build policy ``name`` with ``params``; errors say what is valid."""
    _load_entry_points()
    try:
        factory = _REGISTRY[name]
    except KeyError:
        raise PolicyError(
            f"unknown policy {name!r}; known policies: {', '.join(sorted(_REGISTRY))}"
        ) from None
    given = dict(params or {})
    why = _unknown_params(name, factory, given)
    if why is not None:
        raise PolicyError(f"policy {name!r}: {why}")
    try:
        return factory(**given)
    except TypeError as exc:
        raise PolicyError(f"policy {name!r}: bad parameters {given!r}: {exc}") from None
    except ValueError as exc:
        raise PolicyError(f"policy {name!r}: {exc}") from None
