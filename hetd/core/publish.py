"""Releases and publishing, a part of :class:`hetd.core.engine.Engine`: a released worker's
parameters go out at once (commands called directly) or wait for the batch's publish (under
:meth:`~hetd.core.engine.Engine.run` and after :meth:`PublishMixin.defer_publishing`), which applies
the batch's updates and encodes each (codec, held version)'s frames once.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math

from hetd.codecs.registry import spec_name as codec_name
from hetd.core.downlink import Outgoing
from hetd.core.entries import WorkerEntry, WorkerStats
from hetd.core.peers import Peer
from hetd.core.replicas import ReplicaMixin

log = logging.getLogger("hetd.core.engine")  # one logger for the engine and its parts

# Push codecs a worker's parameters follow (see PublishMixin._params_codec): every coordinate moves
DENSE_PARAMS_CODECS = frozenset({"int8", "int4", "bf16", "fp16"})
OFF_LOOP_PARAMS = (
    65_536  # models this big publish in a worker thread (smaller: a thread hop costs more)
)


class PublishMixin(ReplicaMixin):
    """Releases, resends and the batch's publish."""

    def defer_publishing(self) -> None:
        """Publish as the daemon does, for a caller that runs commands in batches without
        :meth:`run` (the simulator's daemon server): releases wait for :meth:`publish_batch`,
        and the updates queued in between go through one optimizer step of their weighted sum."""
        self._deferred = True
        self.store.combine = True

    def publish_batch(self) -> None:
        """What :meth:`run` does after each batch, synchronously: apply the batch's updates,
        encode the released workers' frames once per (codec, held version) and send them."""
        if self._releases or self.store.pending or self._replica_releases:
            self.publishes += 1
            wants = self._take_releases()
            frames = self._encode_releases(wants)
            for wid, *_ in wants:
                self._send_params(wid, frames[wid])
            self._send_replica_releases()

    def _take_releases(self) -> list[tuple[int, str, int, int | None, float | None, bool]]:
        wants = [
            (
                wid,
                self._params_codec(entry),
                entry.facts.version,
                entry.held_ref,
                self._link(entry),
                entry.hashes,
            )
            for wid in self._releases
            if (entry := self._workers.get(wid)) is not None
        ]
        self._releases = {}
        return wants

    async def _publish(self) -> None:
        """Run queued steps and encode the released workers' frames (off the loop for big
        models, the engine task awaiting), then hand the frames to their outboxes."""
        wants = self._take_releases()
        try:
            if self.store.n_params >= OFF_LOOP_PARAMS:
                frames = await asyncio.to_thread(self._encode_releases, wants)
            else:
                frames = self._encode_releases(wants)
        except Exception:
            # Nothing to send: rather than leave the released workers waiting for parameters,
            # drop their sessions; they reconnect as themselves and get parameters in full.
            log.exception("publishing parameters failed; dropping %d session(s)", len(wants))
            for wid, *_ in wants:
                entry = self._workers.get(wid)
                if entry is not None and entry.peer is not None:
                    entry.peer.close(
                        "the daemon could not encode parameters for this worker; reconnect"
                    )
            self._send_replica_releases()
            return
        for wid, *_ in wants:
            self._send_params(wid, frames[wid])
        self._send_replica_releases()

    def _encode_releases(
        self, wants: list[tuple[int, str, int, int | None, float | None, bool]]
    ) -> dict[int, Outgoing]:
        """The release for each (worker, codec, held version, held reference, link bytes/s, takes
        the hash); one encoding per (codec, version, reference, hash), shared by every worker
        holding it."""
        self.store.flush()
        if not wants:
            return {}
        snap = self.store.snapshot()
        made: dict[tuple[str, int, int | None, bool], Outgoing] = {}
        out = {}
        for wid, codec, held, ref, link, hashes in wants:
            key = (codec, held, ref, hashes)
            if key not in made:
                made[key] = self.downlink.frames(codec, held, snap, ref, link, hashes=hashes)
            out[wid] = made[key]
        return out

    def _release(self, wid: int) -> None:
        entry = self._workers.get(wid)
        if entry is None or not entry.facts.waiting or wid in self._stages:
            return  # a replica's later stage is released with its head
        facts = entry.facts
        now = self.clock.now()
        gap = facts.clock - min(f.clock for f in self._facts.values())
        self.max_release_gap = max(self.max_release_gap, gap)
        idle = now - facts.waiting_since if facts.waiting_since is not None else 0.0
        self._put(
            entry,
            dataclasses.replace(
                facts,
                waiting=False,
                waiting_since=None,
                idle_s=facts.idle_s + idle,
            ),
        )
        if wid in self._replicas:
            self._release_replica(wid)
            return
        if self._deferred:
            self._releases[wid] = None
            return
        release = self.downlink.frames(
            self._params_codec(entry),
            facts.version,
            self.store.snapshot(),
            entry.held_ref,
            self._link(entry),
            hashes=entry.hashes,
        )
        self._send_params(wid, release)

    def resend(self, wid: int, peer: Peer | None = None) -> None:
        """Send a worker the newest parameters in full, in place of a full frame its outbox
        dropped because it was still writing an earlier one (a slow reader: the dropped frame
        would have pinned one more snapshot). Not a release: the policy is not asked and the
        worker's gates do not change; what the engine records it holds is what goes now.
        ``peer``: the session that asked (nothing happens when the worker is on another one)."""
        entry = self._workers.get(wid)
        if entry is None or entry.peer is None or (peer is not None and entry.peer is not peer):
            return
        self._put(entry, dataclasses.replace(entry.facts, version=-1))  # full, not a delta
        entry.held_ref = None
        if self._deferred:
            self._releases[wid] = None
            return
        snap = self.store.snapshot()
        release = self.downlink.frames(
            self._params_codec(entry), -1, snap, None, self._link(entry), hashes=entry.hashes
        )
        self._send_params(wid, release)

    def set_transport(self, wid: int, peer: Peer, transport: str) -> None:
        """Worker ``wid``'s session ``peer`` now carries its big frames by ``transport``
        (``"shm"``: the daemon's shared memory); /v1/workers shows it as ``path``. Nothing
        happens when the worker is on another session by now."""
        entry = self._workers.get(wid)
        if entry is not None and entry.peer is peer:
            entry.transport = transport

    @staticmethod
    def _link_rate(
        st: WorkerStats, nbytes: int, transfer_s: float | None, old: float | None
    ) -> float | None:
        """The worker's link estimate after a push of ``nbytes`` taking ``transfer_s``."""
        if not transfer_s or transfer_s <= 0:
            return old
        st.link_rates.append(nbytes / transfer_s)
        return max(st.link_rates)

    @staticmethod
    def _params_codec(entry: WorkerEntry) -> str:
        """The codec a worker's parameters go out in: the one negotiated at its join, or, when its
        plan pushes deltas in a dense lossy codec (local SGD's pseudo-gradients, e.g. ``diloco``'s
        ``codec=int8``), that one. Such a worker is on a link worth compressing, and its next
        parameters are its base moved by one outer step, which the downlink sends as a delta in
        that codec with exact error feedback (hetd.core.downlink). A sparse push codec (top-k,
        sign) stays on the pushes: a sparse pull would leave most coordinates behind."""
        plan = entry.plan
        if (
            plan.push_kind == "delta"
            and plan.codec != entry.facts.codec
            and codec_name(plan.codec) in DENSE_PARAMS_CODECS
        ):
            return plan.codec
        return entry.facts.codec

    def _link(self, entry: WorkerEntry) -> float | None:
        """The worker's link in bytes/s for the downlink's choice: unbounded for loopback or
        ``downlink = "full"``, unknown (deltas) for ``"delta"``."""
        mode = self.config.downlink
        if mode == "full" or (mode == "auto" and entry.same_host):
            return math.inf
        return None if mode == "delta" else entry.facts.link_bps

    def _send_params(self, wid: int, release: Outgoing) -> None:
        entry = self._workers.get(wid)
        if entry is None or entry.peer is None:
            return
        self._put(entry, dataclasses.replace(entry.facts, version=release.version))
        entry.held_ref = release.ref
        entry.stats.releases += 1
        for frame in release.frames:
            entry.stats.bytes_out += len(frame)
            self.bytes_out += len(frame)
            entry.peer.send_params(frame, full=release.full)
        # A pipelined worker counts its pushes until each is answered with a frame; one release
        # for a wait that two of its pushes joined would leave one unanswered for good, and it
        # would never compute with a push in flight again. An empty delta ("go on") answers it.
        if entry.joined_pushes:
            empty = self.downlink.go_on(release.version)
        for _ in range(entry.joined_pushes):
            entry.stats.bytes_out += len(empty)
            self.bytes_out += len(empty)
            entry.peer.send_params(empty, full=False)
        entry.joined_pushes = 0
