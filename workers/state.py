"""What a worker is told and what it keeps: its options, the state that survives a reconnect, and
the push frame type shared by the receive and push sides."""

from __future__ import annotations

import asyncio
import logging
import ssl
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from hetd.codecs.feedback import ErrorFeedback
from hetd.protocol import wire
from hetd.protocol.plan import Plan
from hetd.zoo.task import Bound
from workers.emulate import Emulation
from workers.imports import Allowed
from workers.loop import Core, Trainer
from workers.stage import StageHost

if TYPE_CHECKING:  # the inbox imports this module
    from workers.inbox import Inbox
    from workers.parts import PartsSender
    from workers.pulls import Puller

log = logging.getLogger("hetd.worker")

HELLO_ID = 1  # the request id of every hello (its welcome, or its refusal, carries it)
MAX_REFUSED = 5  # pushes refused in a row before the worker gives up (a diverging worker)
MAX_UNACKED = 8  # unanswered pushes kept to send again after a reconnect (the oldest go first)

Frame = bytes | wire.Parts
"""A push as packed: ``bytes``, or :class:`hetd.protocol.wire.Parts` whose big segments are the
update's own arrays (never written again), joined only when the push goes over the socket."""


@dataclass
class WorkerOptions:
    """Everything ``hetd-worker`` takes."""

    url: str
    token: str = ""
    name: str = "worker"
    device: jax.Device | None = None
    emulation: Emulation = field(default_factory=Emulation)
    max_frame_bytes: int = wire.DEFAULT_MAX_FRAME
    max_steps: int = 0  # 0: run until stopped
    max_retries: int = -1  # -1: retry forever
    backoff_s: float = 0.5
    backoff_max_s: float = 10.0
    # wss:// URLs: verify the daemon's certificate with this (None: the system's trust store)
    ssl_context: ssl.SSLContext | None = None
    shm: bool = True  # take shared memory when the daemon offers it (same host only)
    task: Bound | None = None  # the Task this worker's operator named (--task); None: bundled
    # the model and data set plug-ins this worker's operator named (--model, --dataset); None:
    # bundled ones only (workers.imports)
    allowed: Allowed | None = None


@dataclass
class WorkerState:
    """What survives a reconnect."""

    worker_id: int | None = None
    secret: str | None = None  # the welcome's: shown to resume worker_id after a reconnect
    steps: int = 0
    hash_mismatches: int = 0  # full pulls whose parameters did not match the frame's hash
    hash_checked: bool = False  # a verified full pull was logged (since the last mismatch)
    trainer: Trainer | None = None
    trainer_key: str = ""
    # the core being built from the daemon's /v1/prepare while it starts (workers.prepare)
    preparing: asyncio.Task[Core | None] | None = None
    plan: Plan = field(default_factory=Plan)  # the daemon's latest plan for this worker
    heartbeat_s: float = 2.0
    feedback: ErrorFeedback = field(default_factory=ErrorFeedback)  # what lossy pushes still owe
    rng: np.random.Generator = field(default_factory=lambda: np.random.default_rng(0))
    rtt_s: float = 0.0  # s from hello to welcome (the daemon's join work included)
    profile_bytes: tuple[int, int] = (0, 0)  # the profile's push and parameter frame sizes
    local_step_s: float | None = None  # s per local step as charged (emulation included), EWMA
    # Exactly-once pushes: request ids increase for the whole process (a reconnect resumes the
    # same worker, whose daemon acks an id it has seen as ``duplicate`` and never applies it
    # twice), and pushes not yet answered are kept, in id order, to be sent again after a
    # reconnect: one the daemon did not see is not lost, one it did see is not applied twice.
    push_id: int = 0  # the request id of the last push made
    unacked: dict[int, Frame] = field(default_factory=dict)  # request id -> push frame
    model_setup: dict[str, Any] = field(default_factory=dict)  # the welcome's ``model``
    stage_host: StageHost | None = None  # the pipeline stage the daemon assigned, if any
    stopping: bool = False  # asked to stop (SIGTERM): no new session, no new step
    parts: PartsSender | None = None  # the daemon's pservers (its welcome names them), if any
    pulls: Puller | None = None  # full releases pulled from those pservers
    inbox: Inbox | None = None  # the session's, while its training loop runs (a stop ends it)

    def next_push_id(self) -> int:
        """A fresh request id for a push."""
        self.push_id += 1
        return self.push_id

    def keep_unacked(self, push_id: int, frame: Frame) -> None:
        """Remember a push until the daemon answers it (at most :data:`MAX_UNACKED`)."""
        self.unacked[push_id] = frame
        while len(self.unacked) > MAX_UNACKED:
            oldest = min(self.unacked)
            del self.unacked[oldest]
            log.warning("push %d still unanswered: no longer kept for a resend", oldest)
