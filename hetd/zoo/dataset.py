"""A data set held in memory: :class:`Dataset`, what every loader returns (the bundled ones in
:mod:`hetd.zoo.data` and :mod:`hetd.zoo.text`, and a user's ``pkg.module:attr``), and the type of
a loader. Its own module so that the loaders and the registry that names them import it from
below, not from each other.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import numpy as np
import numpy.typing as npt

Floats = npt.NDArray[np.float32]
Ints = npt.NDArray[np.int32]


class Dataset(NamedTuple):
    """A classification data set held in memory; arrays are read-only when served from cache."""

    name: str
    x_train: Floats  # (n_train, *input_shape), images scaled to [0, 1]
    y_train: Ints  # (n_train,) labels in [0, num_classes); or (n_train, T): one per position
    x_test: Floats  # (n_test, *input_shape)
    y_test: Ints  # (n_test,)
    num_classes: int

    @property
    def input_shape(self) -> tuple[int, ...]:
        """The shape of one example, e.g. ``(784,)``."""
        return tuple(self.x_train.shape[1:])


DatasetLoader = Callable[..., Dataset]
"""Builds a :class:`Dataset`; registered loaders are called as ``loader(seed=s, **kwargs)``."""
