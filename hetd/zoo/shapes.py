"""A block-structured model's blocks (parameters ``b00/...``, ``b01/...``) read from its shapes
alone: what the planners, the simulator's worker and a worker emulating a small memory count.
Pure and light (no JAX), so a worker's command line can use it."""

from __future__ import annotations

import math
from collections.abc import Mapping


def block_facts(shapes: Mapping[str, tuple[int, ...]]) -> tuple[tuple[float, float, float], ...]:
    """A block-structured model's blocks (parameters ``b00/...``, ``b01/...``) as planners see
    them: (parameter bytes, output bytes per sample, relative compute per sample); empty for any
    other model. Estimates from the shapes alone: a block's output is as wide as its last
    one-dimensional parameter (a dense layer's bias), its compute is its parameter count."""
    blocks: dict[str, list[tuple[int, ...]]] = {}
    for path, shape in shapes.items():
        head, _, _ = path.partition("/")
        if not (len(head) == 3 and head[0] == "b" and head[1:].isdigit()):
            return ()
        blocks.setdefault(head, []).append(tuple(shape))
    names = sorted(blocks)
    if names != [f"b{j:02d}" for j in range(len(names))]:
        return ()
    out = []
    for name in names:
        params = sum(math.prod(s) for s in blocks[name])
        width = next((s[0] for s in reversed(blocks[name]) if len(s) == 1), 1)
        out.append((4.0 * params, 4.0 * width, float(params)))
    return tuple(out)
