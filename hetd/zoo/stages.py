"""Pipeline stages in JAX: block-structured models, stage forward/backward with kept residuals,
and a 1F1B schedule over micro-batches in one process.

A :class:`BlockModel` is a chain of flax modules ``[(name, module)]``, each one array to one
array (residual connections *inside* a block are fine; the built-in workloads as blocks are
:mod:`hetd.zoo.blocks`). Its flat parameters carry the block index
as their first path segment (``b00/Dense_0/kernel``), so a stage's slice is every path under its
blocks' prefixes. :func:`as_model` makes the whole chain an ordinary
:class:`hetd.zoo.models.Model` (the reference gradient the stages must add up to).

A :class:`Stage` holds blocks ``[lo, hi)``:

* not last: ``forward(p, h) -> (out, vjp)`` runs ``jax.vjp`` inside ``jit`` and returns the
  residuals as a pytree (``vjp``), kept outside jit until ``backward(vjp, g) -> (g_p, g_h)``;
  stage 0 differentiates with respect to its parameters only;
* last: ``loss_grad(p, h, y, scale)`` is one jitted ``value_and_grad`` of ``scale·loss`` giving
  the loss, the parameter gradient and the gradient for the stage before.

Every jitted call sees micro-batches of one fixed shape, so a different number of micro-batches
``M`` never recompiles (``Stage.traces`` counts traces). A :class:`StageRunner` is one stage's
side of a step, driven by the messages that arrive (what a worker will run between relay
frames): it follows its fixed 1F1B order (warm-up forwards up to its in-flight cap, then forward
and backward in turn) as far as its inputs allow and returns the activations or gradients to
send. :func:`run_1f1b` connects ``S`` runners in one process, passing numpy arrays as the relay
will, and returns each stage's accumulated gradient slice: the mean gradient of the whole batch,
equal to ``jax.grad`` of the whole model.

:func:`block_costs` gives the planner (:mod:`policies.dpmp.costs`) each block's parameter bytes,
output bytes per sample (``jax.eval_shape``, no run) and FLOPs (XLA's cost analysis of the
lowered block, no compile).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, cast

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import traverse_util

from hetd.zoo.models import Model, Params
from policies.dpmp.costs import Block, stage_order


class BlockModel(NamedTuple):
    """A chain of blocks, each one array in and one array out; the last gives logits."""

    name: str
    blocks: tuple[tuple[str, nn.Module], ...]


def prefix(j: int) -> str:
    """The path prefix of block ``j``'s parameters."""
    return f"b{j:02d}"


def _flatten(tree: Any) -> Params:
    flat: Params = traverse_util.flatten_dict(tree, sep="/")  # type: ignore[no-untyped-call]
    return flat


def _unflatten(flat: Mapping[str, Any]) -> Any:
    return traverse_util.unflatten_dict(dict(flat), sep="/")  # type: ignore[no-untyped-call]


def init_blocks(bm: BlockModel, key: jax.Array, input_shape: tuple[int, ...]) -> Params:
    """Flat parameters of the whole chain for inputs shaped like one example."""
    h = jnp.zeros((1, *input_shape), jnp.float32)
    out: Params = {}
    for j, (_, module) in enumerate(bm.blocks):
        variables = jax.jit(module.init)(jax.random.fold_in(key, j), h)  # one compile, not
        # an eager dispatch per op
        out.update({f"{prefix(j)}/{k}": v for k, v in _flatten(variables["params"]).items()})
        shape = jax.eval_shape(module.apply, variables, h)
        h = jnp.zeros(shape.shape, shape.dtype)
    return out


def slice_params(params: Mapping[str, Any], lo: int, hi: int) -> dict[str, Any]:
    """The paths of blocks ``[lo, hi)``."""
    heads = tuple(prefix(j) + "/" for j in range(lo, hi))
    return {k: v for k, v in params.items() if k.startswith(heads)}


def _apply_range(bm: BlockModel, lo: int, hi: int) -> Callable[[Params, jax.Array], jax.Array]:
    """``(slice params, h) -> h`` through blocks ``[lo, hi)``."""

    def apply(params: Params, h: jax.Array) -> jax.Array:
        for j in range(lo, hi):
            head = prefix(j) + "/"
            own = {k[len(head) :]: v for k, v in params.items() if k.startswith(head)}
            h = cast(jax.Array, bm.blocks[j][1].apply({"params": _unflatten(own)}, h))
        return h

    return apply


