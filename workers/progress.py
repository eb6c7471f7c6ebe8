"""What a worker tells its operator at the default log level: its join (worker id, shard, plan,
the path its parameters and pushes take), a progress line every ``every_s`` seconds (pushes,
samples/s, staleness, the version it trains on), each change of its plan or of the daemon's
training stage, and why it leaves (printed by :mod:`workers.cli`).

These lines go to the ``hetd.worker.progress`` logger, which ``hetd-worker`` shows at INFO by
default; the connection details of ``hetd.worker`` stay behind ``-v``. The bookkeeping here is
pure (the clock is injected); only :meth:`Progress.run` sleeps.

Staleness, as a worker sees it: the versions the daemon applied from others between two of its
steps (``v_next - v_this - 1``), which is how stale its push was when the daemon applied it; for
a synchronous policy it is 0.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from hetd.protocol.plan import Plan

log = logging.getLogger("hetd.worker.progress")

# Plan fields a policy may change every round (lbbsp and hps size each worker's batch per
# round): shown in the progress line, not logged as a change each time.
_EVERY_ROUND = ("batch_size", "local_time_s", "commit_quota")


def plan_text(plan: Plan) -> str:
    """A plan in a few words: batch, local steps, codec, and what else a policy set."""
    wire = plan.to_wire()
    steps = plan.local_steps
    words = [f"batch {plan.batch_size}", f"{steps} local step{'s' if steps != 1 else ''}"]
    words.append(f"codec {plan.codec}")
    skip = {"batch_size", "local_steps", "codec", "bits", "topk", "lr_scale", "stage"}
    words += [f"{k} {v}" for k, v in sorted(wire.items()) if k not in skip and v is not None]
    if plan.lr_scale != 1.0:
        words.append(f"lr x{plan.lr_scale:g}")
    return ", ".join(words)


def _changes(old: Plan, new: Plan) -> dict[str, tuple[Any, Any]]:
    """The plan fields that changed, except the stage and those a policy moves every round."""
    a, b = old.to_wire(), new.to_wire()
    return {
        k: (a.get(k), b.get(k))
        for k in sorted(set(a) | set(b))
        if k != "stage" and k not in _EVERY_ROUND and a.get(k) != b.get(k)
    }


class Progress:
    """A worker's counters between two progress lines, and the lines themselves."""

    def __init__(self, url: str, now: Callable[[], float] = time.monotonic) -> None:
        self.url = url
        self._now = now
        self.pushes = 0  # since the worker started
        self.version: int | None = None  # of the parameters the last step started from
        self.transport = "websocket"
        self._plan: Plan | None = None
        self._since = now()  # when the window of the next line began
        self._window_pushes = 0
        self._window_samples = 0
        self._stale: list[int] = []  # staleness of each step in the window (see the docstring)
        self._batches: set[int] = set()
        self._join = ""  # the join line, logged with the session's first parameters

    def joined(self, worker_id: int | None, name: str, shard: Any) -> None:
        """The daemon welcomed this worker; the join is logged with the first parameters (by
        then the path they take, shared memory or the websocket, is mostly settled)."""
        where = ""
        if shard is not None and hasattr(shard, "index") and hasattr(shard, "count"):
            where = f", shard {shard.index} of {shard.count}"
        self._join = f"joined {self.url} as worker {worker_id} ({name}){where}"
        self.version = None  # a new session: versions of the last one say nothing here

    def took(self, version: int, plan: Plan, transport: str) -> None:
        """A step starts from parameters of ``version`` under ``plan``; logs the join (the
        first step of a session), a change of stage, of plan (other than its per-round fields)
        and of the path the parameters came by."""
        if self._join:
            log.info(
                "%s, over %s; stage %s, plan: %s, version %d",
                self._join,
                transport,
                plan.stage,
                plan_text(plan),
                version,
            )
            self._join, self._plan, self.transport = "", plan, transport
        if self.version is not None and version > self.version:
            self._stale.append(version - self.version - 1)
        self.version = version
        if transport != self.transport:
            log.info("parameters and pushes now go over %s", transport)
            self.transport = transport
        old, self._plan = self._plan, plan
        if old is None or old == plan:
            return
        if old.stage != plan.stage:
            log.info("stage %s -> %s, plan: %s", old.stage, plan.stage, plan_text(plan))
            return
        changed = _changes(old, plan)
        if changed:
            what = ", ".join(f"{k} {a} -> {b}" for k, (a, b) in changed.items())
            log.info("plan changed: %s", what)

    def pushed(self, samples: int, batch_size: int) -> None:
        """A push left, computed on ``samples`` examples in batches of ``batch_size``."""
        self.pushes += 1
        self._window_pushes += 1
        self._window_samples += samples
        self._batches.add(batch_size)

    def line(self) -> str:
        """The progress since the last line (and starts the next window)."""
        now = self._now()
        elapsed = max(1e-9, now - self._since)
        if self._window_pushes == 0:
            at = "" if self.version is None else f" (holding version {self.version})"
            text = f"no push in the last {elapsed:.0f} s{at}: waiting for the daemon"
        else:
            batches = sorted(self._batches)
            batch = str(batches[0]) if len(batches) == 1 else f"{batches[0]}-{batches[-1]}"
            stale = (
                f"staleness {sum(self._stale) / len(self._stale):.1f}"
                if self._stale
                else "staleness -"
            )
            text = (
                f"{self.pushes} pushes (+{self._window_pushes} in {elapsed:.0f} s), "
                f"{self._window_samples / elapsed:.1f} samples/s, batch {batch}, {stale}, "
                f"version {self.version}, over {self.transport}"
            )
        self._since, self._window_pushes, self._window_samples = now, 0, 0
        self._stale, self._batches = [], set()
        return text

    async def run(self, every_s: float) -> None:
        """Log :meth:`line` every ``every_s`` seconds until cancelled (not at all when <= 0)."""
        if every_s <= 0:
            return
        self._since = self._now()
        while True:
            await asyncio.sleep(every_s)
            log.info("%s", self.line())
