"""Checkpoints: the whole training state in one file, written atomically, read back with care.

This module owns the on-disk format, the state directory (names, keep-the-newest-K rotation, picking
the newest *valid* file) and how an engine's state is captured and put back.

Format: the state is a plain tree (dicts, numbers, strings, numpy arrays) made with
``flax.serialization.to_state_dict`` and serialised with ``flax.serialization.msgpack_serialize``:
flax's own format, readable with ``msgpack_restore`` and nothing of ours. It travels inside a small
envelope ``{"format": "hetd-checkpoint", "format_version": 1, "sha256": hex, "state": bytes}`` (also
flax msgpack) so a truncated or bit-flipped file is recognised and skipped instead of loaded.

Files are ``ckpt-<seq>-v<version>.msgpack`` (``seq`` grows by one per write, so the newest file is the
highest ``seq`` whatever the clocks say), written as ``.<name>.tmp`` + fsync + rename + fsync of the
directory. On start the daemon loads the newest file that decodes and verifies; each one that does not
is skipped with a warning naming it and the reason; with none left it starts fresh, with a warning. A
*valid* file that does not fit the configured model or optimizer stops start-up with
:class:`CheckpointError` instead — silently training a different model from scratch over an operator's
state directory would be worse.

Engine hooks: :func:`engine_state` and :func:`restore_engine` read and write the
engine's attributes (the engine itself resumes a returning worker's clock in ``join``).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import logging
import os
import re
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from flax import serialization

from hetd.core.engine import Engine
from hetd.core.store import Aggregator
from policies import PolicyError, WorkerFacts, make_policy

log = logging.getLogger("hetd.server.checkpoint")

FORMAT = "hetd-checkpoint"
FORMAT_VERSION = 1
_NAME = re.compile(r"^ckpt-(\d{8,})-v(\d+)\.msgpack$")


class CheckpointError(Exception):
    """A checkpoint cannot be read, or does not fit the configured model and optimizer."""


@dataclass(frozen=True, slots=True)
class CheckpointInfo:
    """One written or loaded checkpoint."""

    path: str
    seq: int
    version: int  # the parameter version it holds
    nbytes: int
    created_unix: float  # s since the epoch (wall clock, for people)

    def to_json(self) -> dict[str, Any]:
        """A plain map for the admin API."""
        return dataclasses.asdict(self)


# --- capture and restore (engine hooks; run on the engine task) -------------------------------------


def _plain(tree: Any) -> Any:
    """Host numpy copies of every array leaf (buffers may be donated by the next step)."""
    if isinstance(tree, Mapping):
        return {str(k): _plain(v) for k, v in tree.items()}
    if isinstance(tree, list | tuple):
        return [_plain(v) for v in tree]
    if hasattr(tree, "shape") and hasattr(tree, "dtype"):
        return np.array(tree, copy=True)
    return tree


_WARNED: set[str] = set()  # policies whose unserialisable state was reported once


def _policy_state(engine: Engine) -> Any:
    """The policy's state as a msgpack-able state dict, or None (it is then rebuilt by init)."""
    try:
        tree = _plain(serialization.to_state_dict(engine.policy_state))
        serialization.msgpack_serialize({"s": tree})
    except Exception as exc:
        # flax serialises dicts, tuples, NamedTuples, arrays and flax.struct dataclasses; for any
        # other state, init(view) rebuilds a valid one from the restored clocks (as on a swap).
        if engine.policy.name not in _WARNED:
            _WARNED.add(engine.policy.name)
            log.warning(
                "policy %s: its state is not serialisable (%s); a restore rebuilds it with "
                "init(view)",
                engine.policy.name,
                exc,
            )
        return None
    return tree