def _loss(logits: jax.Array, y: jax.Array) -> jax.Array:
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, y))


def as_model(bm: BlockModel) -> Model:
    """The chain as one :class:`Model` over the same flat parameters."""
    whole = _apply_range(bm, 0, len(bm.blocks))

    def init(key: jax.Array, input_shape: tuple[int, ...]) -> Params:
        return init_blocks(bm, key, input_shape)

    def loss(params: Params, x: jax.Array, y: jax.Array) -> jax.Array:
        return _loss(whole(params, x), y)

    def accuracy(params: Params, x: jax.Array, y: jax.Array) -> jax.Array:
        return jnp.mean(jnp.argmax(whole(params, x), axis=-1) == y)

    return Model(name=bm.name, init=init, loss=loss, accuracy=accuracy, logits=whole)


def block_costs(
    bm: BlockModel, params: Mapping[str, Any], input_shape: tuple[int, ...]
) -> list[Block]:
    """Each block's parameter bytes, output bytes per sample and forward FLOPs per sample."""
    out = []
    h = jax.ShapeDtypeStruct((1, *input_shape), jnp.float32)  # type: ignore[no-untyped-call]
    for j, (name, _) in enumerate(bm.blocks):
        own = slice_params(params, j, j + 1)
        apply = _apply_range(bm, j, j + 1)
        nxt = jax.eval_shape(apply, own, h)
        p_bytes = float(sum(np.prod(v.shape) * v.dtype.itemsize for v in own.values()))
        a_bytes = float(np.prod(nxt.shape[1:]) * nxt.dtype.itemsize)
        try:
            cost = jax.jit(apply).lower(own, h).cost_analysis()
            flops = float(cost.get("flops", 0.0)) if isinstance(cost, Mapping) else 0.0
        except Exception:  # pragma: no cover - a backend without cost analysis
            flops = 0.0
        out.append(Block(name, p_bytes, a_bytes, flops if flops > 0 else p_bytes / 4 + 1.0))
        h = jax.ShapeDtypeStruct((1, *nxt.shape[1:]), nxt.dtype)  # type: ignore[no-untyped-call]
    return out


def input_shapes(bm: BlockModel, example: tuple[int, ...]) -> list[tuple[int, ...]]:
    """The per-sample shape of each block's input for examples shaped ``example`` (the last
    entry: the model's output), by shape inference only (no parameters made, nothing run)."""
    h = jax.ShapeDtypeStruct((1, *example), jnp.float32)  # type: ignore[no-untyped-call]
    out = [tuple(example)]
    for _, module in bm.blocks:
        nxt, _ = jax.eval_shape(lambda x, m=module: m.init_with_output(jax.random.PRNGKey(0), x), h)
        out.append(tuple(nxt.shape[1:]))
        h = jax.ShapeDtypeStruct((1, *nxt.shape[1:]), nxt.dtype)  # type: ignore[no-untyped-call]
    return out


