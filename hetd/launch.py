"""The console-script entry points ``hetd`` and ``hetd-worker``: set the process environment that
must be in place before the interpreter's first allocation, then run the real ``main``.

glibc reads ``MALLOC_MMAP_THRESHOLD_`` and ``MALLOC_TRIM_THRESHOLD_`` once, when the process starts,
so setting them from Python is too late for the running process (``mallopt`` caps the mmap threshold
at 32 MiB, below a 10M-parameter frame). Fresh memory is slow (page faults), and big frames move
several times faster from a heap that keeps its pages (docs/benchmark.md). So when a variable is
missing, the entry point re-executes the same command line (``execve``: same PID, so systemd's
``Type=notify`` is unaffected) with it set. A value the user set is kept; ``HETD_MALLOC_ENV=0``
turns the re-exec off. Only the console scripts and ``python -m hetd`` do this — calling
``hetd.cli.main.main(argv)`` from Python never re-executes.

They also point JAX's persistent compilation cache at a directory of ours (``$CACHE_DIRECTORY``
under systemd's ``CacheDirectory=``, else ``$XDG_CACHE_HOME/hetd/jax`` or ``~/.cache/hetd/jax``),
caching every compilation however short: a restarted daemon or worker loads its jitted steps instead
of compiling them (start-up with and without it: docs/benchmark.md, the system suite).
``JAX_COMPILATION_CACHE_DIR`` set by the user wins; ``HETD_JAX_CACHE=0`` turns it off.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

MALLOC_ENV = {
    "MALLOC_MMAP_THRESHOLD_": "1073741824",  # 1 GiB: big frames come from the heap, not mmap
    "MALLOC_TRIM_THRESHOLD_": "4294967296",  # 4 GiB: freed pages stay for the next frame
}


def ensure_malloc_env() -> None:
    """Re-execute this command with :data:`MALLOC_ENV` set, unless it already is (or the user
    opted out, or this is not Linux); returns only when no re-exec happened."""
    missing = {k: v for k, v in MALLOC_ENV.items() if k not in os.environ}
    if not missing or os.environ.get("HETD_MALLOC_ENV") == "0":
        return
    if not sys.platform.startswith("linux") or not sys.orig_argv:
        return
    env = {**os.environ, **missing}
    try:
        os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)
    except OSError:  # no re-exec possible: run with the default malloc settings
        return


def cache_dir() -> Path:
    """Where JAX's compilation cache goes unless the user says otherwise."""
    systemd = os.environ.get("CACHE_DIRECTORY")
    if systemd:
        return Path(systemd.split(":")[0]) / "jax"
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "hetd" / "jax"


def ensure_compile_cache() -> None:
    """Set JAX's persistent-cache variables (read when JAX is imported) unless set or opted out;
    an unusable directory means no cache, never an error."""
    if "JAX_COMPILATION_CACHE_DIR" in os.environ or os.environ.get("HETD_JAX_CACHE") == "0":
        return
    path = cache_dir()
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError:
        return
    if not os.access(path, os.W_OK):
        return
    os.environ["JAX_COMPILATION_CACHE_DIR"] = str(path)
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")


def prepare_process() -> None:
    """What every hetd process needs before it allocates or imports JAX."""
    ensure_compile_cache()
    ensure_malloc_env()


def hetd_main() -> int:
    """``hetd``: the daemon's command line (:func:`hetd.cli.main.main`)."""
    prepare_process()
    from hetd.cli.main import main

    return main()


def worker_main() -> int:
    """``hetd-worker``: the worker's command line (:func:`workers.cli.main`)."""
    prepare_process()
    from workers.cli import main

    return main()
