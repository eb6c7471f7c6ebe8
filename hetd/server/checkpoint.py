"""Checkpoints: the whole training state in one file, written atomically, read back with care.

This module owns the on-disk format, the state directory (names, a rotation that keeps the newest K
*valid* files, picking the newest valid file) and how an engine's state is captured and put back.

Format: the state is a plain tree (dicts, numbers, strings, numpy arrays) made with
``flax.serialization.to_state_dict``, in flax's msgpack format: readable with ``msgpack_restore`` and
nothing of ours. It travels inside a small envelope ``{"format": "hetd-checkpoint", "format_version":
1, "state": bytes, "sha256": hex}`` (msgpack) so a truncated or bit-flipped file is recognised and
skipped instead of loaded. :mod:`hetd.server.ckpt_file` streams it to the file from the arrays' own
memory and reads it back without copying the payload out; after a write or a load the freed heap goes
back to the system.

Files are ``ckpt-<seq>-v<version>.msgpack`` (``seq`` grows by one per write), written as
``.<name>.<random>.tmp`` (created exclusively, never through a link) + fsync + rename + fsync
of the directory, mode 0600 whatever the umask (the file holds the workers' resume secrets).
**The newest checkpoint is the one with the highest version; of two with the same version, the
later write (the higher ``seq``).** Never the
file's time: clocks move, and a copied file gets a new one. Training only ever raises the version,
so in one daemon's life the two orders agree; the rule decides when they do not (a directory that
two daemons wrote into before it was locked, :mod:`hetd.server.statedir`): the most trained state
wins. Rotation and the resume both rank files by it. On start the daemon loads the newest file
that decodes and verifies; each one that does not is skipped with a warning naming it and the
reason; with none left it starts fresh, with a warning. A
*valid* file that does not fit the configured model or optimizer stops start-up with
:class:`CheckpointError` instead — silently training a different model from scratch over an operator's
state directory would be worse.

Engine hooks: :func:`engine_state` and :func:`restore_engine` turn the engine's typed
:class:`~hetd.core.engine.EngineState` (:meth:`Engine.state <hetd.core.engine.Engine.state>`,
:meth:`Engine.restore <hetd.core.engine.Engine.restore>`) into the file's plain tree and back (the
engine itself resumes a returning worker's clock in ``join``). The policy's state is saved as a
tagged tree with the engine clock it was taken at, and a restore moves its times to the new clock
(:mod:`hetd.server.policy_state`), so every built-in policy resumes where it was, in the stage it
was in.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import logging
import re
import threading
import time
from collections.abc import Awaitable, Callable, Mapping
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
from flax import serialization

from hetd.core.engine import Engine
from hetd.core.saved import EngineState, SavedWorker
from hetd.pserver.log import DecisionLog
from hetd.server import ckpt_file, safe_files
from hetd.server.ckpt_file import FORMAT, FORMAT_VERSION, CheckpointError, decode
from hetd.server.ckpt_file import CheckpointInfo as CheckpointInfo
from hetd.server.policy_state import plain, policy_state_tree, revive_policy_state

log = logging.getLogger("hetd.server.checkpoint")

__all__ = ["FORMAT", "FORMAT_VERSION", "CheckpointError", "Checkpointer", "decode", "encode"]

CHECKPOINT_MODE = 0o600  # the file holds every worker's resume secret: its owner's alone
_NAME = re.compile(r"^ckpt-(\d{8,})-v(\d+)\.msgpack$")


# --- capture and restore (engine hooks; run on the engine task) -------------------------------------


def engine_state(engine: Engine) -> dict[str, Any]:
    """Everything a restart needs (:meth:`Engine.state <hetd.core.engine.Engine.state>`) as the
    file's plain tree of host values. Run on the engine task."""
    st = engine.state()
    workers = {
        str(wid): {
            "name": w.name,
            "clock": w.clock,
            "samples": w.samples,
            "idle_s": w.idle_s,
            "batch_size": w.batch_size,
            "codec": w.codec,
            "active": w.active,
            "last_push": w.last_push,
            "secret": w.secret,
        }
        for wid, w in st.workers.items()
    }
    return {
        "created_unix": time.time(),
        "model": plain(dict(engine.config.welcome.get("model", {}))),
        "version": st.version,
        "params": dict(st.params),
        "opt_state": plain(serialization.to_state_dict(st.opt_state), copy=False),
        "outer_optimizer": engine.store.outer_spec,  # opt_state's outer part is this one's
        "buffers": {str(group): plain(buf, copy=False) for group, buf in st.buffers.items()},
        "policy": {
            "name": st.policy,
            "params": plain(dict(st.policy_params)),
            "state": policy_state_tree(st.policy, st.policy_state),
            "clock": engine.clock.now(),  # the engine clock its times are relative to
        },
        "stage": st.stage,
        "updates_applied": st.updates_applied,
        "next_id": st.next_id,
        "workers": workers,
        **log_state(engine),
    }


