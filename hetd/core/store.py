"""The training state: global parameters, optax state, version; how an update is applied.

Parameters are a flat ``path -> array`` map (the wire and the store address tensors by path, so a
worker can later hold and push only a slice). A gradient step is one jitted function that donates
its buffers: ``updates, s = tx.update(g, s, w); w = w + scale * updates`` — the weight scales the
step *after* the transform (docs/policies.md, so Adam does not normalise λ away). A delta from local
steps is applied as ``w + scale * D``, or, with an *outer* optimizer, as ``w + scale * u`` where
``u, s = outer.update(-D, s)`` (the pseudo-gradient of DiLoCo-style training; plain ``sgd`` at lr 1
is the first form). Only the engine calls the mutating methods.

``apply`` only queues the step and bumps the version: the steps run at the next
:meth:`Store.flush` — which :meth:`Store.snapshot` and :meth:`Store.state` call first, and which the
engine calls from a worker thread while it awaits, so that the optimizer step leaves the event
loop free. A lock makes a snapshot taken on the loop (an evaluation) wait for a flush running in
the thread instead of racing it.

With :attr:`Store.combine` (the daemon sets it), the updates queued between two flushes are applied
*once*: per kind whose optimizer keeps state (Adam, momentum, an outer optimizer), ``Σ scale_i ·
u_i`` goes through one optimizer step with scale 1 (each update counted once, with its own
weight), as a synchronous round's flush is. For a kind without state (SGD, plain deltas) one step
per update gives the same parameters (the transform is linear) for less work, so those still run
one by one. Unset (the simulator, unit tests), every update is its own step, in order.

With :attr:`Store.decisions` (the engine's decision log, :mod:`hetd.core.decisions`), each run of
a non-empty queue is logged as a step, wherever it runs, and a change of outer optimizer as such:
pservers replaying the log sum the same updates into each step.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple, TypeVar

import jax
import jax.numpy as jnp
import numpy as np
import optax

from hetd.core.decisions import DecisionSink
from hetd.core.peers import FrameSink
from hetd.protocol.params import full_frame, full_frame_into, param_hash, with_hash
from hetd.zoo.optim import make_optimizer, parse_optimizer

__all__ = [
    "Aggregator",
    "Int8",
    "Snapshot",
    "Store",
    "dense",
    "make_optimizer",
    "make_outer",
]


class Int8(NamedTuple):
    """An ``int8`` update with one scale, kept as it came off the wire (``q`` is a view of the
    frame): the jitted step dequantizes it itself, so the host never writes or checks the
    float32 copy (docs/benchmark.md: int8 grads dequantized inside jit)."""

    q: np.ndarray  # int8, the tensor's shape
    scale: np.float32  # finite, >= 0, and 128 * scale is finite: every value is finite


Update = np.ndarray | Int8
Tensors = Mapping[str, Update]
T = TypeVar("T")


def dense(x: Update) -> np.ndarray:
    """An update as a float32 array (``q * scale`` for :class:`Int8`, as ``int8`` decodes)."""
    if isinstance(x, Int8):
        out: np.ndarray = x.q.astype(np.float32)
        out *= x.scale
        return out
    return x


_Split = tuple[Mapping[str, Any], Mapping[str, Any], Mapping[str, Any]]
"""An update as (float32 arrays, int8 arrays, their scales), by path."""


def _shape(x: Update) -> tuple[int, ...]:
    return tuple(x.q.shape) if isinstance(x, Int8) else tuple(np.shape(x))


KINDS = ("grad", "delta")
MAX_PENDING = 16  # queued steps that make apply() flush at once (bounds the memory they hold)


def make_outer(spec: str) -> optax.GradientTransformation | None:
    """The outer optimizer for deltas; None for plain ``sgd`` at lr 1, which adds a delta as it
    is (the same values, without an optimizer state or a negation on the hot path)."""
    parsed = parse_optimizer(spec).with_default_lr(1.0)
    if parsed.name == "sgd" and parsed.lr == 1.0 and not dict(parsed.options).get("momentum"):
        return None
    return parsed.build()


PLAIN_OUTER = "sgd:lr=1"  # deltas added as they are: Store(outer=None)


def _merged(update: _Split) -> dict[str, jax.Array]:
    """An update's float32 parts and its int8 parts dequantized, by path (inside jit)."""
    dense_part, q, scales = update
    out = dict(dense_part)
    out.update({k: q[k].astype(jnp.float32) * scales[k] for k in q})
    return out


