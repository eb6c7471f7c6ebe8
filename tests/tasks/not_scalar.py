"""A Task whose loss is not a scalar: the daemon refuses it at start-up."""

import jax.numpy as jnp
import numpy as np

from hetd import Task


def _data(shard):
    while True:
        yield {"x": np.ones((shard.batch_size, 2), np.float32)}


task = Task(
    lambda key: {"w": jnp.zeros(2)},
    lambda p, b, k: b["x"] @ p["w"],
    _data,
    lambda: iter([{"x": np.ones((4, 2), np.float32)}]),
)
