"""What a worker may import: only what its own operator named. The daemon's welcome (and its
``/v1/prepare``) says which model and data set it trains; a worker compares those specs with its
own and never imports a ``pkg.module:attr`` plug-in because the daemon named it. Otherwise a
spoofed daemon, or a man in the middle on ``ws://``, would run code of its choosing on every
worker (``subprocess:getoutput`` called with the daemon's options).

Always allowed (bundled): the zoo's registered names (``mlp``, ``cnn``, ``transformer``;
``digits``, ``mnist5k``, ``mnist``, ``synthetic``, ``pydoc``: looked up in a table, nothing
imported) and the plug-in specs in :data:`BUNDLED_PLUGINS`. No other ``hetd.*`` spec is: the
package holds callables (the command line's ``main``, the process launchers) that a daemon must
not get to call with options of its choosing.

A plug-in needs the operator's word: ``hetd-worker --model SPEC`` / ``--dataset SPEC`` (or
``[worker] model`` / ``dataset`` in ``--config``). The daemon's spec must then be exactly that one,
bundled names included: a worker started with ``--model`` trains that model or none.
"""

from __future__ import annotations

import shlex
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

BUNDLED_PLUGINS: frozenset[str] = frozenset({"hetd.zoo.blocks:mlp_model"})
"""Plug-in specs shipped in ``hetd`` itself that any worker builds without being told to."""

MAX_SHOWN = 200  # characters of a daemon's spec repeated in a message


class ImportRefused(ValueError):
    """The daemon names a model or data set this worker's operator did not allow."""


@dataclass(frozen=True, slots=True)
class Allowed:
    """The model and data set specs this worker's operator named (None: bundled ones only)."""

    model: str | None = None
    dataset: str | None = None


def is_bundled(spec: str) -> bool:
    """Whether ``spec`` is a registered name or a bundled plug-in (nothing outside ``hetd``)."""
    return ":" not in spec or spec in BUNDLED_PLUGINS


def operator_flags(model: str, dataset: str) -> list[str]:
    """The ``hetd-worker`` flags by which a launcher that named ``model`` and ``dataset`` itself
    (``hetd demo``, ``hetd bench --mode real``) lets its own workers build them: none for bundled
    ones."""
    flags: list[str] = []
    for flag, spec in (("--model", model), ("--dataset", dataset)):
        if not is_bundled(spec):
            flags += [flag, spec]
    return flags


def _shown(spec: object) -> str:
    text = repr(spec)
    return text if len(text) <= MAX_SHOWN else text[:MAX_SHOWN] + "..."


def _as_flag(spec: str) -> str:
    """``spec`` as the operator would type it after the flag (quoted for a shell if need be)."""
    if len(spec) > MAX_SHOWN or not spec.isprintable():
        return _shown(spec)
    return shlex.quote(spec)


def check_imports(setup: Mapping[str, Any], allowed: Allowed | None) -> None:
    """Raise :class:`ImportRefused` unless the setup's model and data set are ones this worker
    may build: bundled, or exactly what its operator named. Called before anything is imported."""
    allowed = allowed or Allowed()
    for part, flag, own in (
        ("model", "--model", allowed.model),
        ("dataset", "--dataset", allowed.dataset),
    ):
        what = "model" if part == "model" else "data set"
        spec = (setup.get(part) or {}).get("spec")
        if not isinstance(spec, str) or not spec:
            raise ImportRefused(f"the daemon names no usable {what} (got {_shown(spec)})")
        if own is not None:
            if spec != own:
                raise ImportRefused(
                    f"the daemon trains the {what} {_shown(spec)} but this worker was started "
                    f"with {flag} {own}: start it with {flag} {_as_flag(spec)} if you trust "
                    "that code, or point it at the daemon it was meant for"
                )
            continue
        if not is_bundled(spec):
            raise ImportRefused(
                f"the daemon trains the plug-in {what} {_shown(spec)}, which this worker was not "
                f"told to import: start it with {flag} {_as_flag(spec)} if you trust that "
                "code (a worker imports only what its own command line or config names)"
            )