_Step = Any  # a jitted (params, state, update, scale) -> (params, state)


def _delta_steps(outer: optax.GradientTransformation | None) -> tuple[_Step, _Step]:
    """The jitted delta steps (float32 updates, and split int8 ones): ``w + scale · D`` without
    an outer optimizer, else ``w + scale · u`` with ``u, s = outer.update(−D, s)``."""

    def plain_delta_step(
        params: dict[str, jax.Array], state: Any, delta: dict[str, jax.Array], scale: jax.Array
    ) -> tuple[dict[str, jax.Array], Any]:
        return {k: params[k] + scale * delta[k] for k in params}, state

    def outer_delta_step(
        params: dict[str, jax.Array], state: Any, delta: dict[str, jax.Array], scale: jax.Array
    ) -> tuple[dict[str, jax.Array], Any]:
        assert outer is not None  # chosen below only when there is one; not network input
        pseudo = {k: -delta[k] for k in delta}
        updates, state = outer.update(pseudo, state, params)
        return {k: params[k] + scale * updates[k] for k in params}, state

    delta_step = plain_delta_step if outer is None else outer_delta_step

    def delta_step_q(
        params: dict[str, jax.Array], state: Any, update: _Split, scale: jax.Array
    ) -> tuple[dict[str, jax.Array], Any]:
        return delta_step(params, state, _merged(update), scale)

    return (
        jax.jit(delta_step, donate_argnums=(0, 1)),
        jax.jit(delta_step_q, donate_argnums=(0, 1)),
    )


class Snapshot:
    """One published parameter version: immutable host arrays, shared by every reader.

    ``frame``: the version's full ``params`` frame (codec ``none``) whose memory the store's
    snapshots' ``tensors`` are views of (:func:`hetd.protocol.params.full_frame`), so the daemon
    sends it as it is: ``bytes``, or a ``memoryview`` of the slot of shared memory the store
    packed it into (:class:`FrameSink`); None for a snapshot made by hand. The hash and the
    frame with it are computed on first use only (a version that goes out only as deltas is
    never hashed); two threads asking at once compute the same value twice, harmlessly."""

    __slots__ = ("_hash", "_hashed", "frame", "frame_hashed", "tensors", "version")

    def __init__(
        self,
        version: int,
        tensors: Mapping[str, np.ndarray],
        hash: str | None = None,
        frame: bytes | memoryview | None = None,
        frame_hashed: bool = False,
    ) -> None:
        """``frame_hashed``: ``frame`` already carries ``hash``."""
        self.version = version
        self.tensors = tensors
        self.frame = frame
        self.frame_hashed = frame_hashed and frame is not None and hash is not None
        self._hash = hash
        self._hashed: bytes | memoryview | None = frame if self.frame_hashed else None

    @property
    def hash(self) -> str:
        """:func:`hetd.protocol.params.param_hash` of the tensors (computed once)."""
        if self._hash is None:
            self._hash = param_hash(self.tensors)
        return self._hash

    def plain_frame(self) -> bytes | memoryview | None:
        """The full frame without a hash (None: the store hashed it, or there is no frame)."""
        return None if self.frame_hashed else self.frame

    def hashed_frame(self) -> bytes | memoryview | None:
        """``frame`` with the ``hash`` field (computed once); None without a frame."""
        if self.frame is None:
            return None
        if self._hashed is None:
            self._hashed = with_hash(self.frame, self.hash)
        return self._hashed


def outer_name(spec: str | None, outer: optax.GradientTransformation | None) -> str:
    """The outer optimizer's spec as a store records it: ``spec`` made canonical, the plain one
    for no optimizer and no spec, ``"custom"`` for an optimizer given without one."""
    spec = spec or (PLAIN_OUTER if outer is None else "")
    return str(parse_optimizer(spec).with_default_lr(1.0)) if spec else "custom"