@dataclass
class Stage:
    """Blocks ``[lo, hi)`` of ``bm`` as one pipeline stage (``of`` stages in all)."""

    bm: BlockModel
    lo: int
    hi: int
    index: int
    of: int
    traces: dict[str, int] = field(default_factory=lambda: {"fwd": 0, "bwd": 0, "last": 0})

    def __post_init__(self) -> None:
        if not 0 <= self.lo < self.hi <= len(self.bm.blocks):
            raise ValueError(f"stage blocks [{self.lo}, {self.hi}) out of 0..{len(self.bm.blocks)}")
        apply = _apply_range(self.bm, self.lo, self.hi)
        first = self.index == 0

        def fwd(p: Params, h: jax.Array) -> tuple[jax.Array, Any]:
            self.traces["fwd"] += 1  # runs only while tracing
            if first:
                return jax.vjp(lambda q: apply(q, h), p)
            return jax.vjp(apply, p, h)

        def bwd(vjp: Any, g: jax.Array) -> Any:
            self.traces["bwd"] += 1
            return vjp(g)

        def scaled(p: Params, h: jax.Array, y: jax.Array, scale: jax.Array) -> jax.Array:
            return _loss(apply(p, h), y) * scale

        argnums = (0,) if first else (0, 1)
        grad = jax.value_and_grad(scaled, argnums=argnums)

        def last(p: Params, h: jax.Array, y: jax.Array, scale: jax.Array) -> Any:
            self.traces["last"] += 1
            return grad(p, h, y, scale)

        self._fwd = jax.jit(fwd)
        self._bwd = jax.jit(bwd)
        self._last = jax.jit(last)
        self._add = jax.jit(lambda a, b: jax.tree_util.tree_map(jnp.add, a, b))

    @property
    def is_last(self) -> bool:
        return self.index == self.of - 1

    def slice(self, params: Mapping[str, Any]) -> dict[str, Any]:
        return slice_params(params, self.lo, self.hi)

    def forward(self, p: Params, h: Any) -> tuple[jax.Array, Any]:
        """Output and kept residuals of a micro-batch (not the last stage)."""
        return cast(tuple[jax.Array, Any], self._fwd(p, h))

    def backward(self, vjp: Any, g: Any) -> tuple[Any, Any | None]:
        """``(g_params, g_input)`` from kept residuals (``g_input`` None on stage 0)."""
        out = self._bwd(vjp, g)
        return (out[0], None) if self.index == 0 else (out[0], out[1])

    def loss_grad(self, p: Params, h: Any, y: Any, scale: float) -> tuple[Any, Any, Any | None]:
        """Last stage: ``(scale·loss, g_params, g_input)`` of one micro-batch."""
        loss, grads = self._last(p, h, y, np.float32(scale))
        return loss, grads[0], (grads[1] if len(grads) > 1 else None)

    def add(self, acc: Any, g: Any) -> Any:
        return g if acc is None else self._add(acc, g)


@dataclass(frozen=True, slots=True)
class PipelineResult:
    grads: dict[str, np.ndarray]  # every stage's slice, the mean gradient of the batch
    loss: float  # mean loss of the batch
    trace: tuple[tuple[int, str, int], ...]  # (stage, "F" | "B", micro-batch) in run order
    peak_inflight: tuple[int, ...]  # most residual sets a stage held at once


Message = tuple[str, int, np.ndarray]
"""``("act", mb, h)`` for the next stage or ``("gact", mb, g_h)`` for the one before."""


class StageRunner:
    """One stage's side of one step, driven by what arrives: what a worker runs between the
    relay's messages. It runs its 1F1B order (:func:`policies.dpmp.costs.stage_order`) as far as
    its inputs allow and returns the messages to send; stage 0 draws its micro-batches from
    ``inputs``, the last stage its labels from ``labels``. After the last backward, ``grads``
    holds the stage's accumulated slice of the batch's mean gradient."""

    def __init__(
        self,
        stage: Stage,
        params: Mapping[str, Any],
        micro_batches: int,
        inflight: int | None = None,
        inputs: Callable[[int], np.ndarray] | None = None,
        labels: Callable[[int], np.ndarray] | None = None,
    ) -> None:
        if stage.index == 0 and inputs is None:
            raise ValueError("stage 0 needs its inputs")
        if stage.is_last and labels is None:
            raise ValueError("the last stage needs the labels")
        cap = 1 if stage.is_last else (inflight or stage.of - stage.index)
        order = stage_order(cap, micro_batches)
        self.order = [t for t in order if not stage.is_last or t[0] == "F"]
        self.stage = stage
        self.slice = stage.slice(params)
        self.scale = 1.0 / micro_batches
        self.inputs, self.labels = inputs, labels
        self.acts: dict[int, np.ndarray] = {}
        self.grads_in: dict[int, np.ndarray] = {}
        self.kept: dict[int, Any] = {}
        self.acc: Any = None
        self.loss = 0.0
        self.peak = 0
        self.trace: list[tuple[str, int]] = []
        self._next = 0

    @property
    def done(self) -> bool:
        return self._next == len(self.order)

    def start(self) -> list[Message]:
        """Run what needs no message (stage 0's forwards up to its cap)."""
        return self._advance()

    def offer(self, kind: str, mb: int, array: np.ndarray) -> list[Message]:
        """An activation (``"act"``) or its gradient (``"gact"``) arrived for micro-batch ``mb``."""
        if kind == "act" and self.stage.index > 0:
            self.acts[mb] = array
        elif kind == "gact" and not self.stage.is_last:
            self.grads_in[mb] = array
        else:
            raise ValueError(f"stage {self.stage.index} takes no {kind!r}")
        return self._advance()

    def grads(self) -> dict[str, np.ndarray]:
        if not self.done:
            raise ValueError("the step is not finished")
        return {k: np.asarray(v) for k, v in self.acc.items()}

    def _advance(self) -> list[Message]:
        out: list[Message] = []
        st = self.stage
        while not self.done:
            kind, mb = self.order[self._next]
            if kind == "F":
                if st.index == 0:
                    assert self.inputs is not None
                    h = self.inputs(mb)
                elif mb in self.acts:
                    h = self.acts.pop(mb)
                else:
                    return out
            elif mb in self.grads_in:
                g = self.grads_in.pop(mb)
            else:
                return out
            self._next += 1
            self.trace.append((kind, mb))
            if kind == "F" and st.is_last:
                assert self.labels is not None
                part, g_p, g_h = st.loss_grad(self.slice, h, self.labels(mb), self.scale)
                self.loss += float(part)
                self.acc = st.add(self.acc, g_p)
                self.trace.append(("B", mb))
                if st.index > 0:
                    out.append(("gact", mb, np.asarray(g_h)))
            elif kind == "F":
                act, vjp = st.forward(self.slice, h)
                self.kept[mb] = vjp
                self.peak = max(self.peak, len(self.kept))
                out.append(("act", mb, np.asarray(act)))
            else:
                g_p, g_h = st.backward(self.kept.pop(mb), g)
                self.acc = st.add(self.acc, g_p)
                if st.index > 0:
                    out.append(("gact", mb, np.asarray(g_h)))
        return out