def log_state(engine: Engine) -> dict[str, str]:
    """With a decision log (after :meth:`Engine.state` logged its checkpoint entry): the log's
    place (:meth:`DecisionLog.state`) and that entry's name, as one JSON string under
    ``"decisions"``; nothing without one."""
    log = engine.store.decisions
    if not isinstance(log, DecisionLog):
        return {}
    return {"decisions": json.dumps({**log.state(), "ref": engine.applier.checkpoint_ref or ""})}


def _resume_log(engine: Engine, state: Mapping[str, Any]) -> str | None:
    """A checkpoint's log place into the engine's decision log (when both have one); the name
    of the checkpoint entry its restore entry names (None: the engine's default)."""
    log, saved = engine.store.decisions, state.get("decisions")
    if not isinstance(log, DecisionLog) or not saved:
        return None  # no log kept now, or none kept then (the log starts at position 0)
    place = json.loads(str(saved))
    log.resume(place)
    return str(place.get("ref") or "") or None


def restore_engine(engine: Engine, state: Mapping[str, Any]) -> None:
    """Put a checkpoint's tree into a fresh engine (before it serves anyone) through
    :meth:`Engine.restore <hetd.core.engine.Engine.restore>`.

    Raises :class:`CheckpointError` when the checkpoint does not fit the engine's model or optimizer.
    A saved policy that cannot be rebuilt here (unknown name: a plug-in went missing) leaves the
    configured one in place, with a warning.
    """
    batch = engine.config.batch_size
    try:
        ref = _resume_log(engine, state)
        if state.get("outer_optimizer"):  # a swap changed it: the saved state is that one's
            engine.store.set_outer(str(state["outer_optimizer"]))
        _, target, _ = engine.store.state()
        saved = state.get("policy") or {}
        typed = EngineState(
            params={k: np.asarray(v, np.float32) for k, v in state["params"].items()},
            opt_state=serialization.from_state_dict(target, state["opt_state"]),
            version=int(state["version"]),
            buffers={int(g): buf for g, buf in (state.get("buffers") or {}).items()},
            policy=str(saved.get("name", "")),
            policy_params=dict(saved.get("params") or {}),
            policy_state=saved.get("state"),
            stage=str(state.get("stage", engine.host.stage)),
            updates_applied=int(state.get("updates_applied", 0)),
            next_id=int(state.get("next_id", 1)),
            workers={
                int(key): SavedWorker(
                    name=str(w["name"]),
                    clock=int(w["clock"]),
                    samples=int(w.get("samples", 0)),
                    idle_s=float(w.get("idle_s", 0.0)),
                    batch_size=int(w.get("batch_size", batch)),
                    codec=str(w.get("codec", "none")),
                    active=bool(w.get("active", False)),
                    last_push=int(w.get("last_push", 0)),
                    secret=str(w.get("secret", "")),
                )
                for key, w in (state.get("workers") or {}).items()
            },
        )
        saved_clock = saved.get("clock")
        dt = engine.clock.now() - float(saved_clock) if saved_clock is not None else 0.0
        engine.restore(typed, revive=partial(revive_policy_state, typed.policy, dt), ref=ref)
    except (KeyError, ValueError, TypeError, AttributeError) as exc:
        raise CheckpointError(
            f"the checkpoint does not fit the configured model/optimizer "
            f"(saved model {state.get('model')!r}): {exc}"
        ) from None


