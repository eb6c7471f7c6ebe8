"""One pipeline replica run beside the engine's data-parallel workers (docs/policies.md §11);
:class:`hetd.server.replicas.ReplicaDriver` runs several.

A :class:`Replica` takes an ordered group of connected workers and the cuts between their
blocks, makes them one replica in the engine (:meth:`hetd.core.engine.Engine.form_replica`: the
policy sees the group's head as one data-parallel unit, the later stages leave its view), installs
the relay's routes, sends each its ``stage``, and runs the first step. Each step sends every stage
the full parameters of one version ``v`` and ``step{base: v}`` (so every stage computes on the same
version), collects the stages' slices through the assembler (:mod:`policies.dpmp.assembler`: only
a complete, disjoint, covering set of one released step goes on), and hands the assembled
gradient to the engine as one push of the head, which the policy treats like any other: the next
step runs when the policy releases the head (the engine calls :meth:`Replica.released`), so
bsp, ssp or lbbsp barriers count the replica once. If a stage's worker leaves, the step is aborted
(nothing of it applied), the survivors get ``abort{dissolve}`` and go back to data-parallel steps,
the engine puts them back in the policy's view, and the routes are withdrawn.

Each stage is sent only its slice of the parameters (the paths of its blocks); a worker whose
replica dissolves drops that slice and pulls the whole set before its next data-parallel step.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Mapping, Sequence
from functools import partial
from typing import Any

import numpy as np

from hetd.codecs import registry as codecs
from hetd.core import commands as cmd
from hetd.core.engine import Engine
from hetd.protocol import wire
from hetd.protocol.messages import PushIn
from hetd.protocol.params import full_frame
from hetd.server.relay import NoRoute, Relay
from policies.dpmp import assembler as asm

log = logging.getLogger("hetd.server.replicas")  # one logger for the replicas


class Replica:
    """Runs one pipeline replica (``replica`` id) through ``relay`` for ``engine``; ``parent``:
    the driver that owns it (its counters count this one's steps too), None for the driver
    itself."""

    def __init__(
        self, engine: Engine, relay: Relay, replica: int = 0, parent: Replica | None = None
    ) -> None:
        self.engine = engine
        self.parent = parent
        self.relay = relay
        self.replica = replica
        self.members: tuple[int, ...] = ()
        self.gen = 0
        self.step = 0
        self.micro = self.micro_batches = 0
        self.cuts: tuple[int, ...] = ()
        self.state = asm.AssemblerState(model=frozenset(engine.store.shapes))
        self.assembled = 0  # steps applied as one push
        self.assembled_by: dict[int, int] = {}  # ... by the head whose push they were
        self.aborted = 0  # steps discarded (a stage lost, a bad or unfitting part)
        self.dropped: list[str] = []  # why parts were dropped (the last few)
        self._pending = False  # a step is released and neither assembled nor given up
        # A step not assembled within timeout_s of its release is given up and the replica
        # dissolved (a stage that hangs, rather than leaves): max(min_timeout_s, timeout_factor
        # x the recent step's wall time).
        self.min_timeout_s = 30.0
        self.first_timeout_s = 180.0  # a generation's first step: the stages compile first
        self.timeout_factor = 5.0
        self.step_s: float | None = None  # EWMA of release -> assembled, s
        self.timeouts = 0  # steps given up for time
        self._watch: asyncio.TimerHandle | None = None
        self._tasks: set[asyncio.Task[Any]] = set()

    async def form(
        self,
        members: Sequence[int],
        cuts: Sequence[int],
        micro: int,
        micro_batches: int,
        inflight: Sequence[int] = (),
    ) -> None:
        """Make ``members`` (worker ids, stage order) a new generation of the replica, stage
        ``s`` holding blocks ``[cuts[s], cuts[s+1])``, and release its first step. Raises
        ValueError, with nothing changed, when the group or the cuts do not fit."""
        form = partial(self.form_now, members, cuts, micro, micro_batches, inflight)
        await self.engine.queue.call(form)

    def form_now(
        self,
        members: Sequence[int],
        cuts: Sequence[int],
        micro: int,
        micro_batches: int,
        inflight: Sequence[int] = (),
    ) -> None:
        """:meth:`form`, on the engine task."""
        n = len(members)
        if n < 2 or len(cuts) != n + 1 or list(cuts) != sorted(set(cuts)) or cuts[0] != 0:
            raise ValueError(
                f"need >= 2 members and {n + 1} increasing cuts from 0, got {list(cuts)}"
            )
        blocks = {path.split("/", 1)[0] for path in self.engine.store.shapes}
        if not all(re.fullmatch(r"b\d\d", b) for b in blocks):
            raise ValueError(
                "the model is not block-structured (serve one, e.g. hetd.zoo.blocks:mlp_model)"
            )
        if cuts[-1] != len(blocks):
            raise ValueError(f"the cuts must end at the model's {len(blocks)} blocks")
        if inflight and (len(inflight) != n or min(inflight) < 1):
            raise ValueError(f"inflight needs {n} caps >= 1, got {list(inflight)}")
        if self.members:
            raise ValueError(f"replica {self.replica} is running (members {list(self.members)})")
        # the engine checks the members (connected, distinct, in no replica) and takes them
        self.engine.form_replica(list(members))
        self.gen += 1
        self.step_s = None  # new stages compile on their first step
        self.members = tuple(members)
        self.cuts = tuple(cuts)
        self.micro, self.micro_batches = micro, micro_batches
        self.relay.install(
            {
                **{k: w for k, w in self.relay.routes.items() if k[0] != self.replica},
                **{(self.replica, self.gen, s): w for s, w in enumerate(members)},
            }
        )
        self.state = asm.regroup(self.state, self.replica, self.gen, n)
        for s, w in enumerate(members):
            cap = inflight[s] if inflight else n - s
            self._send(
                w,
                wire.encode(
                    "stage",
                    0,
                    replica=self.replica,
                    gen=self.gen,
                    stage=s,
                    of=n,
                    blocks=[cuts[s], cuts[s + 1]],
                    micro=micro,
                    inflight=cap,
                    prev=members[s - 1] if s > 0 else None,
                    next=members[s + 1] if s < n - 1 else None,
                ),
            )
        self.release()  # forming releases the head: its first step

    def dissolve(self, reason: str) -> None:
        """End the running replica with every member alive (on the engine task): its step is
        aborted (nothing of it applied), every member goes back to data-parallel steps."""
        if not self.members:
            return
        members, self.members = self.members, ()
        if self._watch is not None:
            self._watch.cancel()
        self.state = asm.abort(self.state, self.replica, reason)
        self.state = asm.regroup(self.state, self.replica, self.gen, 0)
        if self._pending:
            self._count_abort()
        self._pending = False
        self.relay.install({k: w for k, w in self.relay.routes.items() if k[0] != self.replica})
        self.engine.dissolve_replica(members[0], reason)
        self._send_dissolve(members, reason)
        log.info("replica %d gen %d dissolved: %s", self.replica, self.gen, reason)

    def released(self, head: int) -> None:
        """The engine's policy released the replica headed by ``head`` (called on the engine
        task, the release's updates applied): run the next step, unless one is still under way
        (it ends in a push, and that push in the next release)."""
        if self.members[:1] == (head,) and not self._pending:
            self.release()

    def release(self) -> None:
        """Send every stage its slice of the current version (the parameters of its blocks, as
        a full ``params`` frame without a hash) and the next step on it."""
        if not self.members:
            return
        snap = self.engine.store.snapshot()
        self.step += 1
        self._pending = True
        samples = self.micro * self.micro_batches
        now = self.engine.clock.now()
        self.state = asm.release(self.state, self.replica, self.step, snap.version, samples, now)
        step = wire.encode(
            "step",
            0,
            replica=self.replica,
            gen=self.gen,
            step=self.step,
            base=snap.version,
            micro_batches=self.micro_batches,
            micro=self.micro,
            shard=0,
            offset=self.step * samples,
        )
        self._arm()
        for s, w in enumerate(self.members):  # params first: the stage holds ``base`` then
            heads = tuple(f"b{j:02d}/" for j in range(self.cuts[s], self.cuts[s + 1]))
            own = {k: v for k, v in snap.tensors.items() if k.startswith(heads)}
            self._send(w, full_frame(snap.version, own, None)[0])
            self._send(w, step)

    @property
    def timeout_s(self) -> float:
        """How long a released step may take before it is given up."""
        if self.step_s is None:
            return max(self.min_timeout_s, self.first_timeout_s)
        return max(self.min_timeout_s, self.timeout_factor * self.step_s)

    def _arm(self) -> None:
        """Watch the step just released (no event loop, as in direct calls: no watch)."""
        if self._watch is not None:
            self._watch.cancel()
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            self._watch = None
            return
        expire = partial(self._expire, self.gen, self.step, self.timeout_s)
        self._watch = loop.call_later(self.timeout_s, self.engine.queue.submit, cmd.Call(expire))

    def _expire(self, gen: int, step: int, after_s: float) -> None:
        """On the engine task: step ``step`` of generation ``gen`` is overdue. If it is still
        the one under way, nothing of it is applied and the replica dissolves (its members go
        back to data parallel; a policy that plans replicas may form one again)."""
        if self.members and self._pending and (self.gen, self.step) == (gen, step):
            self.timeouts += 1
            self.dissolve(f"step {step} was not complete {after_s:.1f} s after its release")

    def part(self, wid: int, msg: wire.Message) -> None:
        """A stage's slice arrived (the relay's ``on_part``)."""
        try:
            tensors = self._decode(msg["tensors"])
        except (codecs.CodecError, ValueError) as exc:
            self._drop(f"worker {wid} step {msg['step']}: {exc}", abort=True)
            return
        part = asm.Part(
            replica=msg["replica"],
            gen=msg["gen"],
            step=msg["step"],
            stage=msg["stage"],
            base_version=msg["base"],
            samples=msg["samples"],
            paths=frozenset(tensors),
            payload=(wid, msg.id, tensors, msg.get("loss")),
            compute_s=float(msg["compute_s"]),
        )
        if part.replica != self.replica or self.members[part.stage : part.stage + 1] != (wid,):
            self._drop(f"worker {wid} is not stage {part.stage} of replica {part.replica}")
            return
        outcome, self.state = asm.offer(self.state, part, self.engine.clock.now())
        if isinstance(outcome, asm.Dropped):
            current = (self.replica, self.gen, self.step) in self.state.released
            self._drop(outcome.reason, abort=not current and part.step == self.step)
        elif isinstance(outcome, asm.Assembled):
            self._spawn(self._apply(outcome))

    def lost(self, wid: int) -> None:
        """A worker's session ended (the relay's ``on_detach``): a lost stage aborts the step
        and dissolves the replica; the survivors go back to data-parallel steps."""
        if wid not in self.members:
            return
        self.state = asm.abort(self.state, self.replica, f"worker {wid} left")
        self.state = asm.regroup(self.state, self.replica, self.gen, 0)
        self._count_abort()
        self._pending = False
        self.relay.install({k: w for k, w in self.relay.routes.items() if k[0] != self.replica})
        head, reason = self.members[0], f"stage worker {wid} left"
        self.engine.queue.submit(cmd.DissolveReplica(head, reason))
        survivors, self.members = [w for w in self.members if w != wid], ()
        self._send_dissolve(survivors, reason)
        log.info("replica %d gen %d dissolved: worker %d left", self.replica, self.gen, wid)

    async def _apply(self, done: asm.Assembled) -> None:
        """The assembled step as one push of the stage-0 worker, then the next step."""
        tensors: dict[str, np.ndarray] = {}
        loss = None
        for p in done.parts:
            _, _, part_tensors, part_loss = p.payload
            tensors.update(part_tensors)
            loss = part_loss if part_loss is not None else loss
        head, push_id = done.parts[0].payload[0], done.parts[0].payload[1]
        push = PushIn(
            worker=head,
            id=push_id,
            base=done.base_version,
            kind="grad",
            tensors=tensors,
            samples=done.samples,
            steps=1,
            compute_s=done.wall_s,
            loss=loss,
            free_mem=None,
            nbytes=sum(int(t.nbytes) for t in tensors.values()),
        )
        if done.gen == self.gen and done.step == self.step:
            self._pending = False  # the push below leads to the next release
        old = self.step_s
        self.step_s = done.wall_s if old is None else 0.5 * done.wall_s + 0.5 * old

        def push_once() -> bool:
            """Push; whether the engine took it (not refused by the guard, not a duplicate)."""
            st = self.engine.members.stats[head]
            before = st.refused + st.duplicates
            self.engine.push(push)
            return st.refused + st.duplicates == before

        taken = await self.engine.queue.call(push_once)
        for r in (self, self.parent):
            if r is not None:
                r.assembled += 1
                r.assembled_by[head] = r.assembled_by.get(head, 0) + 1
        if not taken and done.gen == self.gen and self.members and not self._pending:
            self.release()  # no release follows a refused push: the replica goes on by itself

    def _decode(self, wire_tensors: Any) -> dict[str, np.ndarray]:
        shapes = self.engine.store.shapes
        tensors = codecs.decode_tree(wire_tensors)
        for path, x in tensors.items():
            if shapes.get(path) != tuple(x.shape):
                raise ValueError(f"tensor {path!r}: not a parameter of that shape")
            if not np.isfinite(x).all():
                raise ValueError(f"tensor {path!r} holds NaN or Inf")
        return tensors

    def _drop(self, why: str, abort: bool = False) -> None:
        log.info("replica %d: part dropped: %s", self.replica, why)
        self.dropped = [*self.dropped[-9:], why]
        if abort and self.members:
            self.state = asm.abort(self.state, self.replica, why)
            self._count_abort()
            self.release()

    def _send_dissolve(self, workers: Sequence[int], reason: str) -> None:
        """Tell ``workers`` the replica is gone: an ``abort`` of the current step that dissolves."""
        frame = wire.encode(
            "abort",
            0,
            replica=self.replica,
            gen=self.gen,
            step=self.step,
            reason=reason,
            dissolve=True,
        )
        for w in workers:
            self._send(w, frame)

    def _send(self, wid: int, frame: bytes) -> None:
        try:
            self.relay.send(wid, frame)
        except NoRoute as exc:
            log.info("replica %d: %s", self.replica, exc.message)

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _count_abort(self) -> None:
        self.aborted += 1
        if self.parent is not None:
            self.parent.aborted += 1

    def describe(self) -> dict[str, Any]:
        """What the admin API shows."""
        return {
            "replica": self.replica,
            "members": list(self.members),
            "gen": self.gen,
            "step": self.step,
            "assembled": self.assembled,
            "aborted": self.aborted,
            "timeouts": self.timeouts,
            "timeout_s": self.timeout_s,
            "dropped": list(self.dropped),
        }

    @property
    def routes(self) -> Mapping[tuple[int, int, int], int]:
        return self.relay.routes