class Store:
    """Global params + optimizer state + version. Not thread-safe: one writer (the engine)."""

    holds_params = True  # (a head whose pservers hold them keeps none: hetd.core.ledger)

    def __init__(
        self,
        params: Mapping[str, Any],
        tx: optax.GradientTransformation,
        version: int = 0,
        outer: optax.GradientTransformation | None = None,
        outer_spec: str | None = None,
    ) -> None:
        """``tx`` applies gradients; ``outer`` (None: add deltas as they are) applies deltas;
        ``outer_spec``: its spec, as :meth:`set_outer` compares and checkpoints record it."""
        self._params: dict[str, jax.Array] = {
            k: jnp.asarray(v, jnp.float32) for k, v in params.items()
        }
        self._tx = tx
        self._opt_state: Any = tx.init(self._params)
        self._outer = outer
        self._outer_state: Any = outer.init(self._params) if outer is not None else None
        self.outer_spec = outer_name(outer_spec, outer)
        self.version = version
        self.shapes: dict[str, tuple[int, ...]] = {
            k: tuple(v.shape) for k, v in self._params.items()
        }
        self._n_params = sum(math.prod(s) for s in self.shapes.values())
        self._snapshot: Snapshot | None = None
        self._pending: list[tuple[str, Tensors, float]] = []  # steps queued by apply, in order
        # apply what is queued as one step per kind (the weighted sum); the daemon's engine sets it
        self.combine = False
        # every update its own optimizer step even with ``combine``: a Task's own optimizer, whose
        # schedules and counts then advance once per applied update
        self.step_each = False
        # hash each snapshot as it is taken, into its frame (no second copy of the frame later);
        # False: only when asked (the engine sets it from EngineConfig.param_hashes)
        self.hashes = True
        # where snapshots' frames are packed (None: fresh memory); the daemon sets its
        # shared-memory ring once a same-host worker takes it
        self.frame_sink: FrameSink | None = None
        # the engine's decision log, if it keeps one: told where the queued steps run and when
        # the outer optimizer changes (the applier tells it the rest)
        self.decisions: DecisionSink | None = None
        self._lock = threading.RLock()

        def grad_step(
            params: dict[str, jax.Array], state: Any, grads: dict[str, jax.Array], scale: jax.Array
        ) -> tuple[dict[str, jax.Array], Any]:
            updates, state = tx.update(grads, state, params)
            new = {k: params[k] + scale * updates[k] for k in params}
            return new, state

        merged = _merged

        def grad_step_q(
            params: dict[str, jax.Array], state: Any, update: _Split, scale: jax.Array
        ) -> tuple[dict[str, jax.Array], Any]:
            return grad_step(params, state, merged(update), scale)

        def scaled(update: _Split, scale: jax.Array) -> dict[str, jax.Array]:
            return {k: scale * v for k, v in merged(update).items()}

        def accumulate(
            acc: dict[str, jax.Array], update: _Split, scale: jax.Array
        ) -> dict[str, jax.Array]:
            u = merged(update)
            return {k: acc[k] + scale * u[k] for k in acc}

        self._scaled = jax.jit(scaled)
        self._accumulate = jax.jit(accumulate, donate_argnums=(0,))
        self._grad_step = jax.jit(grad_step, donate_argnums=(0, 1))
        self._grad_step_q = jax.jit(grad_step_q, donate_argnums=(0, 1))
        self._delta_step, self._delta_step_q = _delta_steps(outer)

    def set_outer(self, spec: str) -> bool:
        """Apply deltas through ``spec``'s outer optimizer from now on (a policy swap: the DiLoCo
        family's Nesterov, plain averaging for the others). The queued steps run first, under the
        old one; the new one starts from a fresh state. The same spec keeps the running optimizer
        and its state. Returns whether it changed; raises ValueError on a bad spec, changing
        nothing."""
        if spec == self.outer_spec:  # also a store built with an optimizer and no spec
            return False
        canonical = str(parse_optimizer(spec).with_default_lr(1.0))
        outer = make_outer(canonical)
        with self._lock:
            if canonical == self.outer_spec:
                return False
            self.flush()
            self._outer = outer
            self._outer_state = outer.init(self._params) if outer is not None else None
            self._delta_step, self._delta_step_q = _delta_steps(outer)
            self.outer_spec = canonical
            if self.decisions is not None:
                self.decisions.set_outer(canonical)
            return True

    def restart_optimizer(self) -> None:
        """Start the gradients' optimizer afresh (its moments and step count, as at the start),
        keeping the parameters and the version: the queued steps run first, under the old
        state. What a policy asks for when the updates from here on differ in size from those
        the moments were built on (:class:`policies.types.RestartOptimizer`)."""
        with self._lock:
            self.flush()
            if self.decisions is not None:
                self.decisions.restart()
            self._opt_state = self._tx.init(self._params)

    @property
    def n_params(self) -> int:
        """Number of scalar parameters."""
        return self._n_params

    def apply(self, kind: str, tensors: Tensors, scale: float) -> int:
        """Queue one update (``grad`` through the optimizer, ``delta`` added) and bump the version;
        it is applied, in order, by the next :meth:`flush` (or at once when many are queued).
        The caller must not change ``tensors`` afterwards (they are read when the step runs)."""
        if kind not in KINDS:
            raise ValueError(f"unknown update kind {kind!r}; known: {', '.join(KINDS)}")
        for path, shape in self.shapes.items():
            if path not in tensors or _shape(tensors[path]) != shape:
                raise ValueError(f"update lacks {path!r} or has the wrong shape; wants {shape}")
        with self._lock:
            self._pending.append((kind, tensors, scale))
            self.version += 1
            self._snapshot = None
            if len(self._pending) >= MAX_PENDING:
                self.flush()
            return self.version

    def warm(self, int8: bool = False) -> None:
        """Compile the jitted steps now, on zeros of the model's shapes (the daemon runs this in a
        worker thread at start-up, so the first push does not wait for XLA); ``int8``: also the
        steps that take every tensor as :class:`Int8`. Touches no state."""
        grads = {k: np.zeros(s, np.float32) for k, s in self.shapes.items()}
        zeros = {k: jnp.zeros(s, jnp.float32) for k, s in self.shapes.items()}
        params, _ = self._grad_step(zeros, self._tx.init(zeros), grads, np.float32(0.0))
        outer = self._outer.init(zeros) if self._outer is not None else None
        params, _ = self._delta_step(params, outer, grads, np.float32(0.0))
        acc = self._scaled((grads, {}, {}), np.float32(0.0))
        acc = self._accumulate(acc, (grads, {}, {}), np.float32(0.0))
        if int8:
            q = {k: np.zeros(s, np.int8) for k, s in self.shapes.items()}
            split: _Split = ({}, q, {k: np.float32(0.0) for k in q})
            acc = self._scaled(split, np.float32(0.0))
            acc = self._accumulate(acc, split, np.float32(0.0))
            params, _ = self._grad_step_q(params, self._tx.init(params), split, np.float32(0.0))
            outer = self._outer.init(params) if self._outer is not None else None
            params, _ = self._delta_step_q(params, outer, split, np.float32(0.0))
        for leaf in params.values():
            leaf.block_until_ready()

    @property
    def pending(self) -> int:
        """Steps queued and not yet run."""
        return len(self._pending)

    def flush(self) -> None:
        """Run the queued steps (thread-safe; JAX releases the GIL while it computes): one per
        update in order, or with :attr:`combine` one per kind, of the weighted sum."""
        with self._lock:
            pending, self._pending = self._pending, []
            if pending and self.decisions is not None:
                # pservers run theirs here too, summed as these are: the same sums per step
                self.decisions.step(self.combine)
            if (
                self.combine
                and not self.step_each
                and len(pending) > 1
                and any(map(self._stateful, KINDS))
            ):
                for kind in KINDS:
                    group = [(t, scale) for k, t, scale in pending if k == kind]
                    if len(group) > 1 and self._stateful(kind):
                        self._step(kind, self._sum(group), 1.0)
                    else:
                        for tensors, scale in group:
                            self._step(kind, tensors, scale)
                return
            for kind, tensors, scale in pending:
                self._step(kind, tensors, scale)

    def _stateful(self, kind: str) -> bool:
        """Whether ``kind``'s optimizer keeps state (Adam, momentum, an outer optimizer). Without
        state (SGD, plain deltas) one step per update is the step of their sum, and cheaper: the
        sum costs a pass and a fresh buffer per update (at 10M parameters, int8, SGD: 11 ms per
        update combined against 3.7 ms one by one)."""
        state = self._opt_state if kind == "grad" else self._outer_state
        return bool(jax.tree.leaves(state))

    def _sum(self, group: list[tuple[Tensors, float]]) -> dict[str, jax.Array]:
        """``Σ scale · update`` on the device, one pass per update (int8 dequantized in jit)."""
        acc = self._scaled(self._split(group[0][0]), np.float32(group[0][1]))
        for tensors, scale in group[1:]:
            acc = self._accumulate(acc, self._split(tensors), np.float32(scale))
        return {k: acc[k] for k in self._params}

    @staticmethod
    def _split(tensors: Tensors) -> _Split:
        return (
            {k: v for k, v in tensors.items() if not isinstance(v, Int8)},
            {k: v.q for k, v in tensors.items() if isinstance(v, Int8)},
            {k: v.scale for k, v in tensors.items() if isinstance(v, Int8)},
        )

    def _step(self, kind: str, tensors: Mapping[str, Any], scale: float) -> None:
        """One optimizer step (``grad``) or one delta added, scaled by ``scale``."""
        # Host arrays go to the jitted step as they are: its C++ path moves them in one go,
        # faster than a jnp.asarray per tensor from Python (docs/benchmark.md).
        if not any(isinstance(v, Int8) for v in tensors.values()):
            update = {k: tensors[k] for k in self._params}
            if kind == "grad":
                self._params, self._opt_state = self._grad_step(
                    self._params, self._opt_state, update, np.float32(scale)
                )
            else:
                self._params, self._outer_state = self._delta_step(
                    self._params, self._outer_state, update, np.float32(scale)
                )
            return
        split = self._split(tensors)
        if kind == "grad":
            self._params, self._opt_state = self._grad_step_q(
                self._params, self._opt_state, split, np.float32(scale)
            )
        else:
            self._params, self._outer_state = self._delta_step_q(
                self._params, self._outer_state, split, np.float32(scale)
            )

    def snapshot(self) -> Snapshot:
        """The current version as host arrays, copied once per version (buffers are donated)."""
        with self._lock:
            if self._snapshot is None or self._snapshot.version != self.version:
                self.flush()
                # Host views of the device buffers (no copy on CPU), copied once into the full
                # params frame, whose memory the snapshot's arrays are: the next step donates
                # the device buffers, the frame stays.
                views = {k: np.asarray(v) for k, v in self._params.items()}
                digest = param_hash(views) if self.hashes else None
                frame, host = self._pack(views, digest)
                self._snapshot = Snapshot(
                    self.version, host, digest, frame, frame_hashed=self.hashes
                )
            return self._snapshot

    def read(self, fn: Callable[[int, Mapping[str, np.ndarray]], T]) -> T:
        """``fn(version, params)`` on the current version, its queued steps run first, the
        parameters read in place: the version's snapshot when one was taken, else host views of
        the store's own buffers (no copy on CPU), valid during the call only (the lock holds off
        the next step, which donates those buffers; ``fn`` must keep no view). For what reads a
        version once and keeps a digest of it (the pservers' ``params_at``), where a snapshot
        would copy the model for nobody."""
        with self._lock:
            self.flush()
            snap = self._snapshot
            if snap is not None and snap.version == self.version:
                return fn(self.version, snap.tensors)
            return fn(self.version, {k: np.asarray(v) for k, v in self._params.items()})

    def _pack(
        self, views: Mapping[str, np.ndarray], digest: str | None
    ) -> tuple[bytes | memoryview, dict[str, np.ndarray]]:
        """The snapshot's frame and tensors, packed into the frame sink when it has room."""
        sink = self.frame_sink
        if sink is None:
            return full_frame(self.version, views, digest)
        taken: list[np.ndarray] = []

        def into(nbytes: int) -> np.ndarray | None:
            buf = sink.reserve(nbytes)
            if buf is not None:
                taken.append(buf)
            return buf

        frame, host = full_frame_into(self.version, views, digest, into)
        if taken and isinstance(frame, memoryview):
            sink.commit(taken[0], frame, self.version)
        return frame, host

    def state(self) -> tuple[dict[str, np.ndarray], Any, int]:
        """Params (host copies), optimizer state (host pytree) and version, for checkpoints. With
        an outer optimizer the state is ``{"grad": ..., "outer": ...}``; without, the gradient
        optimizer's state alone (the format of checkpoints written before outer optimizers)."""
        with self._lock:
            snap = self.snapshot()
            opt: Any = self._opt_state
            if self._outer is not None:
                opt = {"grad": self._opt_state, "outer": self._outer_state}
            return dict(snap.tensors), jax.device_get(opt), snap.version

    def restore(self, params: Tensors, opt_state: Any, version: int) -> None:
        """Replace the whole state (from a checkpoint); shapes must match the model."""
        shapes = {k: tuple(np.shape(v)) for k, v in params.items()}
        if not shapes and self.shapes:
            raise ValueError(
                "the checkpoint holds no parameters: a head whose pservers hold them "
                "([pservers] headers = true) wrote it; resume with headers = true"
            )
        if shapes != self.shapes:
            raise ValueError("checkpoint parameters do not match the model's paths and shapes")
        with self._lock:
            self._restore(params, opt_state, version)

    def _restore(self, params: Tensors, opt_state: Any, version: int) -> None:
        self._pending = []
        self._params = {k: jnp.asarray(v, jnp.float32) for k, v in params.items()}
        # A state taken under another outer optimizer (a checkpoint before a swap, the real
        # bench's t = 0 restart): the gradient optimizer's part carries over, the outer one
        # starts fresh, as after a swap.
        nested = isinstance(opt_state, dict) and set(opt_state) == {"grad", "outer"}
        grad = opt_state["grad"] if nested else opt_state
        self._opt_state = jax.tree.map(jnp.asarray, grad)
        if self._outer is not None:
            outer = opt_state["outer"] if nested else self._outer.init(self._params)
            self._outer_state = jax.tree.map(jnp.asarray, outer)
        self.version = version
        self._snapshot = None


