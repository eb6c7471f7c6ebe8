"""The chaos run's last check with pservers: once the run's daemon has stopped (its last
checkpoint saved by every connected pserver), each pserver's newest saved slice against the head's
newest checkpoint, read from the run's state directory by the daemon's and the pservers' own
readers. Imported by :mod:`.suite` alone: it reads the server's checkpoint files.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from hetd.protocol import pslink


def slices_against_head(state: Path, servers: int) -> dict[str, Any]:
    """The head's newest checkpoint in the state directory ``state`` against each pserver's newest
    saved slice: the same log position, the slices' parts covering every tensor exactly once
    (:func:`hetd.protocol.pslink.uncovered`), and each part equal to its rows of the checkpoint's
    parameters bit for bit. ``match`` says so; ``why``, what differs.
    Read after the daemon stopped (its last checkpoint saved by every connected pserver)."""
    # imported here: JAX comes with them, which a chaos run without pservers does not need
    from hetd.pserver import disk
    from hetd.server.checkpoint import load_newest

    found = load_newest(state)
    if found is None:
        return {"match": False, "why": "the head wrote no checkpoint"}
    info, head = found
    position = json.loads(str(head.get("decisions") or "{}")).get("position")
    saved = []
    for s in range(servers):
        newest = disk.listing(state / "pservers" / f"slice{s}")
        if not newest:
            return {"match": False, "why": f"pserver {s} saved no slice"}
        saved.append(disk.load(newest[0]).slice)
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
