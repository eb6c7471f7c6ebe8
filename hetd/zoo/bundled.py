"""The bundled models and data sets as Tasks: ``[train] model`` and ``dataset`` (``mlp`` on
``mnist5k``, ``transformer`` on ``pydoc``, ...) become a :class:`ZooTask` built the same way as a
user's, so the daemon and the workers train both through one path.

Its parameters keep the flat ``Dense_0/kernel`` names; its loss is the model's mean
cross-entropy with the accuracy as a metric, computed per example (``per_example``: a plan's
batch is computed exactly); ``train_data`` draws from this worker's shard of the training set
(ASHL's data shares, a seeded permutation's range, when the plan gives one), reshuffled every
epoch, without end; ``eval_data`` is the whole test set as one batch. The :class:`Model` and
:class:`Dataset` stay on the task for what needs them (pipeline stages, the simulator).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import jax
import numpy as np

from hetd.zoo.data import BatchSampler, Dataset, load_dataset, shard_indices, share_indices
from hetd.zoo.models import Model, get_model
from hetd.zoo.task import Shard, Task, TaskError, reason


class ZooTask(Task):
    """A bundled model on a bundled (or plug-in) data set, as a Task."""

    __slots__ = ("data", "model")

    def __init__(self, model: Model, data: Dataset, seed: int) -> None:
        self.model = model
        self.data = data

        def init(key: jax.Array) -> Any:
            return model.init(key, data.input_shape)

        def loss(params: Any, batch: Mapping[str, jax.Array], key: jax.Array) -> Any:
            x, y = batch["x"], batch["y"]
            return model.loss(params, x, y), {"accuracy": model.accuracy(params, x, y)}

        def train_data(shard: Shard) -> Iterator[dict[str, np.ndarray]]:
            n = len(data.y_train)
            if shard.share is not None:
                idx = share_indices(n, *shard.share, seed)
            else:
                idx = shard_indices(n, shard.index, shard.count, seed)
            sampler = BatchSampler(
                data.x_train[idx], data.y_train[idx], seed=seed * 1000 + shard.index
            )
            while True:
                x, y = sampler.next(shard.batch_size)
                yield {"x": x, "y": y}

        def eval_data() -> Iterator[dict[str, np.ndarray]]:
            yield {"x": data.x_test, "y": data.y_test}

        super().__init__(
            init, loss, train_data, eval_data, name=f"{model.name}@{data.name}", per_example=True
        )


def zoo_task(setup: Mapping[str, Any]) -> ZooTask:
    """The task a welcome's (or ``/v1/prepare``'s, or a config's) ``model`` and ``dataset`` parts
    name; :class:`TaskError` when the model's outputs do not fit the data set's labels."""
    model_spec, data_spec = setup["model"], setup["dataset"]
    seed = int(data_spec.get("seed", 0))
    data = load_dataset(data_spec["spec"], seed=seed, **dict(data_spec.get("kwargs", {})))
    model = get_model(model_spec["spec"], data.num_classes, **dict(model_spec.get("kwargs", {})))
    check_outputs(model, data, model_spec["spec"], data_spec["spec"])
    return ZooTask(model, data, seed)


def check_outputs(model: Model, data: Dataset, model_name: str, data_name: str) -> None:
    """What the model produces for one example (shapes only, nothing computed) against the data
    set's classes: a model of 3 outputs on 10 classes would train to a NaN loss and be refused
    push after push without saying why."""
    key = jax.random.PRNGKey(0)
    try:
        params = jax.eval_shape(lambda k: model.init(k, data.input_shape), key)
        out = jax.eval_shape(model.logits, params, data.x_train[:1])
    except Exception as exc:
        raise TaskError(
            f"model {model_name!r} cannot take data set {data_name!r}'s examples of shape "
            f"{data.input_shape}: {reason(exc)}"
        ) from exc
    outputs = int(out.shape[-1]) if out.shape else 0
    labels = int(np.max(data.y_train)) + 1 if data.y_train.size else 0
    if outputs != data.num_classes or labels > outputs:
        raise TaskError(
            f"model {model_name!r} has {outputs} outputs but data set {data_name!r} has "
            f"{data.num_classes} classes (labels up to {labels - 1}): give the model "
            f"num_classes={data.num_classes}"
        )
