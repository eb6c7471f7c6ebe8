"""An attribute that is another object's, read (and written) through a dotted path.

``facts: Forward[Mapping[int, WorkerFacts]] = Forward("members.facts")`` on a class makes
``obj.facts`` read ``obj.members.facts``: the engine shows what its parts own without holding a
copy that could drift from them.
"""

from __future__ import annotations

import functools
from typing import Any, Generic, TypeVar, overload

T = TypeVar("T")


class Forward(Generic[T]):
    """A descriptor reading (and writing) ``path`` from the instance it is read on."""

    def __init__(self, path: str) -> None:
        *self._via, self._name = path.split(".")
        self.__doc__ = f"The same as ``.{path}``."

    def _owner(self, obj: object) -> Any:
        return functools.reduce(getattr, self._via, obj)

    @overload
    def __get__(self, obj: None, owner: type | None = None) -> Forward[T]: ...

    @overload
    def __get__(self, obj: object, owner: type | None = None) -> T: ...

    def __get__(self, obj: object | None, owner: type | None = None) -> Forward[T] | T:
        if obj is None:
            return self
        value: T = getattr(self._owner(obj), self._name)
        return value

    def __set__(self, obj: object, value: T) -> None:
        setattr(self._owner(obj), self._name, value)
