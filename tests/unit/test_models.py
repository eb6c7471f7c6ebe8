"""The model registry: flat parameters, gradients by path, training works, plug-ins resolve."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from hetd.zoo import models
from hetd.zoo.data import BatchSampler, load_dataset
from hetd.zoo.models import Model, Params


# A user's own model, written in plain JAX, referenced below as "tests.unit.test_models:...".
def tiny_linear(num_classes: int = 10, scale: float = 0.01) -> Model:
    """A linear classifier; a factory taking ``num_classes`` and an option."""

    def init(key: jax.Array, input_shape: tuple[int, ...]) -> Params:
        features = int(np.prod(input_shape))
        w = scale * jax.random.normal(key, (features, num_classes))
        return {"linear/w": w, "linear/b": jnp.zeros((num_classes,))}

    def logits(params: Params, x: jax.Array) -> jax.Array:
        return jnp.dot(x.reshape((x.shape[0], -1)), params["linear/w"]) + params["linear/b"]

    def loss(params: Params, x: jax.Array, y: jax.Array) -> jax.Array:
        return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits(params, x), y))

    def accuracy(params: Params, x: jax.Array, y: jax.Array) -> jax.Array:
        return jnp.mean(jnp.argmax(logits(params, x), -1) == y)

    return Model("tiny_linear", init, loss, accuracy, logits)


def three_class_linear() -> Model:
    """A zero-argument factory."""
    return tiny_linear(3)


TINY_MODEL = tiny_linear(3)
NOT_A_MODEL = 42


@pytest.fixture(scope="module")
def digits():  # type: ignore[no-untyped-def]
    return load_dataset("digits")


def test_init_gives_flat_paths_and_shapes() -> None:
    model = models.get_model("mlp", 10, hidden=(32, 16))
    params = model.init(jax.random.key(0), (64,))
    assert models.param_shapes(params) == {
        "Dense_0/kernel": (64, 32),
        "Dense_0/bias": (32,),
        "Dense_1/kernel": (32, 16),
        "Dense_1/bias": (16,),
        "Dense_2/kernel": (16, 10),
        "Dense_2/bias": (10,),
    }
    assert all(isinstance(v, jax.Array) for v in params.values())


def test_grad_has_the_same_paths_and_shapes(digits) -> None:  # type: ignore[no-untyped-def]
    model = models.get_model("mlp", digits.num_classes)
    params = model.init(jax.random.key(1), digits.input_shape)
    grads = jax.jit(jax.grad(model.loss))(params, digits.x_train[:16], digits.y_train[:16])
    assert isinstance(grads, dict)
    assert models.param_shapes(grads) == models.param_shapes(params)


def test_to_numpy_copies_as_float32() -> None:
    params = models.get_model("mlp", 10).init(jax.random.key(0), (64,))
    host = models.to_numpy(params)
    assert set(host) == set(params)
    assert all(isinstance(v, np.ndarray) and v.dtype == np.float32 for v in host.values())
    host["Dense_0/bias"] += 1.0  # a copy: mutating it leaves the model's parameters alone
    assert float(jnp.abs(params["Dense_0/bias"]).max()) == 0.0


def test_mlp_trains_to_90_percent_on_digits(digits) -> None:  # type: ignore[no-untyped-def]
    model = models.get_model("mlp", digits.num_classes)
    params = model.init(jax.random.key(0), digits.input_shape)
    opt = optax.adam(1e-2)
    state = opt.init(params)

    @jax.jit
    def step(params: Params, state: optax.OptState, x: jax.Array, y: jax.Array):  # type: ignore[no-untyped-def]
        loss, grads = jax.value_and_grad(model.loss)(params, x, y)
        updates, state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), state, loss

    sampler = BatchSampler(digits.x_train, digits.y_train, seed=0)
    for _ in range(300):
        params, state, _loss = step(params, state, *sampler.next(64))
    accuracy = float(jax.jit(model.accuracy)(params, digits.x_test, digits.y_test))
    assert accuracy > 0.9
    assert set(params) == {"Dense_0/kernel", "Dense_0/bias", "Dense_1/kernel", "Dense_1/bias"}


@pytest.mark.slow  # trains a model for seconds: `make test` runs it, `make test-fast` does not
def test_cnn_takes_images_or_flat_squares_and_learns(digits) -> None:  # type: ignore[no-untyped-def]
    model = models.get_model("cnn", 10, features=(8, 16), dense=32)
    images = digits.x_train[:64].reshape(-1, 8, 8, 1)
    y = digits.y_train[:64]
    params = model.init(jax.random.key(0), (8, 8, 1))
    assert models.param_shapes(model.init(jax.random.key(0), (64,))) == models.param_shapes(params)
    logits = jax.jit(model.logits)
    assert logits(params, images).shape == (64, 10)
    np.testing.assert_allclose(
        logits(params, images), logits(params, digits.x_train[:64]), rtol=1e-5
    )
    loss_and_grad = jax.jit(jax.value_and_grad(model.loss))
    first, grads = loss_and_grad(params, images, y)
    assert models.param_shapes(grads) == models.param_shapes(params)
    for _ in range(5):
        _, grads = loss_and_grad(params, images, y)
        params = jax.tree.map(lambda p, g: p - 0.5 * g, params, grads)
    assert float(loss_and_grad(params, images, y)[0]) < float(first)


def test_cnn_rejects_flat_non_square_inputs() -> None:
    with pytest.raises(ValueError, match="not a square"):
        models.get_model("cnn", 10).init(jax.random.key(0), (50,))


def test_plugin_model_object_and_factories() -> None:
    assert models.get_model("tests.unit.test_models:TINY_MODEL", 3) is TINY_MODEL
    built = models.get_model("tests.unit.test_models:tiny_linear", 4, scale=0.0)
    params = built.init(jax.random.key(0), (8, 8, 1))
    assert models.param_shapes(params) == {"linear/w": (64, 4), "linear/b": (4,)}
    zero_arg = models.get_model("tests.unit.test_models:three_class_linear", 3)
    assert zero_arg.init(jax.random.key(0), (5,))["linear/b"].shape == (3,)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("resnet", r"unknown model 'resnet'; known models: \['cnn', 'mlp'"),
        ("no_such_pkg.mod:thing", "cannot import module 'no_such_pkg.mod'"),
        ("tests.unit.test_models:missing", "has no attribute 'missing'"),
        ("tests.unit.test_models:NOT_A_MODEL", "neither a hetd.zoo.models.Model nor a factory"),
        ("tests.unit.test_models:", "must look like 'pkg.module:attr'"),
    ],
)
def test_bad_specs_say_what_is_wrong(spec: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        models.get_model(spec, 10)


def test_register_model(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(models, "_REGISTRY", dict(models._REGISTRY))
    models.register_model("linear", tiny_linear)
    assert models.model_names() == ["cnn", "linear", "mlp", "transformer"]
    assert models.get_model("linear", 7).init(jax.random.key(0), (2,))["linear/b"].shape == (7,)
    with pytest.raises(ValueError, match="already registered"):
        models.register_model("mlp", tiny_linear)
    with pytest.raises(ValueError, match="no ':'"):
        models.register_model("a:b", tiny_linear)