# --- the file format (hetd.server.ckpt_file) --------------------------------------------------------


def encode(state: Mapping[str, Any]) -> bytes:
    """A state tree as checkpoint bytes (flax msgpack inside a checksummed envelope)."""
    buf = io.BytesIO()
    ckpt_file.write_to(buf, state)
    return buf.getvalue()


# --- the state directory ------------------------------------------------------------------------------


def list_checkpoints(directory: Path) -> list[tuple[int, Path]]:
    """``(seq, path)`` of every checkpoint file, newest first: the highest version first, and of
    one version the highest ``seq`` (the module's rule)."""
    if not directory.is_dir():
        return []
    found = []
    for p in directory.iterdir():
        m = _NAME.match(p.name)
        if m:
            found.append((int(m.group(2)), int(m.group(1)), p))
    return [(seq, p) for _, seq, p in sorted(found, reverse=True)]


def write(directory: Path, state: Mapping[str, Any], keep: int) -> CheckpointInfo:
    """Write ``state`` atomically as the newest checkpoint, then rotate: keep the newest ``keep``
    *valid* checkpoints (this one included) and delete the rest, invalid ones too.

    Blocking (serialising, fsync and verifying older files take a while): call it in a thread.
    """
    directory.mkdir(parents=True, exist_ok=True)
    existing = list_checkpoints(directory)
    seq = max((s for s, _ in existing), default=0) + 1  # after every write, whatever its version
    version = int(state["version"])
    final = directory / f"ckpt-{seq:08d}-v{version}.msgpack"
    # streamed (no copy of the state in memory) into an exclusively created temp file, never
    # through a link planted at its name; 0600 whatever the umask: it holds the resume secrets
    nbytes = safe_files.write_atomic(
        final, lambda fh: ckpt_file.write_to(fh, state), mode=CHECKPOINT_MODE
    )
    _rotate(directory, keep, final)
    created = float(state.get("created_unix", time.time()))
    return CheckpointInfo(str(final), seq, version, nbytes, created)


def _rotate(directory: Path, keep: int, written: Path) -> None:
    """Keep the newest ``keep`` checkpoints that verify (``written``, just written, counts as one
    without being read back); delete every other, an invalid one with a warning. Files older than
    the ``keep``-th valid one are deleted unread."""
    kept = 0
    for _, path in list_checkpoints(directory):
        if kept < keep:
            if path == written:
                kept += 1
                continue
            try:
                ckpt_file.verify(path)  # the hash over the mapped file; the state is not decoded
            except (OSError, CheckpointError) as exc:
                log.warning("deleting checkpoint %s: it does not verify (%s)", path, exc)
            else:
                kept += 1
                continue
        with contextlib.suppress(OSError):
            path.unlink()


def load_newest(directory: Path) -> tuple[CheckpointInfo, dict[str, Any]] | None:
    """The newest checkpoint that reads and verifies; each bad one is skipped with a warning.

    Leftover temp files (a crash mid-write) are removed. ``None`` when no valid checkpoint exists.
    """
    if directory.is_dir():
        for p in directory.glob(".ckpt-*.tmp"):
            log.warning("removing %s: an unfinished checkpoint write", p)
            with contextlib.suppress(OSError):
                p.unlink()
    candidates = list_checkpoints(directory)
    for seq, path in candidates:
        try:
            state = ckpt_file.read(path)
            stat = path.stat()
        except (OSError, CheckpointError) as exc:
            log.warning("skipping checkpoint %s: %s", path, exc)
            continue
        created = float(state.get("created_unix", stat.st_mtime))
        return CheckpointInfo(str(path), seq, int(state["version"]), stat.st_size, created), state
    if candidates:
        log.warning("no valid checkpoint in %s: starting fresh", directory)
    return None


