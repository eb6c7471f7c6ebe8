"""Files the daemon writes, written so that nothing planted in their place is followed:
checkpoints (:mod:`hetd.server.checkpoint`) and exports (:mod:`hetd.server.export`).

A temp file is created exclusively (``O_CREAT | O_EXCL | O_NOFOLLOW``) under a fresh random name
beside its final name, written, fsynced, then renamed over the final name (a rename replaces a
link there, never its target). A symlink planted at the temp file's name, or at the final name,
cannot redirect the write. ``mode``: the file's permissions whatever the umask (checkpoints:
``0o600``, they hold the workers' resume secrets); None: ``0o644`` less the umask, as ``open``
would give.

:func:`under_root` turns a name a client gave (``POST /v1/export {"out": ...}``) into a directory
under a root the operator configured, refusing absolute paths, ``..`` and symlinked components.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import stat
from collections.abc import Callable
from pathlib import Path, PurePosixPath
from typing import IO

_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
MAX_NAME = 200  # characters of a client's name repeated in a refusal


class Refused(ValueError):
    """A write the daemon will not make; ``status`` and ``code`` are what the admin API answers."""

    def __init__(self, message: str, status: int = 400, code: str = "bad_out") -> None:
        super().__init__(message)
        self.status = status
        self.code = code


class UnsafePath(Refused):
    """A path a client gave that would leave the root or go through a link (400)."""


def temp_path(final: Path) -> Path:
    """A fresh, unguessable temp name beside ``final`` (``.<name>.<random>.tmp``)."""
    return final.with_name(f".{final.name}.{secrets.token_hex(8)}.tmp")


def create_exclusive(path: Path, mode: int | None = None) -> int:
    """A new file at ``path`` opened for writing; FileExistsError when anything is there (a file,
    a directory, a symlink, dangling or not). ``mode``: set exactly, whatever the umask."""
    fd = os.open(path, _FLAGS, 0o644 if mode is None else mode)
    if mode is not None:
        try:
            os.fchmod(fd, mode)
        except BaseException:
            os.close(fd)
            raise
    return fd


def fsync_dir(directory: Path) -> None:
    """Make a rename in ``directory`` durable."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(
    final: Path, fill: Callable[[IO[bytes]], int] | bytes, mode: int | None = None
) -> int:
    """Write ``final`` through an exclusively created temp file beside it and an atomic rename;
    ``fill`` writes the content into the open file and returns its size (or is the bytes).
    Returns the size. The temp file is removed when anything fails."""
    for _ in range(8):  # a name already taken is tried again under another
        tmp = temp_path(final)
        try:
            fd = create_exclusive(tmp, mode)
        except FileExistsError:
            continue
        break
    else:
        raise FileExistsError(f"cannot create a temp file beside {final}")
    try:
        with os.fdopen(fd, "wb") as fh:
            if isinstance(fill, bytes):
                fh.write(fill)
                nbytes = len(fill)
            else:
                nbytes = fill(fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, final)
        fsync_dir(final.parent)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    return nbytes


def _shown(name: str) -> str:
    text = repr(name)
    return text if len(text) <= MAX_NAME else text[:MAX_NAME] + "..."


def relative_parts(name: str) -> tuple[str, ...]:
    """The components of ``name`` as a relative path; :class:`UnsafePath` for an absolute path,
    ``..``, an empty name, a NUL or a control character."""
    if not name or not name.isprintable():
        raise UnsafePath(f"{_shown(name)} is not a usable name (empty, or control characters)")
    path = PurePosixPath(name)
    if path.is_absolute() or name.startswith("~"):
        raise UnsafePath(f"{_shown(name)} is an absolute path; give a name under the export root")
    parts = tuple(p for p in path.parts if p != ".")
    if ".." in parts:
        raise UnsafePath(f"{_shown(name)} leaves the export root ('..' is refused)")
    if not parts:
        raise UnsafePath(f"{_shown(name)} names the export root itself; give a name under it")
    return parts


def under_root(root: Path, name: str, create: bool = True) -> Path:
    """The directory ``root/name``, made (``create``) one component at a time as ``mkdir``
    makes them; :class:`UnsafePath` when ``name`` is absolute, has ``..``, or any component
    under the root is a symlink or not a directory. The root itself is the operator's: it is
    created when missing and may be a link (it is resolved once)."""
    parts = relative_parts(name)
    if create:
        root.mkdir(parents=True, exist_ok=True)
    here = root.resolve()
    for i, part in enumerate(parts):
        here = here / part
        if create:
            with contextlib.suppress(FileExistsError):
                os.mkdir(here)
        try:
            info = os.lstat(here)
        except FileNotFoundError:
            if create:
                raise
            continue
        if stat.S_ISLNK(info.st_mode):
            shown = "/".join(parts[: i + 1])
            raise UnsafePath(
                f"{_shown(name)}: {shown!r} under the export root is a symbolic link; exports "
                "never follow one"
            )
        if not stat.S_ISDIR(info.st_mode):
            raise UnsafePath(f"{_shown(name)}: {'/'.join(parts[: i + 1])!r} is not a directory")
    return here
