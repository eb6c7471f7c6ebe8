"""Membership, a part of :class:`hetd.core.engine.Engine`: workers join (or resume their id with
its secret), send profiles and heartbeats, and leave; each change reaches the policy as an event.
Run on the engine task only, like every command.
"""

from __future__ import annotations

import dataclasses
import hmac
import logging
import math
import secrets
from collections.abc import Callable, Mapping
from typing import Any

from hetd.codecs import registry as codecs
from hetd.core.decisions import DecisionsMixin
from hetd.core.entries import WorkerEntry, WorkerStats
from hetd.core.peers import Peer
from hetd.protocol.messages import Bye, JoinIn, ProfileRequest, ShardUpdate, Welcome
from policies.types import Join, Leave, Tick, WorkerFacts

log = logging.getLogger("hetd.core.engine")  # one logger for the engine and its parts

PROFILE_KEYS = frozenset({"sample_s", "push_s", "pull_s", "compress_s"})


class MembersMixin(DecisionsMixin):
    """:meth:`join`, :meth:`leave`, :meth:`bye_all`, :meth:`profile_result` and
    :meth:`heartbeat`."""

    def join(self, hello: JoinIn, peer: Peer, on_id: Callable[[int], None] | None = None) -> int:
        """Admit a worker: facts, plan, welcome with a new random secret; the policy decides when
        it may start. A worker that says it is a known one (``resume_id``) and shows that worker's
        secret gets its id, clock, last push id and secret back (an active one's old session
        leaves first: it reconnected before its old socket was seen to die); a wrong or missing
        secret makes it a new worker. ``on_id`` is called with the worker's id once it is
        welcomed and before the policy hears of it (the session routes pipeline frames to it
        from then on: a policy may put the worker in a replica at once)."""
        now = self.clock.now()
        codec = codecs.negotiate(list(hello.codecs), self.config.codec)  # raises before any change
        saved: WorkerFacts | None = None
        last_push = 0
        secret = ""
        rid = hello.resume_id
        if rid is not None and self._may_resume(rid, hello.resume_secret):
            if rid in self._workers:
                self.leave(rid, "resumed on a new connection")
            old = self._departed.pop(rid)
            wid, saved, last_push, secret = rid, old.facts, old.last_push, old.secret
        else:
            if rid is not None:
                log.warning("worker %s: resume refused (wrong or no secret); a new id", rid)
            wid = self._next_id
            self._next_id += 1
        secret = secret or secrets.token_urlsafe(32)
        start_clock = self.view().min_clock() if self._workers else 0
        if saved is not None:  # a returning worker keeps its clock, never below the slowest
            start_clock = max(saved.clock, start_clock) if self._workers else saved.clock
        used = {e.stats.slot for e in self._workers.values()}
        slot = next(i for i in range(len(used) + 1) if i not in used)
        facts = WorkerFacts(
            worker=wid,
            name=hello.name,
            clock=start_clock,
            version=-1,  # holds nothing yet: its first parameters go in full
            waiting=True,
            joined_at=now,
            batch_size=self.config.batch_size,
            free_mem=hello.free_mem,
            codec=codec,
            waiting_since=now,
            stages="stages" in hello.features,
        )
        entry = WorkerEntry(
            facts=facts,
            stats=WorkerStats(last_seen=now, device=dict(hello.device), slot=slot),
            plan=self._default_plan(facts, self.stage),
            peer=peer,
            same_host=hello.downlink_same_host,
            hashes="hash" in hello.features,
            last_push=last_push,
            secret=secret,
        )
        self._workers[wid] = entry
        self._facts[wid] = facts
        # Automatic shards are disjoint for up to 4 workers (fewer workers leave some data unused:
        # set [train] shards to their number). Overlapping shares (the first worker on everything,
        # the k-th on 1/k) covered all data but trained the 4-worker demo ~30 % slower. A user's
        # Task cuts its data again at every join and leave instead: one shard per worker.
        entry.reshard = "reshard" in hello.features
        cuts = self._recut() if self.config.recut_shards else {}
        shards = self.config.shards or max(4, len(self._workers))
        entry.shard = cuts.get(wid, (slot % shards, shards))
        peer.send(
            Welcome(
                id=hello.id,
                worker_id=wid,
                plan=entry.plan,
                heartbeat_s=self.config.heartbeat_s,
                shard=entry.shard[0],
                shards=entry.shard[1],
                setup=self.config.welcome,
                secret=secret,
            )
        )
        self._send_cuts(cuts, but=wid)
        if self.config.profile_steps > 0:
            peer.send(ProfileRequest(self.config.profile_steps, self.config.batch_size))
        log.info("worker %d (%s) joined on slot %d, codec %s", wid, hello.name, slot, codec)
        if on_id is not None:
            on_id(wid)
        self._dispatch(Join(now, wid))
        return wid

    def _may_resume(self, wid: int, secret: str | None) -> bool:
        """Whether ``secret`` is known worker ``wid``'s (compared in constant time)."""
        entry = self._workers.get(wid) or self._departed.get(wid)
        if entry is None or not entry.secret or not secret:
            return False
        return hmac.compare_digest(secret.encode(), entry.secret.encode())

    def leave(self, wid: int, reason: str, peer: Peer | None = None) -> None:
        """A worker left; it leaves every barrier at once (its entry is kept as departed).
        ``peer``: the session that ended; nothing happens when the worker is now on another one
        (it resumed on a new connection first)."""
        entry = self._workers.get(wid)
        if entry is None or (peer is not None and entry.peer is not peer):
            return
        del self._workers[wid]
        in_view = self._facts.pop(wid, None) is not None
        head = self.replica_of(wid)
        if head is not None:  # its replica cannot go on: the others go back to data parallel
            self.dissolve_replica(head, f"worker {wid} left")
        peer, entry.peer, entry.held_ref, entry.same_host = entry.peer, None, None, False
        entry.hashes = False
        self._departed[wid] = entry
        if peer is not None:
            peer.close(reason)
        self.departures.append((self.clock.now() - self.started_at, wid, reason))
        log.info("worker %d left: %s", wid, reason)
        if self.config.recut_shards:
            self._send_cuts(self._recut())
        if in_view:  # a replica's later stage left the view when the replica formed
            self._dispatch(Leave(self.clock.now(), wid, reason))

    def _recut(self) -> dict[int, tuple[int, int]]:
        """One shard per active worker that takes "shard" messages, in slot order; the others
        keep what they were told (their count may then overlap a new cut: a worker from before
        the message reads as it did)."""
        takers = sorted((e.stats.slot, wid) for wid, e in self._workers.items() if e.reshard)
        count = max(1, len(takers))
        return {wid: (i, count) for i, (_, wid) in enumerate(takers)}

    def _send_cuts(self, cuts: Mapping[int, tuple[int, int]], but: int | None = None) -> None:
        """Tell each worker whose shard changed (``but``: the one just welcomed with it)."""
        for wid, cut in cuts.items():
            entry = self._workers.get(wid)
            if entry is None or wid == but or entry.shard == cut or not entry.reshard:
                continue
            entry.shard = cut
            if entry.peer is not None:
                entry.peer.send(ShardUpdate(*cut))
        if cuts:
            log.info("data cut into %d shards", next(iter(cuts.values()))[1])

    def bye_all(self, reason: str) -> None:
        """Say bye to every worker and let it leave (they may reconnect later)."""
        for wid, entry in list(self._workers.items()):
            if entry.peer is not None:
                entry.peer.send(Bye(reason))
            self.leave(wid, reason)

    def profile_result(self, wid: int, result: Mapping[str, Any]) -> None:
        """A worker's profile run: finite, non-negative seconds for the known keys go into its
        facts (anything else is ignored); policies see it with the next event."""
        entry = self._workers.get(wid)
        if entry is None:
            return
        clean = {
            k: float(v)
            for k, v in result.items()
            if k in PROFILE_KEYS
            and isinstance(v, int | float)
            and not isinstance(v, bool)
            and math.isfinite(v)
            and v >= 0
        }
        self._put(entry, dataclasses.replace(entry.facts, profile=clean))
        entry.stats.last_seen = self.clock.now()
        log.info("worker %d profile: %s", wid, clean)
        self._dispatch(Tick(self.clock.now()))

    def heartbeat(self, wid: int) -> None:
        """A sign of life."""
        entry = self._workers.get(wid)
        if entry is not None:
            entry.stats.last_seen = self.clock.now()
