"""What a task that cannot be loaded or used raises: :class:`TaskError`, in one line, and
:func:`reason`, an exception cut to that line. Below every module that checks a task
(:mod:`hetd.zoo.task`, :mod:`hetd.zoo.flax_tasks`, ...), so none of them imports another for its
errors; ``hetd.TaskError`` and ``hetd.zoo.task.TaskError`` are this class.
"""

from __future__ import annotations


class TaskError(ValueError):
    """A task that cannot be loaded or used, in one line that names it and what is wrong."""


def reason(exc: BaseException) -> str:
    """``exc`` as ``Type: first line of its message`` (or its type alone), for a TaskError."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__
