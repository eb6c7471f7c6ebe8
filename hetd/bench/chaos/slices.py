"""The chaos run's last check with pservers: once the run's daemon has stopped (its last
checkpoint saved by every connected pserver), each pserver's newest saved slice against the head's
newest checkpoint, read from the run's state directory by the daemon's and the pservers' own
readers. A head that takes the whole push (:func:`slices_against_head`) has the parameters to
compare with; a head of headers (:func:`slices_of_headers`) has none, so its slices are checked
against its checkpoint's place in the log and against each other. Imported by :mod:`.suite`
alone: it reads the server's checkpoint files.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from hetd.protocol import pslink

if TYPE_CHECKING:
    from hetd.pserver.partition import PartitionMap


def check(state: Path, servers: int, headers: bool, config: Path) -> dict[str, Any]:
    """The check for the run's head: :func:`slices_of_headers` with ``headers``, else
    :func:`slices_against_head`."""
    if headers:
        return slices_of_headers(state, servers, config)
    return slices_against_head(state, servers)


def _newest(state: Path, servers: int) -> tuple[Any, dict[str, Any], Any, list[Any]] | str:
    """The head's newest checkpoint in ``state`` (its record, its tree, the log position it
    names) and each pserver's newest saved slice; or why they cannot be read."""
    # imported here: JAX comes with them, which a chaos run without pservers does not need
    from hetd.pserver import disk
    from hetd.server.checkpoint import load_newest

    found = load_newest(state)
    if found is None:
        return "the head wrote no checkpoint"
    info, head = found
    position = json.loads(str(head.get("decisions") or "{}")).get("position")
    saved = []
    for s in range(servers):
        newest = disk.listing(state / "pservers" / f"slice{s}")
        if not newest:
            return f"pserver {s} saved no slice"
        saved.append(disk.load(newest[0]).slice)
    return info, head, position, saved


def slices_against_head(state: Path, servers: int) -> dict[str, Any]:
    """The head's newest checkpoint in the state directory ``state`` against each pserver's newest
    saved slice: the same log position, the slices' parts covering every tensor exactly once
    (:func:`hetd.protocol.pslink.uncovered`), and each part equal to its rows of the checkpoint's
    parameters bit for bit. ``match`` says so; ``why``, what differs.
    Read after the daemon stopped (its last checkpoint saved by every connected pserver)."""
    read = _newest(state, servers)
    if isinstance(read, str):
        return {"match": False, "why": read}
    info, head, position, saved = read
    out: dict[str, Any] = {
        "head_version": info.version,
        "head_position": position,
        "slice_positions": [x.position for x in saved],
    }
    if out["slice_positions"] != [position] * servers:
        return {**out, "match": False, "why": "the slices were saved at other log positions"}
    params = {k: np.asarray(v) for k, v in head["params"].items()}
    shapes = {k: tuple(v.shape) for k, v in params.items()}
    parts: list[tuple[str, int, int, bool]] = []
    differ: set[str] = set()
    for tensors in (x.params for x in saved):
        for key, value in tensors.items():
            try:
                path, rows = pslink.read_part_key(key)
            except pslink.FrameError as exc:
                return {**out, "match": False, "why": str(exc)}
            if path not in params:
                return {**out, "match": False, "why": f"a part of no tensor of the head: {key!r}"}
            whole = params[path] if rows is None else params[path][rows[0] : rows[1]]
            first = params[path].shape[0] if params[path].shape else 1
            parts.append((path, *(rows or (0, first)), rows is None))
            if np.asarray(value).tobytes() != whole.tobytes() or np.shape(value) != whole.shape:
                differ.add(path)
    missing = pslink.uncovered(shapes, sorted(parts))
    if missing is not None:
        return {**out, "match": False, "why": f"the slices do not cover {missing!r} exactly once"}
    if differ:
        first_path = sorted(differ)[0]
        return {**out, "match": False, "why": f"{len(differ)} tensors differ, first {first_path!r}"}
    return {**out, "match": True, "tensors": len(params)}


def slices_of_headers(state: Path, servers: int, config: Path) -> dict[str, Any]:
    """A head of headers' newest checkpoint (no parameters) in the state directory ``state``
    against each pserver's newest saved slice: each at the checkpoint's log position and version,
    the slices joined by the model's partition map (the daemon's config ``config``: its model,
    optimizer and ``[pservers] servers``) into tensors of the model's shapes, every value finite,
    and every slice having consumed the same push of each worker (``done``: they carried out the
    same log). ``match`` says so; ``why``, what differs.
    Read after the daemon stopped (its last checkpoint saved by every connected pserver)."""
    from hetd.pserver import partition

    read = _newest(state, servers)
    if isinstance(read, str):
        return {"match": False, "why": read}
    info, head, position, saved = read
    if head.get("params"):
        return {"match": False, "why": "the head's checkpoint holds parameters"}
    out: dict[str, Any] = {
        "head_version": info.version,
        "head_position": position,
        "slice_positions": [x.position for x in saved],
        "slice_versions": [x.version for x in saved],
    }
    if out["slice_positions"] != [position] * servers:
        return {**out, "match": False, "why": "the slices were saved at other log positions"}
    if out["slice_versions"] != [info.version] * servers:
        return {**out, "match": False, "why": "the slices were saved at other versions"}
    if any(x.done != saved[0].done for x in saved):
        return {**out, "match": False, "why": "the slices consumed other pushes (done differs)"}
    try:
        pmap = partition_map(config)
        joined = partition.join(pmap, [x.params for x in saved])
    except ValueError as exc:
        return {**out, "match": False, "why": f"the slices do not join: {exc}"}
    extra = sorted({k for x in saved for k in x.params} - {p.key for p in pmap.parts})
    if extra:
        return {**out, "match": False, "why": f"a part of no tensor of the model: {extra[0]!r}"}
    bad = sorted(k for k, v in joined.items() if not np.isfinite(v).all())
    if bad:
        return {**out, "match": False, "why": f"{len(bad)} tensors not finite, first {bad[0]!r}"}
    return {**out, "match": True, "tensors": len(joined), "workers_done": len(saved[0].done)}


def partition_map(config: Path) -> PartitionMap:
    """The partition map the daemon of the config file ``config`` cuts its model with: the model's
    shapes (its task's ``init``, nothing computed) and optimizer planned over ``[pservers]
    servers``, as the daemon plans them at its start."""
    from hetd import config as config_mod
    from hetd.core.assemble import Optimizers
    from hetd.core.store import make_optimizer
    from hetd.pserver.separable import plan
    from hetd.zoo.bundled import zoo_task
    from hetd.zoo.task import Bound

    cfg = config_mod.load(config)
    t = cfg.train
    bound = Bound(zoo_task(config_mod.worker_setup(cfg)), seed=t.seed)
    spec = Optimizers.of(t, workers=max(1, t.global_batch // max(1, t.batch_size))).specs()[0]
    return plan(make_optimizer(spec), dict(bound.layout.shapes), cfg.pservers.servers)
