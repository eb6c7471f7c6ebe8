"""The worker table, a part of :class:`hetd.core.engine.Engine` (:class:`Members`): who is connected
(active entries) and who was (departed, or known from a checkpoint); the facts the policy sees;
joins, resumes by secret, leaves, profiles, heartbeats, pushes' timing facts and the data shards.
It tells the policy nothing itself: the engine turns what it returns into events.
"""

from __future__ import annotations

import dataclasses
import hmac
import logging
import math
import secrets
from collections import deque
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from hetd.codecs import registry as codecs
from hetd.core.entries import Column, EngineConfig, WorkerEntry, WorkerStats
from hetd.core.peers import Clock, Peer
from hetd.protocol.messages import JoinIn, ProfileRequest, PushIn, Reply, ShardUpdate, Welcome
from policies.types import Plan, WorkerFacts

log = logging.getLogger("hetd.core.engine")  # one logger for the engine and its parts

PROFILE_KEYS = frozenset({"sample_s", "push_s", "pull_s", "compress_s"})
EWMA = 0.5  # smoothing of per-worker timing facts (docs/policies.md)


class Members:
    """Active and departed workers by id; the active ones' facts as the policy sees them (a
    pipeline replica's later stages are hidden from that view)."""

    def __init__(self, config: EngineConfig, clock: Clock, started_at: float) -> None:
        self.config = config
        self.clock = clock
        self.started_at = started_at
        self.active: dict[int, WorkerEntry] = {}
        self.gone: dict[int, WorkerEntry] = {}  # left (or known from a checkpoint)
        self.view_facts: dict[int, WorkerFacts] = {}  # the active workers the policy sees
        self.hidden: set[int] = set()  # active workers kept out of that view (later stages)
        self.departures: deque[tuple[float, int, str]] = deque(maxlen=64)  # (t, worker, reason)
        self.next_id = 1
        self._evict_at = -math.inf  # when departed workers are next looked at for eviction

    # --- reading ----------------------------------------------------------------------------------

    @property
    def entries(self) -> Mapping[int, WorkerEntry]:
        return MappingProxyType(self.active)

    @property
    def facts(self) -> Mapping[int, WorkerFacts]:
        return MappingProxyType(self.view_facts)

    @property
    def departed(self) -> Mapping[int, WorkerFacts]:
        return Column("facts", self.gone)

    @property
    def stats(self) -> Mapping[int, WorkerStats]:
        return Column("stats", self.active, self.gone)

    @property
    def plans(self) -> Mapping[int, Plan]:
        return Column("plan", self.active)

    def min_clock(self) -> int:
        """The slowest clock in the policy's view (0 when nobody is in it)."""
        return min((f.clock for f in self.view_facts.values()), default=0)

    # --- changing ---------------------------------------------------------------------------------

    def put(self, entry: WorkerEntry, facts: WorkerFacts) -> None:
        """Replace an active worker's facts (in its entry and, unless hidden, in the view)."""
        entry.facts = facts
        if facts.worker not in self.hidden:
            self.view_facts[facts.worker] = facts

    def update(self, entry: WorkerEntry, **changes: Any) -> None:
        """:meth:`put` the entry's facts with ``changes``."""
        self.put(entry, dataclasses.replace(entry.facts, **changes))

    def hide(self, wid: int) -> bool:
        """Take an active worker out of the policy's view; whether it was in it."""
        self.hidden.add(wid)
        return self.view_facts.pop(wid, None) is not None

    def show(self, wid: int) -> None:
        """Put a hidden worker back into the view (when it is still active)."""
        self.hidden.discard(wid)
        entry = self.active.get(wid)
        if entry is not None:
            self.view_facts[wid] = entry.facts

    def send(self, wid: int, reply: Reply) -> None:
        """A control reply to an active worker's session (nothing when it has none)."""
        entry = self.active.get(wid)
        if entry is not None and entry.peer is not None:
            entry.peer.send(reply)

    def may_resume(self, wid: int, secret: str | None) -> bool:
        """Whether ``secret`` is known worker ``wid``'s (compared in constant time)."""
        entry = self.active.get(wid) or self.gone.get(wid)
        if entry is None or not entry.secret or not secret:
            return False
        return hmac.compare_digest(secret.encode(), entry.secret.encode())

    def terms(self, hello: JoinIn, stage: str) -> tuple[str, Plan]:
        """The codec ``hello``'s worker gets (a :class:`~hetd.codecs.registry.CodecError`, before
        anything changed, when it offers none the daemon takes) and its first plan."""
        codec = codecs.negotiate(list(hello.codecs), self.config.codec)
        return codec, self.default_plan(codec, stage)

    def default_plan(self, codec: str, stage: str) -> Plan:
        """A worker's plan before any policy changes it: the configured batch, pushes in the
        codec its parameters come in, nothing else set."""
        return Plan(batch_size=self.config.batch_size, codec=codec, stage=stage)

    def resuming(self, hello: JoinIn) -> int | None:
        """The active worker ``hello`` resumes (it shows that worker's secret): its old session
        must leave first. None when it resumes no active worker."""
        rid = hello.resume_id
        return rid if rid in self.active and self.may_resume(rid, hello.resume_secret) else None

    def admit(self, hello: JoinIn, peer: Peer, codec: str, plan: Plan) -> WorkerEntry:
        """A new entry for ``hello`` (its resumed id, clock and secret when it may resume a
        departed one; the caller made an active one leave first). Its shard is the caller's."""
        now = self.clock.now()
        saved: WorkerFacts | None = None
        last_push = 0
        secret = ""
        rid = hello.resume_id
        if rid is not None and rid in self.gone and self.may_resume(rid, hello.resume_secret):
            old = self.gone.pop(rid)
            wid, saved, last_push, secret = rid, old.facts, old.last_push, old.secret
        else:
            if rid is not None:
                log.warning("worker %s: resume refused (wrong or no secret); a new id", rid)
            wid = self.next_id
            self.next_id += 1
        start_clock = self.min_clock() if self.active else 0
        if saved is not None:  # a returning worker keeps its clock, never below the slowest
            start_clock = max(saved.clock, start_clock) if self.active else saved.clock
        used = {e.stats.slot for e in self.active.values()}
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
            plan=dataclasses.replace(plan, codec=codec),
            peer=peer,
            same_host=hello.downlink_same_host,
            hashes="hash" in hello.features,
            last_push=last_push,
            secret=secret or secrets.token_urlsafe(32),
        )
        entry.reshard = "reshard" in hello.features
        entry.pulls = "pulls" in hello.features
        self.active[wid] = entry
        self.view_facts[wid] = facts
        return entry

    def join(self, hello: JoinIn, peer: Peer, codec: str, plan: Plan) -> WorkerEntry:
        """Admit ``hello``'s worker (:meth:`admit`), give it its shard, welcome it, tell the others
        of a new cut and ask it for a profile run when the engine profiles."""
        entry = self.admit(hello, peer, codec, plan)
        wid, cuts = entry.facts.worker, self.shard_for(entry)
        peer.send(self.welcome(entry, hello.id))
        self.send_cuts(cuts, but=wid)
        cfg = self.config
        if cfg.profile_steps > 0:
            peer.send(ProfileRequest(cfg.profile_steps, cfg.batch_size))
        log.info(
            "worker %d (%s) joined on slot %d, codec %s", wid, hello.name, entry.stats.slot, codec
        )
        return entry

    def welcome(self, entry: WorkerEntry, hello_id: int) -> Welcome:
        """The answer to an admitted worker's hello: its id, plan, shard, secret and the setup."""
        return Welcome(
            id=hello_id,
            worker_id=entry.facts.worker,
            plan=entry.plan,
            heartbeat_s=self.config.heartbeat_s,
            shard=entry.shard[0],
            shards=entry.shard[1],
            setup=self.config.welcome,
            secret=entry.secret,
        )

    def shard_for(self, entry: WorkerEntry) -> dict[int, tuple[int, int]]:
        """Give a newly admitted worker its shard; the re-cut of the others (user tasks).

        Automatic shards are disjoint for up to 4 workers (fewer workers leave some data unused:
        set [train] shards to their number). Overlapping shares (the first worker on everything,
        the k-th on 1/k) covered all data but trained the 4-worker demo ~30 % slower. A user's
        Task cuts its data again at every join and leave instead: one shard per worker."""
        cuts = self.recut() if self.config.recut_shards else {}
        shards = self.config.shards or max(4, len(self.active))
        entry.shard = cuts.get(entry.facts.worker, (entry.stats.slot % shards, shards))
        return cuts

    def remove(
        self, wid: int, reason: str, peer: Peer | None, keep: bool = False
    ) -> tuple[WorkerEntry, bool] | None:
        """Worker ``wid`` left (None: it is not active, or is on another session than ``peer``):
        its entry and whether it was in the policy's view. Its session is closed with
        ``reason``. The entry is kept as departed when a push of it was answered (exactly-once
        and a resume need it) or ``keep`` says so (it resumes at once); else nothing is left."""
        entry = self.active.get(wid)
        if entry is None or (peer is not None and entry.peer is not peer):
            return None
        del self.active[wid]
        self.hidden.discard(wid)
        in_view = self.view_facts.pop(wid, None) is not None
        session, entry.peer, entry.held_ref, entry.same_host = entry.peer, None, None, False
        entry.hashes = False
        entry.left_at = self.clock.now()
        if entry.last_push or keep:
            self.gone[wid] = entry
            self.evict(entry.left_at)
        if session is not None:
            session.close(reason)
        self.departures.append((self.clock.now() - self.started_at, wid, reason))
        log.info("worker %d left: %s", wid, reason)
        return entry, in_view

    def silent(self, now: float) -> list[int]:
        """The active workers not heard from for longer than the heartbeat timeout."""
        timeout = self.config.heartbeat_timeout_s
        return [w for w, e in self.active.items() if now - e.stats.last_seen > timeout]

    def evict_due(self, now: float, every_s: float = 10.0) -> None:
        """:meth:`evict` at most every ``every_s`` (called on ticks)."""
        if self.gone and now >= self._evict_at:
            self._evict_at = now + every_s
            self.evict(now)

    def evict(self, now: float) -> int:
        """Forget departed workers gone longer than ``departed_retention_s``, then the longest
        gone beyond ``max_departed``; how many."""
        cfg, gone = self.config, self.gone
        old = [w for w, e in gone.items() if now - (e.left_at or now) > cfg.departed_retention_s]
        over = len(gone) - len(old) - cfg.max_departed
        if over > 0:
            left = sorted((e.left_at or now, w) for w, e in gone.items() if w not in set(old))
            old += [w for _, w in left[:over]]
        for w in old:
            del gone[w]
        if old:
            log.info("%d departed worker(s) forgotten", len(old))
        return len(old)

    def recut(self) -> dict[int, tuple[int, int]]:
        """One shard per active worker that takes "shard" messages, in slot order; the others
        keep what they were told (their count may then overlap a new cut: a worker from before
        the message reads as it did)."""
        takers = sorted((e.stats.slot, wid) for wid, e in self.active.items() if e.reshard)
        count = max(1, len(takers))
        return {wid: (i, count) for i, (_, wid) in enumerate(takers)}

    def recut_on_leave(self) -> None:
        """After a leave, the shards are cut again among those left when ``recut_shards`` says so."""
        if self.config.recut_shards:
            self.send_cuts(self.recut())

    def send_cuts(self, cuts: Mapping[int, tuple[int, int]], but: int | None = None) -> None:
        """Tell each worker whose shard changed (``but``: the one just welcomed with it)."""
        for wid, cut in cuts.items():
            entry = self.active.get(wid)
            if entry is None or wid == but or entry.shard == cut or not entry.reshard:
                continue
            entry.shard = cut
            self.send(wid, ShardUpdate(*cut))
        if cuts:
            log.info("data cut into %d shards", next(iter(cuts.values()))[1])

    def profiled(self, wid: int, result: Mapping[str, Any]) -> bool:
        """A worker's profile run: finite, non-negative seconds for the known keys go into its
        facts (anything else is ignored). Whether the worker is active."""
        entry = self.active.get(wid)
        if entry is None:
            return False
        clean = {
            k: float(v)
            for k, v in result.items()
            if k in PROFILE_KEYS
            and isinstance(v, int | float)
            and not isinstance(v, bool)
            and math.isfinite(v)
            and v >= 0
        }
        self.update(entry, profile=clean)
        entry.stats.last_seen = self.clock.now()
        log.info("worker %d profile: %s", wid, clean)
        return True

    def set_transport(self, wid: int, peer: Peer, transport: str) -> None:
        """Worker ``wid``'s session ``peer`` now carries its big frames by ``transport``
        (``"shm"``: the daemon's shared memory); /v1/workers shows it as ``path``."""
        entry = self.active.get(wid)
        if entry is not None and entry.peer is peer:
            entry.transport = transport

    def seen(self, wid: int) -> None:
        """A sign of life."""
        entry = self.active.get(wid)
        if entry is not None:
            entry.stats.last_seen = self.clock.now()

    def pushed(self, entry: WorkerEntry, p: PushIn, now: float) -> None:
        """An accepted push's counters and timing facts (the worker now waits)."""
        st, facts = entry.stats, entry.facts
        st.pushes += 1
        st.bytes_in += p.nbytes
        st.worker_idle_s += p.idle_s or 0.0

        def ewma(old: float | None, new: float) -> float:
            return new if old is None else EWMA * new + (1 - EWMA) * old

        self.update(
            entry,
            clock=facts.clock + 1,
            waiting=True,
            waiting_since=now,
            prev_push_at=facts.last_push_at,
            last_push_at=now,
            compute_s=ewma(facts.compute_s, p.compute_s),
            sample_s=ewma(facts.sample_s, p.compute_s / max(1, p.samples))
            if p.samples
            else facts.sample_s,
            push_bytes=ewma(facts.push_bytes, float(p.nbytes)),
            link_bps=link_rate(st, p.nbytes, p.transfer_s, facts.link_bps),
            samples=facts.samples + p.samples,
            free_mem=p.free_mem if p.free_mem is not None else facts.free_mem,
        )


def link_rate(
    st: WorkerStats, nbytes: int, transfer_s: float | None, old: float | None
) -> float | None:
    """The worker's link estimate after a push of ``nbytes`` taking ``transfer_s``."""
    if not transfer_s or transfer_s <= 0:
        return old
    st.link_rates.append(nbytes / transfer_s)
    return max(st.link_rates)
