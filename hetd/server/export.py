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
  ``flax.serialization.msgpack_restore``;
* ``DIR/model.json`` says what ``params.msgpack`` holds, in plain JSON: the model (its spec and
  options, a Task's name), the data set, the version, and every parameter's path, shape and dtype
  (so a user builds the same layers, e.g. the hidden width of ``mlp``, without asking).

:func:`capture` runs on the engine task (a consistent cut); :func:`write` runs in a thread.

``DIR`` is a name under the export root (:func:`export_root`: ``[store] export_dir``, by default
the state directory's ``exports/``), never a path of the client's choosing: an absolute path,
``..`` or a symlinked component is refused with 400 (:mod:`hetd.server.safe_files`), and a daemon
with neither a state directory nor ``export_dir`` refuses exports (409). Files of ours are
written through exclusively created temp files (never through a link planted at their name), with
the umask's modes: an export holds parameters and the config without its secrets.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from hetd.server.safe_files import Refused, UnsafePath, under_root, write_atomic

if TYPE_CHECKING:
    from hetd.config import Config
    from hetd.core.engine import Engine

EXPORTS = "exports"  # the export root's name in the state directory
ITEMS = ("params", "opt_state", "meta")
PARAMS_FILE = "params.msgpack"
MODEL_FILE = "model.json"  # what PARAMS_FILE holds (:func:`describe`)


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
    model: dict[str, Any] = dataclasses.field(default_factory=dict)  # the welcome's description


def capture(engine: Engine) -> Captured:
    """The engine's params, optimizer state and facts at one version. Run on the engine task."""
    st = engine.state()
    return Captured(
        params={k: np.array(v, copy=True) for k, v in st.params.items()},
        opt_state=st.opt_state,
        version=st.version,
        policy=engine.host.policy.describe(),
        samples_seen=sum(int(w.samples) for w in st.workers.values()),
        updates_applied=st.updates_applied,
        stage=st.stage,
        model=dict(engine.config.welcome.get("model") or {}),
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


def describe(state: Captured, cfg: Config) -> dict[str, Any]:
    """``model.json``: what ``params.msgpack`` holds and how to read it, for a person or a
    script: the model, the data set, the version, each parameter's shape and dtype by its
    ``/``-joined path (flax's nesting: ``params["Dense_0"]["kernel"]``)."""
    t = cfg.train
    model = state.model or {"spec": t.model, "kwargs": dict(t.model_kwargs)}
    return {
        "format": "hetd-export-model",
        "format_version": 1,
        "model": model,
        "dataset": {"spec": t.dataset, "kwargs": dict(t.dataset_kwargs)}
        if not t.task
        else {"spec": "task"},
        "version": state.version,
        "n_params": int(sum(v.size for v in state.params.values())),
        "params": {
            path: {"shape": list(v.shape), "dtype": str(v.dtype)}
            for path, v in sorted(state.params.items())
        },
        "read_with": "flax.serialization.msgpack_restore(open('params.msgpack', 'rb').read()), "
        "then module.apply({'params': params}, x)",
    }


def export_root(cfg: Config) -> Path:
    """Where exports go: ``[store] export_dir``, else the state directory's ``exports/``;
    :class:`~hetd.server.safe_files.Refused` (409) when the daemon has neither."""
    if cfg.store.export_dir:
        return Path(cfg.store.export_dir).expanduser().absolute()
    if cfg.store.dir:
        return Path(cfg.store.dir).expanduser().absolute() / EXPORTS
    raise Refused(
        "this daemon has no export root: give it a state directory (hetd serve --state-dir, "
        "[store] dir; exports go to its exports/) or [store] export_dir",
        status=409,
        code="no_export_root",
    )


def target(cfg: Config, out: str) -> Path:
    """The directory ``out`` names under the export root, made; :class:`Refused` (400) for an
    absolute path, ``..`` or a symlinked component, naming the root."""
    root = export_root(cfg)
    try:
        return under_root(root, out)
    except UnsafePath as exc:
        raise UnsafePath(f"{exc}; exports go under {root}, give a name such as 'model'") from None


def write(out: str, state: Captured, cfg: Config) -> dict[str, Any]:
    """Write the orbax step ``state.version`` (unless that step is there already: same version,
    same params) and ``params.msgpack`` into ``out``, a name under the export root
    (:func:`target`); returns what was written, ``dir`` the directory's full path."""
    import orbax.checkpoint as ocp
    from flax import serialization

    directory = target(cfg, out)
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
    write_atomic(directory / PARAMS_FILE, blob)
    described = json.dumps(_json_safe(describe(state, cfg)), indent=2, sort_keys=True)
    write_atomic(directory / MODEL_FILE, described.encode() + b"\n")
    return {
        "dir": str(directory),
        "step": state.version,
        "version": state.version,
        "written": written,
        "items": list(ITEMS),
        "params_msgpack": str(directory / PARAMS_FILE),
        "params_msgpack_bytes": len(blob),
        "model_json": str(directory / MODEL_FILE),
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