class Aggregator:
    """The round buffer of synchronous policies: Σ weight·update per kind, and Σ weight."""

    def __init__(self) -> None:
        self._sums: dict[str, dict[str, np.ndarray]] = {}
        self._weights: dict[str, float] = {}
        self.count = 0  # pushes buffered

    def add(self, kind: str, tensors: Tensors, weight: float) -> None:
        """Accumulate one update with its weight."""
        acc = self._sums.get(kind)
        if acc is None:
            self._sums[kind] = {
                k: np.multiply(dense(v), weight, dtype=np.float32) for k, v in tensors.items()
            }
        else:
            for k, v in tensors.items():
                acc[k] += np.float32(weight) * dense(v)
        self._weights[kind] = self._weights.get(kind, 0.0) + weight
        self.count += 1

    @property
    def kinds(self) -> tuple[str, ...]:
        """The kinds buffered, in the order first added (one version each when flushed)."""
        return tuple(self._sums)

    def state(self) -> dict[str, Any]:
        """The buffer as plain values (for checkpoints)."""
        return {
            "count": self.count,
            "weights": dict(self._weights),
            "sums": {
                kind: {k: v.copy() for k, v in acc.items()} for kind, acc in self._sums.items()
            },
        }

    @classmethod
    def from_state(cls, state: Mapping[str, Any]) -> Aggregator:
        """The buffer saved by :meth:`state`."""
        agg = cls()
        agg._sums = {
            str(kind): {str(k): np.array(v, np.float32) for k, v in acc.items()}
            for kind, acc in state["sums"].items()
        }
        agg._weights = {str(k): float(v) for k, v in state["weights"].items()}
        agg.count = int(state["count"])
        return agg

    def take(self, normalize: bool) -> list[tuple[str, dict[str, np.ndarray]]]:
        """Empty the buffer: per kind, the sum (divided by Σ weight when ``normalize``)."""
        out = []
        for kind, acc in self._sums.items():
            total = self._weights[kind]
            if normalize and total > 0:
                for v in acc.values():
                    v /= np.float32(total)
            out.append((kind, acc))
        self._sums, self._weights, self.count = {}, {}, 0
        return out
