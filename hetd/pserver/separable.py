"""Which optimizers S pservers can apply slice by slice, and how the model must then be cut.

A pserver runs the optimizer on its own slice only. That gives the single store's result when the
optimizer's update of each value depends on that value (and its own state) alone: SGD, momentum,
Adam, AdamW, elementwise clipping, schedules. Some transforms read more:

* **a whole tensor** (a trust ratio per tensor as in LAMB, factored second moments as in
  Adafactor, an orthogonalized matrix): whole tensors are still fine, row blocks are not, so such
  an optimizer gets a map of whole tensors (``block_bytes = 0``);
* **the whole tree** (``optax.clip_by_global_norm``, anything scaled by a global norm): the
  update of one part depends on parts other pservers hold. These are **refused** for S > 1 with
  :class:`NotSliceable`, saying why and what to use instead.

A Task's own optimizer, which the daemon runs on the user's whole tree, is probed as
:func:`hetd.pserver.task_tx.on_tree` runs it on a slice, and sorted by what it computes.

Why refuse rather than reduce in two phases (each pserver reports a partial sum, the head combines
and sends the result back): an optax transformation is a pair of opaque functions, so nothing
says which quantity a transform reduces, or where in a chain it does; a two-phase step needs that
structure, so it can only be built for named transforms (``clip_by_global_norm`` at the head of a
chain: the factor ``min(1, c / ‖g‖)``, computed by the head from the squared norms of a push's
parts that the pservers would report with the part, and carried in the apply entry). That step
would not be bit-for-bit the single store's (a sum taken in another order), so it needs its own
tolerance and tests and is left for when a user needs it; a refusal now is clear, where a
silently different optimizer would not be.

There is no way to read a transform's kind off its functions, so :func:`probe` *measures* it: it
runs the optimizer for two steps on a miniature of the model (the same paths and numbers of
dimensions, each dimension at most ``cap``), once whole and once cut into slices, with gradients
whose magnitudes differ by orders between tensors (so a global norm's clip bites), and compares.
A probe is evidence, not proof: a transform that behaves differently only above the miniature's
sizes, or only for values the probe did not draw, can pass it.
"""

from __future__ import annotations

import enum
import itertools
import math
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np
import optax

from hetd.pserver.partition import BLOCK_BYTES, Part, PartitionMap, join, partition, split
from hetd.pserver.task_tx import SliceOptimizer, plain

CAP = 160  # the miniature's largest dimension (above optax's factoring threshold of 128)
MAX_ELEMENTS = 2_000_000  # the miniature's size; the cap shrinks to fit
PROBE_SERVERS = 3


class Sliceable(enum.Enum):
    """How far an optimizer can be cut."""

    ELEMENTWISE = "elementwise"  # any slice, row blocks included
    PER_TENSOR = "per_tensor"  # whole tensors only
    WHOLE_TREE = "whole_tree"  # not at all (one pserver)


class Probe(NamedTuple):
    """What :func:`probe` found, and in words why."""

    kind: Sliceable
    reason: str


class NotSliceable(ValueError):
    """The optimizer cannot be applied slice by slice under this partition map."""


def probe(
    tx: optax.GradientTransformation | SliceOptimizer, shapes: Mapping[str, Sequence[int]]
) -> Probe:
    """How far ``tx`` can be cut, measured on a miniature of a model of ``shapes``. ``tx`` is an
    optimizer on flat maps, or one made per slice (a Task's own, :func:`hetd.pserver.task_tx.on_tree`)."""
    make = plain(tx) if isinstance(tx, optax.GradientTransformation) else tx
    mini = _miniature({k: tuple(int(d) for d in s) for k, s in shapes.items()})
    rng = np.random.default_rng(0)
    params = {k: np.asarray(rng.standard_normal(s), np.float32) for k, s in mini.items()}
    grads = []
    for _ in range(2):
        mags = {k: np.float32(10.0 ** rng.uniform(-2, 4)) for k in mini}
        grads.append(
            {k: np.asarray(mags[k] * rng.standard_normal(s), np.float32) for k, s in mini.items()}
        )
    want = _run(make(_whole_map(mini), 0), params, grads)
    blocks = _same(make, params, grads, want, _probe_map(mini, blocks=True))
    if blocks is None:
        return Probe(Sliceable.ELEMENTWISE, "each value's update depends on that value alone")
    whole = _same(make, params, grads, want, _probe_map(mini, blocks=False))
    if whole is None:
        return Probe(Sliceable.PER_TENSOR, f"it reads whole tensors: row blocks {blocks}")
    return Probe(Sliceable.WHOLE_TREE, f"it reads across tensors: whole tensors {whole}")