class Checkpointer:
    """Writes an engine's checkpoints into one directory, one at a time (timer, API, SIGTERM)."""

    def __init__(self, directory: str | Path, keep: int) -> None:
        self.directory = Path(directory)
        self.keep = keep
        self.last: CheckpointInfo | None = None  # the newest written or loaded
        self.written = 0  # checkpoints written by this process
        self._lock = asyncio.Lock()
        self._thread_lock = threading.Lock()
        # with a decision log: the last position every pserver still reading it has saved its
        # slice at (their records are kept after it); None: no pserver reads the log, so each
        # checkpoint written lets the log forget the records up to it
        self.log_floor: Callable[[], int] | None = None
        # a head that holds no parameters: awaited with the checkpoint entry's log position
        # before the file is written, True once every pserver saved its slice there (the file
        # names those slices); None: the file is the whole checkpoint
        self.commit: Callable[[int], Awaitable[bool]] | None = None

    def restore(self, engine: Engine) -> CheckpointInfo | None:
        """Load the newest valid checkpoint into ``engine`` (before it runs); None: fresh start."""
        found = load_newest(self.directory)
        if found is None:
            log.info("no checkpoint in %s: starting fresh", self.directory)
            return None
        info, state = found
        try:
            restore_engine(engine, state)
        except CheckpointError as exc:
            raise CheckpointError(
                f"{info.path}: {exc}. Point [store] dir (--state-dir) elsewhere to start fresh."
            ) from None
        del state, found  # the file's arrays: the store holds its own copies now
        ckpt_file.release_memory()
        self.last = info
        log.warning(
            "resumed from %s: version %d, policy %s, %d workers known",
            info.path,
            info.version,
            engine.host.policy.name,
            len(engine.members.departed),
        )
        return info

    def _write(self, state: Mapping[str, Any]) -> CheckpointInfo:
        # A cancelled save (the timer, at stop) leaves its thread running: the thread lock keeps
        # two writes from picking the same sequence number.
        with self._thread_lock:
            return write(self.directory, state, self.keep)

    async def save(self, engine: Engine, state: Mapping[str, Any] | None = None) -> CheckpointInfo:
        """Capture the engine's state on its task (unless given) and write it off the loop."""
        async with self._lock:
            if state is None:  # (in a list the future does not keep: it is freed after the write)
                box = await engine.queue.call(lambda: [engine_state(engine)])
                state = box.pop()
            saved_log = state.get("decisions")
            if self.commit is not None and saved_log:
                position = int(json.loads(str(saved_log))["position"])
                if not await self.commit(position):
                    raise CheckpointError(
                        f"the pservers did not all save their slices at position {position}: "
                        "no checkpoint written (the last one stands)"
                    )
            info = await asyncio.to_thread(self._write, state)
            # The capture (a copy of the parameters and optimizer state) is freed here; the heap's
            # free pages go back to the system, so a checkpoint leaves the resting RSS as it was.
            state = None
            await asyncio.to_thread(ckpt_file.release_memory, collect=True)
            self.last, self.written = info, self.written + 1
            log.info("checkpoint %s (version %d, %d bytes)", info.path, info.version, info.nbytes)
            if saved_log:
                await self._forget(engine, int(json.loads(str(saved_log))["position"]))
            return info

    async def _forget(self, engine: Engine, written: int) -> None:
        """Let the decision log forget what no reader needs: up to the checkpoint just written
        (at position ``written``) when no pserver reads it, else up to where they all saved."""
        upto = written if self.log_floor is None else min(written, self.log_floor())
        decisions = engine.store.decisions
        if isinstance(decisions, DecisionLog) and upto >= decisions.first:
            await engine.queue.call(lambda: decisions.compact(upto))

    async def run_timer(self, engine: Engine, interval_s: float) -> None:
        """Checkpoint every ``interval_s`` when the version moved; errors are logged, not fatal.
        The ticks are at a fixed rate (each ``interval_s`` after the last tick, not after the
        last save ended), so a slow save on a loaded machine does not stretch what a kill can
        lose beyond one interval plus the save in progress; ticks a save overran are skipped."""
        loop = asyncio.get_running_loop()
        next_at = loop.time()
        while True:
            next_at += interval_s
            now = loop.time()
            if next_at < now:  # a save overran whole intervals: the next tick from now on
                next_at = now + interval_s - (now - next_at) % interval_s
            await asyncio.sleep(next_at - now)
            if self.last is not None and self.last.version == engine.store.version:
                continue  # nothing new to keep
            try:
                await self.save(engine)
            except Exception:
                log.exception("timed checkpoint into %s failed", self.directory)