def engine_state(engine: Engine) -> dict[str, Any]:
    """Everything a restart needs, as a plain tree of host values. Run on the engine task.

    Parameters, optimizer state and version; the aggregation buffers (so a half-finished BSP round
    is not lost); the policy's name, parameters and state; the stage; and every worker's clock, by id and
    name, active or departed (so a reconnecting worker gets its clock back).
    """
    params, opt_state, version = engine.store.state()
    workers: dict[str, dict[str, Any]] = {}
    for active, table in ((False, engine.departed), (True, engine.facts)):
        for wid, f in table.items():
            workers[str(wid)] = {
                "name": f.name,
                "clock": f.clock,
                "samples": f.samples,
                "idle_s": f.idle_s,
                "batch_size": f.batch_size,
                "codec": f.codec,
                "active": active,
            }
    return {
        "created_unix": time.time(),
        "model": _plain(dict(engine.config.welcome.get("model", {}))),
        "version": version,
        "params": {k: np.array(v, copy=True) for k, v in params.items()},
        "opt_state": _plain(serialization.to_state_dict(opt_state)),
        "buffers": {
            str(group): _plain(agg.state()) for group, agg in engine.buffers.items() if agg.count
        },
        "policy": {
            "name": engine.policy.name,
            "params": _plain(dict(engine.policy.params)),
            "state": _policy_state(engine),
        },
        "stage": engine.stage,
        "updates_applied": engine.updates_applied,
        "next_id": engine._next_id,
        "workers": workers,
    }


def restore_engine(engine: Engine, state: Mapping[str, Any]) -> None:
    """Put a checkpoint's state into a fresh engine (before it serves anyone).

    Raises :class:`CheckpointError` when the checkpoint does not fit the engine's model or optimizer.
    A saved policy that cannot be rebuilt here (unknown name: a plug-in went missing) leaves the
    configured one in place, with a warning.
    """
    try:
        params = {k: np.asarray(v, np.float32) for k, v in state["params"].items()}
        _, target, _ = engine.store.state()
        opt_state = serialization.from_state_dict(target, state["opt_state"])
        engine.store.restore(params, opt_state, int(state["version"]))
    except (KeyError, ValueError, TypeError, AttributeError) as exc:
        raise CheckpointError(
            f"the checkpoint does not fit the configured model/optimizer "
            f"(saved model {state.get('model')!r}): {exc}"
        ) from None
    engine.buffers = {}
    for group, buf in (state.get("buffers") or {}).items():
        engine.buffers[int(group)] = Aggregator.from_state(buf)
    engine.stage = str(state.get("stage", engine.stage))
    engine.updates_applied = int(state.get("updates_applied", 0))
    now = engine.clock.now()
    ids = []
    for key, w in (state.get("workers") or {}).items():
        wid = int(key)
        ids.append(wid)
        engine.departed[wid] = WorkerFacts(
            worker=wid,
            name=str(w["name"]),
            clock=int(w["clock"]),
            version=engine.store.version,
            waiting=True,
            joined_at=now,
            samples=int(w.get("samples", 0)),
            batch_size=int(w.get("batch_size", engine.config.batch_size)),
            codec=str(w.get("codec", "none")),
            idle_s=float(w.get("idle_s", 0.0)),
        )
    engine._next_id = max([engine._next_id, int(state.get("next_id", 1)), *(i + 1 for i in ids)])
    saved = state.get("policy") or {}
    name, params = str(saved.get("name", "")), dict(saved.get("params") or {})
    try:
        policy = make_policy(name, params)
    except PolicyError as exc:
        log.warning("checkpoint policy not restored (%s); keeping %s", exc, engine.policy.name)
        return
    fresh = policy.init(engine.view())
    policy_state = fresh
    if saved.get("state") is not None and fresh is not None:
        try:
            restored = serialization.from_state_dict(fresh, saved["state"])
            if type(restored) is not type(fresh):
                raise TypeError(f"{type(restored).__name__} is not {type(fresh).__name__}")
            policy_state = restored
        except Exception as exc:  # a changed policy version: its init rebuilds a valid state
            log.warning("policy %s: saved state not restored (%s); rebuilt by init", name, exc)
    engine.policy, engine.policy_state = policy, policy_state


# --- the file format ----------------------------------------------------------------------------------


