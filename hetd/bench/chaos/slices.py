"""The chaos run's last check with pservers: once the run's daemon has stopped (its last
checkpoint saved by every connected pserver), each pserver's newest saved slice against the head's
newest checkpoint, read from the run's state directory by the daemon's and the pservers' own
readers. Imported by :mod:`.suite` alone: it reads the server's checkpoint files.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from hetd.protocol.pslink import BLOCK_MARK

if TYPE_CHECKING:
    from hetd.pserver.partition import PartitionMap


def slices_against_head(state: Path, servers: int) -> dict[str, Any]:
    """The head's newest checkpoint in the state directory ``state`` against each pserver's newest
    saved slice: the same log position, and the slices joined (:func:`hetd.pserver.partition.join`)
    equal to the checkpoint's parameters bit for bit. ``match`` says so; ``why``, what differs.
    Read after the daemon stopped (its last checkpoint saved by every connected pserver)."""
    # imported here: JAX comes with them, which a chaos run without pservers does not need
    from hetd.pserver import disk
    from hetd.pserver.partition import join
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
    try:
        joined = join(_map_of(params, [x.params for x in saved]), [x.params for x in saved])
    except ValueError as exc:
        return {**out, "match": False, "why": f"the slices do not make the model: {exc}"}
    differ = sorted(k for k, v in params.items() if joined[k].tobytes() != v.tobytes())
    if differ:
        return {**out, "match": False, "why": f"{len(differ)} tensors differ, first {differ[0]!r}"}
    return {**out, "match": True, "tensors": len(params)}


def _map_of(params: dict[str, Any], slices: list[dict[str, Any]]) -> PartitionMap:
    """The partition map the saved slices were cut by, read back from their parts' keys (a block
    is ``path#rows=start:stop``) and checked to cover the head's tensors exactly once."""
    from hetd.pserver.partition import FORMAT, PartitionMap

    parts = []
    for server, tensors in enumerate(slices):
        for key in tensors:
            if BLOCK_MARK in key:
                path, rows = key.rsplit(BLOCK_MARK, 1)
                start, stop = (int(x) for x in rows.split(":"))
                parts.append([path, start, stop, False, server])
            else:
                shape = params[key].shape if key in params else ()
                parts.append([key, 0, shape[0] if shape else 1, True, server])
    parts.sort(key=lambda p: (p[0], p[1]))
    return PartitionMap.from_dict(
        {
            "format": FORMAT,
            "servers": len(slices),
            "block_bytes": 0,
            "tensors": [[k, list(params[k].shape), params[k].dtype.name] for k in sorted(params)],
            "parts": parts,
        }
    )