def plan(
    tx: optax.GradientTransformation | SliceOptimizer,
    shapes: Mapping[str, Sequence[int]],
    servers: int,
    *,
    dtypes: Mapping[str, str] | None = None,
    block_bytes: int = BLOCK_BYTES,
) -> PartitionMap:
    """The partition map ``servers`` pservers can apply ``tx`` under: probed, cut as far as the
    optimizer allows (whole tensors for one that reads whole tensors) and checked;
    :class:`NotSliceable` when no map will do. One pserver keeps every tensor whole and is not
    probed: its slice is the whole model, as the single store holds it."""
    if servers == 1:
        return partition(shapes, 1, dtypes=dtypes, block_bytes=0)
    found = probe(tx, shapes)
    pmap = partition(
        shapes, servers, dtypes=dtypes, block_bytes=block_bytes_for(found, block_bytes)
    )
    require(found, pmap)
    return pmap


def block_bytes_for(found: Probe, block_bytes: int) -> int:
    """The block size a map for this optimizer may use (0: whole tensors only)."""
    return block_bytes if found.kind is Sliceable.ELEMENTWISE else 0


def require(found: Probe, pmap: PartitionMap) -> None:
    """Raise :class:`NotSliceable`, saying why and what to do, unless an optimizer ``found``
    so can be applied slice by slice under ``pmap``."""
    if pmap.servers == 1 and all(p.whole for p in pmap.parts):
        return
    if found.kind is Sliceable.WHOLE_TREE and pmap.servers > 1:
        raise NotSliceable(
            f"the optimizer cannot be split over {pmap.servers} pservers: {found.reason}. Its "
            "update of one tensor depends on tensors other pservers hold (a global-norm clip "
            "such as optax.clip_by_global_norm, or a transform that reads the whole tree). Run "
            "with one pserver, or use an elementwise or per-tensor transform instead (optax.clip "
            "clips each value; the workers can bound a push's norm before they send it)"
        )
    if found.kind is not Sliceable.ELEMENTWISE and not all(p.whole for p in pmap.parts):
        raise NotSliceable(
            f"the optimizer reads whole tensors ({found.reason}); cut the model into whole "
            "tensors only (partition(..., block_bytes=0))"
        )


def _miniature(shapes: Mapping[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    cap = CAP
    while True:
        mini = {k: tuple(min(d, cap) for d in s) for k, s in shapes.items()}
        if cap <= 2 or sum(math.prod(s) for s in mini.values()) <= MAX_ELEMENTS:
            return mini
        cap //= 2


def _whole_map(shapes: Mapping[str, tuple[int, ...]]) -> PartitionMap:
    """Every tensor whole on one pserver: the single store's view."""
    return partition(shapes, 1, block_bytes=0)


def _probe_map(shapes: Mapping[str, tuple[int, ...]], blocks: bool) -> PartitionMap:
    """Tensors dealt round the probe's pservers; with ``blocks``, each of two rows or more cut
    in two, its halves on different pservers."""
    canon = {k: shapes[k] for k in sorted(shapes)}
    parts: list[Part] = []
    for path, shape in canon.items():
        rows = shape[0] if shape else 1
        row_bytes = 4 * math.prod(shape[1:])
        cuts = [0, rows // 2, rows] if blocks and shape and rows >= 2 else [0, rows]
        for a, b in itertools.pairwise(cuts):
            server = len(parts) % PROBE_SERVERS
            parts.append(Part(path, a, b, len(cuts) == 2, server, (b - a) * row_bytes))
    types = dict.fromkeys(canon, "float32")
    return PartitionMap(PROBE_SERVERS, 1 if blocks else 0, canon, types, tuple(parts))


def _run(
    tx: optax.GradientTransformation,
    params: Mapping[str, np.ndarray],
    grads: Sequence[Mapping[str, np.ndarray]],
) -> list[dict[str, np.ndarray]]:
    """The updates of each step, the parameters moving in between."""
    p: Any = dict(params)
    state = tx.init(p)
    update = tx.update
    out = []
    for g in grads:
        u, state = update(dict(g), state, p)
        p = optax.apply_updates(p, u)
        out.append({k: np.asarray(v) for k, v in u.items()})
    return out


def _same(
    make: SliceOptimizer,
    params: Mapping[str, np.ndarray],
    grads: Sequence[Mapping[str, np.ndarray]],
    want: Sequence[Mapping[str, np.ndarray]],
    pmap: PartitionMap,
) -> str | None:
    """None when the sliced run gives the whole run's updates; else what differed."""
    p_slices = split(pmap, params)
    g_slices = [split(pmap, g) for g in grads]
    empty: list[dict[str, np.ndarray]] = [{} for _ in grads]  # a pserver with no parts
    try:
        runs = [
            _run(make(pmap, s), p_slices[s], [g[s] for g in g_slices]) if p_slices[s] else empty
            for s in range(pmap.servers)
        ]
    except Exception as exc:  # a transform that needs the whole tree may fail on a part of it
        return f"fail on a slice ({type(exc).__name__}: {exc})"
    for step, whole in enumerate(want):
        got = join(pmap, [r[step] for r in runs])
        for k, v in whole.items():
            scale = float(np.max(np.abs(v))) if v.size else 0.0
            if not np.allclose(got[k], v, rtol=1e-4, atol=1e-6 * max(scale, 1e-30)):
                return f"change the update of {k!r} at step {step + 1}"
    return None
