"""The model registry shared by the daemon and the workers.

Owns :class:`Model` (a NamedTuple of pure, jit-able functions over *flat* parameter maps), the
built-in ``mlp``, ``cnn`` and ``transformer`` (:mod:`hetd.zoo.lm`) models, the name registry, and ``pkg.module:attr`` model plug-ins
that let a user bring their own model (the import itself is ``hetd.zoo.data.resolve_spec``, shared
with the data-set registry so that loading data never imports JAX).

Parameters are a flat ``dict`` from a ``/``-separated path (``"Dense_0/kernel"``) to an array,
because the wire and the parameter store address parameters by path. The functions unflatten the
dict themselves, so ``jax.grad(model.loss)`` returns a dict with exactly the same paths. We keep
it a dict of arrays and never ravel to one vector inside ``jit``: a flat gradient inside ``jit``
was far slower (docs/benchmark.md, "Measured on the reference machine").
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple, cast

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import numpy.typing as npt
import optax
from flax import traverse_util

from hetd.zoo.data import accepts_keyword, resolve_spec
from hetd.zoo.lm import TransformerLM, resolve_size

Params = dict[str, jax.Array]
"""Flat map from a ``/``-separated parameter path to its array."""


class Model(NamedTuple):
    """A model as four pure functions over flat parameters; all but ``init`` are jit-able.

    ``x`` is a batch ``(n, *input_shape)`` of float32; ``y`` is ``(n,)`` integer class labels.
    """

    name: str
    init: Callable[[jax.Array, tuple[int, ...]], Params]
    """(PRNG key, shape of ONE example, e.g. ``(784,)`` or ``(8, 8, 1)``) -> flat params."""
    loss: Callable[[Params, jax.Array, jax.Array], jax.Array]
    """(params, x, y) -> mean softmax cross-entropy, a scalar."""
    accuracy: Callable[[Params, jax.Array, jax.Array], jax.Array]
    """(params, x, y) -> fraction of ``x`` classified as ``y``, a scalar."""
    logits: Callable[[Params, jax.Array], jax.Array]
    """(params, x) -> logits ``(n, num_classes)``."""


ModelFactory = Callable[..., Model]
"""Builds a :class:`Model`; registered factories are called as ``factory(num_classes=k, **kw)``."""


def from_linen(name: str, module: nn.Module) -> Model:
    """Wrap a flax linen module that maps a batch ``x`` to logits as a :class:`Model`."""

    def init(key: jax.Array, input_shape: tuple[int, ...]) -> Params:
        variables = module.init(key, jnp.zeros((1, *input_shape), jnp.float32))
        # flax's traverse_util and pooling helpers are unannotated, hence the ignores below
        flat: Params = traverse_util.flatten_dict(variables["params"], sep="/")  # type: ignore[no-untyped-call]
        return flat

    def logits(params: Params, x: jax.Array) -> jax.Array:
        tree = traverse_util.unflatten_dict(params, sep="/")  # type: ignore[no-untyped-call]
        return cast(jax.Array, module.apply({"params": tree}, x))

    def loss(params: Params, x: jax.Array, y: jax.Array) -> jax.Array:
        per_example = optax.softmax_cross_entropy_with_integer_labels(logits(params, x), y)
        return jnp.mean(per_example)

    def accuracy(params: Params, x: jax.Array, y: jax.Array) -> jax.Array:
        predicted = jnp.argmax(logits(params, x), axis=-1)
        return jnp.mean(predicted == y)

    return Model(name=name, init=init, loss=loss, accuracy=accuracy, logits=logits)


class _MLP(nn.Module):
    """Flatten, then ``Dense -> relu`` per hidden size, then a Dense to the logits."""

    hidden: tuple[int, ...]
    num_classes: int

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        x = x.reshape((x.shape[0], -1))
        for width in self.hidden:
            x = nn.relu(nn.Dense(width)(x))
        out: jax.Array = nn.Dense(self.num_classes)(x)
        return out


class _CNN(nn.Module):
    """``(Conv 3x3 -> relu -> 2x2 avg pool)`` per feature count, then Dense -> relu -> Dense."""

    features: tuple[int, ...]
    dense: int
    num_classes: int

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        x = _as_image(x)
        for count in self.features:
            x = nn.relu(nn.Conv(count, kernel_size=(3, 3))(x))
            x = nn.avg_pool(x, window_shape=(2, 2), strides=(2, 2), padding="SAME")  # type: ignore[no-untyped-call]
        x = x.reshape((x.shape[0], -1))
        x = nn.relu(nn.Dense(self.dense)(x))
        out: jax.Array = nn.Dense(self.num_classes)(x)
        return out


def _as_image(x: jax.Array) -> jax.Array:
    """Make a batch NHWC: flat square inputs (784, 64, ...) become one-channel square images."""
    if x.ndim == 4:
        return x
    if x.ndim == 3:
        return x[..., None]
    if x.ndim == 2:
        side = math.isqrt(x.shape[1])
        if side * side != x.shape[1]:
            raise ValueError(
                f"cnn needs NHWC images or flat square inputs; got {x.shape[1]} features per "
                "example, which is not a square; reshape the data set to (H, W, C)"
            )
        return x.reshape((x.shape[0], side, side, 1))
    raise ValueError(f"cnn needs a batch of images (n, H, W, C); got shape {x.shape}")


def mlp(num_classes: int, hidden: Sequence[int] = (128,)) -> Model:
    """A multilayer perceptron; ``hidden`` gives the width of each hidden layer."""
    return from_linen("mlp", _MLP(hidden=tuple(hidden), num_classes=num_classes))


def cnn(num_classes: int, features: Sequence[int] = (32, 64), dense: int = 128) -> Model:
    """Two 3x3 conv + avg-pool blocks (``features`` channels each) and a hidden Dense layer."""
    module = _CNN(features=tuple(features), dense=dense, num_classes=num_classes)
    return from_linen("cnn", module)


def transformer(
    num_classes: int,
    size: str | None = None,
    d_model: int | None = None,
    layers: int | None = None,
    heads: int | None = None,
) -> Model:
    """A decoder-only byte/char language model (:mod:`hetd.zoo.lm`) for sequence data sets such
    as ``pydoc``: ``num_classes`` is the vocabulary, ``size`` one of "0.5m", "2m", "10m" (default
    "0.5m"), and ``d_model``/``layers``/``heads`` override it. Its loss is the mean next-token
    cross-entropy (nats; bits per byte = loss / ln 2), its accuracy the next-token accuracy."""
    shape = resolve_size(size, d_model, layers, heads)
    module = TransformerLM(
        vocab=num_classes, d_model=shape.d_model, layers=shape.layers, heads=shape.heads
    )
    return from_linen("transformer", module)


_REGISTRY: dict[str, ModelFactory] = {"mlp": mlp, "cnn": cnn, "transformer": transformer}


def register_model(name: str, factory: ModelFactory) -> None:
    """Register ``factory`` under ``name``; it is called as ``factory(num_classes=k, **kwargs)``."""
    if ":" in name or not name:
        raise ValueError(f"model name {name!r} must be non-empty and contain no ':'")
    if name in _REGISTRY:
        raise ValueError(f"model {name!r} is already registered; known models: {model_names()}")
    _REGISTRY[name] = factory


def model_names() -> list[str]:
    """The registered model names, sorted."""
    return sorted(_REGISTRY)


def get_model(spec: str, num_classes: int, **kwargs: Any) -> Model:
    """Build a model from a registered name or a ``pkg.module:attr`` plug-in.

    A plug-in ``attr`` is a :class:`Model`, or a factory returning one; the factory receives
    ``num_classes`` if its signature accepts it, and ``kwargs`` in any case.
    """
    if ":" not in spec:
        factory = _REGISTRY.get(spec)
        if factory is None:
            raise ValueError(
                f"unknown model {spec!r}; known models: {model_names()} "
                "(or give your own as 'pkg.module:attr')"
            )
        return _built(spec, factory, {"num_classes": num_classes, **kwargs})
    target = resolve_spec(spec)
    if isinstance(target, Model):
        if kwargs:
            raise ValueError(f"{spec!r} is a Model, not a factory; it takes no options {kwargs}")
        return target
    if not callable(target):
        raise ValueError(f"{spec!r} is neither a hetd.zoo.models.Model nor a factory returning one")
    if accepts_keyword(target, "num_classes"):
        kwargs = {"num_classes": num_classes, **kwargs}
    return _built(spec, target, kwargs)


def _built(spec: str, factory: Callable[..., object], kwargs: dict[str, Any]) -> Model:
    """``factory(**kwargs)`` checked to be a :class:`Model`; whatever the factory raises becomes
    one ValueError naming the spec (``hetd serve`` prints it as one line and exits 2)."""
    try:
        model = factory(**kwargs)
    except Exception as exc:
        why = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        raise ValueError(f"model factory {spec!r} failed: {why}") from exc
    if not isinstance(model, Model):
        raise ValueError(f"factory {spec!r} returned {type(model).__name__}, not a Model")
    return model


def param_shapes(params: Mapping[str, jax.Array | np.ndarray]) -> dict[str, tuple[int, ...]]:
    """The shape of each parameter, by path."""
    return {path: tuple(value.shape) for path, value in params.items()}


def to_numpy(params: Mapping[str, jax.Array | np.ndarray]) -> dict[str, npt.NDArray[np.float32]]:
    """Copy parameters to host as float32 numpy arrays (safe to mutate), by path."""
    return {path: np.array(value, dtype=np.float32, copy=True) for path, value in params.items()}