def run_1f1b(
    stages: Sequence[Stage],
    params: Mapping[str, Any],
    xs: np.ndarray,
    ys: np.ndarray,
    inflight: Sequence[int] = (),
) -> PipelineResult:
    """One step of ``len(stages)`` :class:`StageRunner` s in one process over micro-batches
    ``xs[i]``, ``ys[i]`` (shape ``(M, m, ...)``), messages delivered in order between
    neighbours as the relay will (numpy arrays); ``inflight[s]`` defaults to ``S − s``."""
    n, big_m = len(stages), xs.shape[0]
    if n == 0 or big_m == 0:
        raise ValueError("need at least one stage and one micro-batch")
    runners = [
        StageRunner(
            st,
            params,
            big_m,
            inflight[s] if inflight else None,
            inputs=(lambda mb: xs[mb]) if s == 0 else None,
            labels=(lambda mb: ys[mb]) if s == n - 1 else None,
        )
        for s, st in enumerate(stages)
    ]
    mail: deque[tuple[int, Message]] = deque((0, m) for m in runners[0].start())
    trace: list[tuple[int, str, int]] = [(0, k, mb) for k, mb in runners[0].trace]
    while mail:
        src, (kind, mb, array) = mail.popleft()
        dst = src + 1 if kind == "act" else src - 1
        seen = len(runners[dst].trace)
        mail.extend((dst, m) for m in runners[dst].offer(kind, mb, array))
        trace += [(dst, k, b) for k, b in runners[dst].trace[seen:]]
    if not all(r.done for r in runners):  # pragma: no cover - a 1F1B order never waits on itself
        raise RuntimeError("pipeline schedule stalled")
    grads: dict[str, np.ndarray] = {}
    for r in runners:
        grads.update(r.grads())
    loss = sum(r.loss for r in runners)
    return PipelineResult(grads, loss, tuple(trace), tuple(r.peak for r in runners))


def make_stages(bm: BlockModel, cuts: Sequence[int]) -> list[Stage]:
    """One :class:`Stage` per pair of consecutive cuts (``0 = k_0 < ... < k_S = L``)."""
    if len(cuts) < 2 or cuts[0] != 0 or cuts[-1] != len(bm.blocks):
        raise ValueError(f"cuts {list(cuts)} must run from 0 to {len(bm.blocks)}")
    n = len(cuts) - 1
    return [Stage(bm, cuts[s], cuts[s + 1], s, n) for s in range(n)]