def encode(state: Mapping[str, Any]) -> bytes:
    """A state tree as checkpoint bytes (flax msgpack inside a checksummed envelope)."""
    payload: bytes = serialization.msgpack_serialize(dict(state))
    envelope = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "sha256": hashlib.sha256(payload).hexdigest(),
        "state": payload,
    }
    out: bytes = serialization.msgpack_serialize(envelope)
    return out


def decode(data: bytes) -> dict[str, Any]:
    """Checkpoint bytes back to the state tree; :class:`CheckpointError` says what is wrong."""
    try:
        envelope = serialization.msgpack_restore(data)
    except Exception as exc:
        raise CheckpointError(f"not a msgpack checkpoint (truncated?): {exc}") from None
    if not isinstance(envelope, dict) or envelope.get("format") != FORMAT:
        raise CheckpointError("not a hetd checkpoint (no format marker)")
    if envelope.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(
            f"checkpoint format version {envelope.get('format_version')!r}; "
            f"this hetd reads version {FORMAT_VERSION}"
        )
    payload = envelope.get("state")
    if not isinstance(payload, bytes):
        raise CheckpointError("checkpoint has no state payload")
    if hashlib.sha256(payload).hexdigest() != envelope.get("sha256"):
        raise CheckpointError("checksum mismatch: the file is corrupt")
    try:
        state = serialization.msgpack_restore(payload)
    except Exception as exc:
        raise CheckpointError(f"state payload does not decode: {exc}") from None
    if not isinstance(state, dict) or not {"params", "opt_state", "version"} <= set(state):
        raise CheckpointError("state payload lacks params, opt_state or version")
    return state


# --- the state directory ------------------------------------------------------------------------------


def list_checkpoints(directory: Path) -> list[tuple[int, Path]]:
    """``(seq, path)`` of every checkpoint file, newest first."""
    if not directory.is_dir():
        return []
    found = []
    for p in directory.iterdir():
        m = _NAME.match(p.name)
        if m:
            found.append((int(m.group(1)), p))
    return sorted(found, reverse=True)


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write(directory: Path, state: Mapping[str, Any], keep: int) -> CheckpointInfo:
    """Write ``state`` atomically as the newest checkpoint and delete all but the newest ``keep``.

    Blocking (serialising and fsync take a while): call it in a thread.
    """
    directory.mkdir(parents=True, exist_ok=True)
    data = encode(state)
    existing = list_checkpoints(directory)
    seq = existing[0][0] + 1 if existing else 1
    version = int(state["version"])
    final = directory / f"ckpt-{seq:08d}-v{version}.msgpack"
    tmp = directory / f".{final.name}.tmp"
    try:
        with open(tmp, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, final)
        _fsync_dir(directory)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    for _, old in list_checkpoints(directory)[keep:]:
        with contextlib.suppress(OSError):
            old.unlink()
    created = float(state.get("created_unix", time.time()))
    return CheckpointInfo(str(final), seq, version, len(data), created)


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
            data = path.read_bytes()
            state = decode(data)
        except (OSError, CheckpointError) as exc:
            log.warning("skipping checkpoint %s: %s", path, exc)
            continue
        created = float(state.get("created_unix", path.stat().st_mtime))
        return CheckpointInfo(str(path), seq, int(state["version"]), len(data), created), state
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
        self.last = info
        log.warning(
            "resumed from %s: version %d, policy %s, %d workers known",
            info.path,
            info.version,
            engine.policy.name,
            len(engine.departed),
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
            if state is None:
                state = await engine.call(lambda: engine_state(engine))
            info = await asyncio.to_thread(self._write, state)
            self.last, self.written = info, self.written + 1
            log.info("checkpoint %s (version %d, %d bytes)", info.path, info.version, info.nbytes)
            return info

    async def run_timer(self, engine: Engine, interval_s: float) -> None:
        """Checkpoint every ``interval_s`` when the version moved; errors are logged, not fatal."""
        while True:
            await asyncio.sleep(interval_s)
            if self.last is not None and self.last.version == engine.store.version:
                continue  # nothing new to keep
            try:
                await self.save(engine)
            except Exception:
                log.exception("timed checkpoint into %s failed", self.directory)
