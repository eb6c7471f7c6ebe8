"""Deferred evaluations for ``hetd bench --mode real --evals deferred``: the parameters at each
point of the evaluation grid, kept during the run and evaluated after it.

Owns :class:`KeptSnapshots`, the engine's keeper (:meth:`hetd.core.evals.Evaluations.keep`).
Each kept snapshot is a copy (the store's snapshot memory is reused, a slot of shared memory
among them), timestamped when it was taken. Memory is bounded by ``cap_bytes``: past the cap a
snapshot goes to ``.npy`` files in a directory of its own (removed by :meth:`close`) instead of
memory. Spilling rather than evaluating live past the cap keeps one rule for the whole run: had
the later part of a long run paid for its evaluations and the earlier part not, a time to target
would depend on the cap. Writing a copy to the page cache costs about what the copy in memory
does, far less than an evaluation, but not nothing: a 23 MB copy into fresh memory (page faults
included) took 4–45 ms of CPU here, niced at load 5, and up to 0.36 s of wall time. With
``threaded`` the copies are made by a thread of the keeper's own, one at a time in the order kept,
so the engine's task only hands the snapshot over (holding it keeps its memory, a slot of the
shared-memory ring included, until the copy is made); :meth:`evaluate` waits for them first.
"""

from __future__ import annotations

import shutil
import tempfile
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np

from hetd.core.store import Snapshot

DEFAULT_CAP_BYTES = 1 << 30  # 1 GiB of kept parameters in memory, the rest on disk


class KeptSnapshots:
    """Parameter copies with their times, in memory up to ``cap_bytes``, then on disk."""

    def __init__(
        self,
        cap_bytes: int = DEFAULT_CAP_BYTES,
        spill_dir: Path | None = None,
        threaded: bool = False,
    ) -> None:
        """``spill_dir``: where a directory for spilled snapshots is made (default: the system's
        temporary directory); ``threaded``: copy in a thread (the module docstring)."""
        if cap_bytes < 0:
            raise ValueError(f"cap_bytes must be >= 0, got {cap_bytes}")
        self.cap_bytes = cap_bytes
        self._parent = spill_dir
        self._dir: Path | None = None
        # (taken, version, tensors in memory or None, files on disk or None)
        self._kept: list[tuple[float, int, dict[str, np.ndarray] | None, dict[str, Path] | None]]
        self._kept = []
        self.memory_bytes = 0  # bytes of kept tensors in memory now
        self.peak_bytes = 0  # the most ever held in memory
        self.spilled = 0  # snapshots written to disk
        self._pool = ThreadPoolExecutor(1, "hetd-kept") if threaded else None
        self._pending: list[Future[None]] = []
        self._lock = threading.Lock()
        self._handed = 0

    def __len__(self) -> int:
        """Snapshots handed over and not evaluated yet (copied or about to be)."""
        return self._handed

    def __call__(self, snap: Snapshot, taken: float) -> None:
        """Keep a copy of ``snap``'s tensors, taken at ``taken`` (the engine's keeper): now, or
        (``threaded``) soon, in the keeper's thread."""
        self._handed += 1
        if self._pool is None:
            self._keep(snap, taken)
            return
        with self._lock:
            self._pending = [f for f in self._pending if not f.done()]
            self._pending.append(self._pool.submit(self._keep, snap, taken))

    def wait(self) -> None:
        """Until every copy handed to the thread is made (an error in one is raised here)."""
        with self._lock:
            pending, self._pending = self._pending, []
        for f in pending:
            f.result()

    def _keep(self, snap: Snapshot, taken: float) -> None:
        nbytes = sum(int(v.nbytes) for v in snap.tensors.values())
        if self.memory_bytes + nbytes <= self.cap_bytes:
            copy = {k: np.array(v, copy=True) for k, v in snap.tensors.items()}
            self._kept.append((taken, snap.version, copy, None))
            self.memory_bytes += nbytes
            self.peak_bytes = max(self.peak_bytes, self.memory_bytes)
            return
        if self._dir is None:
            self._dir = Path(tempfile.mkdtemp(prefix="hetd-evals-", dir=self._parent))
        files: dict[str, Path] = {}
        for j, (k, v) in enumerate(snap.tensors.items()):
            files[k] = self._dir / f"{len(self._kept)}-{j}.npy"
            np.save(files[k], np.asarray(v), allow_pickle=False)
        self._kept.append((taken, snap.version, None, files))
        self.spilled += 1

    def evaluate(
        self, evaluator: Callable[[Snapshot], tuple[float, float]]
    ) -> list[tuple[float, float, float]]:
        """(taken, loss, accuracy) of every kept snapshot in the order kept, each freed (memory
        or files) once evaluated."""
        self.wait()
        out = []
        for i, (taken, version, tensors, files) in enumerate(self._kept):
            if tensors is None:
                assert files is not None  # one or the other, by construction
                tensors = {k: np.load(f, allow_pickle=False) for k, f in files.items()}
                for f in files.values():
                    f.unlink()
            else:
                self.memory_bytes -= sum(int(v.nbytes) for v in tensors.values())
            loss, acc = evaluator(Snapshot(version, tensors))
            out.append((taken, loss, acc))
            self._kept[i] = (taken, version, None, None)
        self._kept = []
        self._handed = 0
        return out

    def close(self) -> None:
        """Drop whatever is kept and remove the spill directory."""
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
        self._kept = []
        self._handed = 0
        self.memory_bytes = 0
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None
