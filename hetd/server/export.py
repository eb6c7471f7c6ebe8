"""The trained model out of the daemon in formats the JAX ecosystem reads (``hetd export``,
``POST /v1/export``).

Checkpoints (:mod:`hetd.server.checkpoint`) stay our verified envelope: they are for resuming. An
export is for users, and needs nothing of ours to read:

* ``DIR`` is an orbax ``CheckpointManager`` directory, one step per exported version (step =
  version), each with three items: ``params`` (the model's parameters as flax nests them, restorable
  alone with ``StandardRestore``), ``opt_state`` (the daemon's optimizer state as a plain tree of
  arrays, ``flax.serialization.to_state_dict``'s form) and ``meta`` (JSON: model, data set, the
  config without its tokens, version, policy, samples seen);
* ``DIR/params.msgpack`` holds the newest exported params alone, readable with
  ``flax.serialization.msgpack_restore``.

:func:`capture` runs on the engine task (a consistent cut); :func:`write` runs in a thread.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from hetd.config import Config
    from hetd.core.engine import Engine

ITEMS = ("params", "opt_state", "meta")
PARAMS_FILE = "params.msgpack"


@dataclasses.dataclass(frozen=True)
class Captured:
    """What one export writes, copied off the engine."""

    params: dict[str, np.ndarray]  # flat, "/"-separated paths (the store's and the wire's names)
    opt_state: Any  # host pytree
    version: int
    policy: dict[str, Any]
    samples_seen: int
    updates_applied: int
    stage: str


def capture(engine: Engine) -> Captured:
    """The engine's params, optimizer state and facts at one version. Run on the engine task."""
    st = engine.state()
    return Captured(
        params={k: np.array(v, copy=True) for k, v in st.params.items()},
        opt_state=st.opt_state,
        version=st.version,
        policy=engine.policy.describe(),
        samples_seen=sum(int(w.samples) for w in st.workers.values()),
        updates_applied=st.updates_applied,
        stage=st.stage,
    )


def nested(params: Mapping[str, np.ndarray]) -> dict[str, Any]:
    """The flat ``a/b/c`` names as flax's nested dicts (what ``module.apply({"params": ...})``
    takes)."""
    tree: dict[str, Any] = {}
    for path, value in params.items():
        node = tree
        *parents, leaf = path.split("/")
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = value
    return tree


def _plain(tree: Any) -> Any:
    """A tree of str-keyed dicts and numpy leaves (orbax and JSON need no classes of ours)."""
    if isinstance(tree, Mapping):
        return {str(k): _plain(v) for k, v in tree.items()}
    if isinstance(tree, list | tuple):
        return {str(i): _plain(v) for i, v in enumerate(tree)}
    if hasattr(tree, "shape") and hasattr(tree, "dtype"):
        return np.asarray(tree)
    return tree


def public_config(cfg: Config) -> dict[str, Any]:
    """The config as JSON-able sections, without the tokens and the TLS key path."""
    out: dict[str, Any] = {}
    for field in dataclasses.fields(cfg):
        section = dataclasses.asdict(getattr(cfg, field.name))
        for secret in ("worker_token", "admin_token", "tls_key"):
            section.pop(secret, None)
        out[field.name] = section
    return out


def meta(state: Captured, cfg: Config) -> dict[str, Any]:
    """The ``meta`` item: what this model is and how it was trained."""
    t = cfg.train
    return {
        "format": "hetd-export",
        "format_version": 1,
        "created_unix": time.time(),
        "model": {"spec": t.model, "kwargs": dict(t.model_kwargs)},
        "dataset": {"spec": t.dataset, "kwargs": dict(t.dataset_kwargs), "seed": t.seed},
        "version": state.version,
        "policy": state.policy,
        "stage": state.stage,
        "samples_seen": state.samples_seen,
        "updates_applied": state.updates_applied,
        "param_paths": sorted(state.params),
        "config": public_config(cfg),
    }


def write(out: str | os.PathLike[str], state: Captured, cfg: Config) -> dict[str, Any]:
    """Write the orbax step ``state.version`` (unless that step is there already: same version,
    same params) and ``params.msgpack`` into ``out``; returns what was written."""
    import orbax.checkpoint as ocp
    from flax import serialization

    directory = Path(out).absolute()
    directory.mkdir(parents=True, exist_ok=True)
    params = nested(state.params)
    info = meta(state, cfg)
    options = ocp.CheckpointManagerOptions(create=True, enable_async_checkpointing=False)
    with ocp.CheckpointManager(directory, item_names=ITEMS, options=options) as manager:
        written = state.version not in manager.all_steps()
        if written:
            manager.save(
                state.version,
                args=ocp.args.Composite(
                    params=ocp.args.StandardSave(params),
                    opt_state=ocp.args.StandardSave(_plain(state.opt_state)),
                    meta=ocp.args.JsonSave(_json_safe(info)),
                ),
            )
            manager.wait_until_finished()
    blob = serialization.msgpack_serialize(params)
    tmp = directory / f".{PARAMS_FILE}.tmp"
    with open(tmp, "wb") as f:
        f.write(blob)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, directory / PARAMS_FILE)
    return {
        "dir": str(directory),
        "step": state.version,
        "version": state.version,
        "written": written,
        "items": list(ITEMS),
        "params_msgpack": str(directory / PARAMS_FILE),
        "params_msgpack_bytes": len(blob),
        "n_params": int(sum(v.size for v in state.params.values())),
        "samples_seen": state.samples_seen,
        "policy": state.policy,
    }


def _json_safe(value: Any) -> Any:
    """Tuples as lists, numpy scalars as numbers, anything else odd as its string."""
    if isinstance(value, Mapping):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_json_safe(v) for v in value]
    if isinstance(value, np.generic):
        return value.item()
    if value is None or isinstance(value, bool | int | float | str):
        return value
    return str(value)
