"""hetd: a parameter server for training one model on workers that are not alike.

``from hetd import Task, Shard`` is the way in for your own model, loss, data and optimizer
(:mod:`hetd.zoo.task`). They load on first use, so ``import hetd`` stays light (the daemon
listens before it imports JAX).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = ["Shard", "Task", "TaskError", "__version__"]

if TYPE_CHECKING:
    from hetd.zoo.task import Shard, Task, TaskError


def __getattr__(name: str) -> Any:
    if name in ("Task", "Shard", "TaskError"):
        from hetd.zoo import task

        return getattr(task, name)
    raise AttributeError(f"module 'hetd' has no attribute {name!r}")
