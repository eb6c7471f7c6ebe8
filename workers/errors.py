"""What ends a worker: :class:`FatalError`, raised where retrying cannot help."""

from __future__ import annotations


class FatalError(RuntimeError):
    """Retrying will not help (wrong token, refused codec): the worker exits."""
