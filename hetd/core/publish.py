"""Parameters on their way out, a part of :class:`hetd.core.engine.Engine` (:class:`Publisher`): a
released worker's parameters go out at once (commands called directly) or wait for the batch's
publish (under :meth:`~hetd.core.engine.Engine.run`, and after
:meth:`~hetd.core.engine.Engine.defer_publishing`), which applies the batch's updates and encodes
each (codec, held version)'s frames once. The only part that hands ``params`` frames to peers.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Callable, Iterable

from hetd.codecs.registry import spec_name as codec_name
from hetd.core.downlink import Downlink, Outgoing
from hetd.core.entries import EngineConfig, WorkerEntry
from hetd.core.members import Members
from hetd.core.peers import FrameSink, Peer
from hetd.core.rates import Meters
from hetd.core.store import Store

log = logging.getLogger("hetd.core.engine")  # one logger for the engine and its parts

# Push codecs a worker's parameters follow (see Publisher.params_codec): every coordinate moves
DENSE_PARAMS_CODECS = frozenset({"int8", "int4", "bf16", "fp16"})
OFF_LOOP_PARAMS = (
    65_536  # models this big publish in a worker thread (smaller: a thread hop costs more)
)

Want = tuple[int, str, int, int | None, float | None, bool]
"""A release to encode: (worker, codec, held version, held reference, link bytes/s, hashes)."""


class Publisher:
    """The downlink, the releases waiting for the batch's publish, and the sending of frames."""

    def __init__(self, members: Members, store: Store, config: EngineConfig, meters: Meters):
        self.members = members
        self.store = store
        self.config = config
        self.meters = meters
        self.downlink = Downlink(s_per_param=config.delta_s_per_param, hashes=config.param_hashes)
        self.pending: dict[int, None] = {}  # workers released, not yet sent parameters (ordered)
        self.deferred = False  # releases wait for the batch's publish
        store.hashes = config.param_hashes  # a snapshot's frame carries its hash (or not)
        # With pservers (set by the server once they serve pulls): the ``params_at`` frame that
        # names where the pservers hold the store's current version, sent in place of a full
        # frame (none is built for it) to a worker whose hello named "pulls" and whose frames
        # travel over its socket. None: no pulls.
        self.pointer: Callable[[Store], bytes] | None = None

    def defer(self, on: bool = True) -> None:
        """Publish in batches (or not any more): releases wait for :meth:`publish`, and the store
        runs the updates queued in between as one optimizer step of their weighted sum."""
        self.deferred = self.store.combine = on

    def due(self) -> bool:
        """Whether a publish has anything to do: releases waiting, or updates not yet applied."""
        return bool(self.pending or self.store.pending)

    def forget(self, workers: Iterable[int]) -> None:
        """Drop ``workers``' waiting releases (a replica's later stages: its head's step feeds
        them)."""
        for wid in workers:
            self.pending.pop(wid, None)

    def sink_to(self, sink: FrameSink) -> None:
        """Full frames are written once more into ``sink`` (the daemon's shared memory)."""
        self.store.frame_sink = sink

    def release(self, entry: WorkerEntry) -> None:
        """Send a released worker the parameters (or queue it for the batch's publish)."""
        wid = entry.facts.worker
        if self.deferred:
            self.pending[wid] = None
            return
        release = self._frames(
            wid,
            self.params_codec(entry),
            entry.facts.version,
            entry.held_ref,
            self.link(entry),
            entry.hashes,
        )
        self.send(wid, release)

    def resend(self, wid: int, peer: Peer | None = None) -> None:
        """Send a worker the newest parameters in full, in place of a full frame its outbox
        dropped because it was still writing an earlier one (a slow reader: the dropped frame
        would have pinned one more snapshot), or as a replica's member's pull. Not a release:
        the policy is not asked and the worker's gates do not change. ``peer``: the session
        that asked (nothing happens when the worker is on another one)."""
        entry = self.members.active.get(wid)
        if entry is None or entry.peer is None or (peer is not None and entry.peer is not peer):
            return
        self.members.update(entry, version=-1)  # full, not a delta
        entry.held_ref = None
        if self.deferred:
            self.pending[entry.facts.worker] = None
            return
        wid = entry.facts.worker
        release = self._frames(
            wid, self.params_codec(entry), -1, None, self.link(entry), entry.hashes
        )
        self.send(wid, release)

    def take(self) -> list[Want]:
        """The pending releases of still active workers (and none pending any more)."""
        active = self.members.active
        wants = [
            (
                wid,
                self.params_codec(entry),
                entry.facts.version,
                entry.held_ref,
                self.link(entry),
                entry.hashes,
            )
            for wid in self.pending
            if (entry := active.get(wid)) is not None
        ]
        self.pending = {}
        return wants

    def encode(self, wants: list[Want]) -> dict[int, Outgoing]:
        """Run the queued steps, then each release's frames; one encoding per (codec, version,
        reference, hash, pulled or not), shared by every worker holding it. The version's
        snapshot (a copy of the model) is taken only for a release the head sends itself."""
        self.store.flush()
        if not wants:
            return {}
        made: dict[tuple[str, int, int | None, bool, bool], Outgoing] = {}
        out = {}
        for wid, codec, held, ref, link, hashes in wants:
            key = (codec, held, ref, hashes, self._pulls(wid))
            if key not in made:
                made[key] = self._frames(wid, codec, held, ref, link, hashes)
            out[wid] = made[key]
        return out

    def _frames(
        self, wid: int, codec: str, held: int, ref: int | None, link: float | None, hashes: bool
    ) -> Outgoing:
        """Worker ``wid``'s release of the store's current version. A worker that pulls gets the
        ``params_at`` pointer wherever the downlink would send a full frame; where that full
        frame would keep no reference (a lossless codec, a link never worth a delta) neither
        the snapshot nor the frame is made: the pointer reads the store in place."""
        pointer = self.pointer if self._pulls(wid) else None
        if pointer is None:
            return self.downlink.frames(
                codec, held, self.store.snapshot(), ref, link, hashes=hashes
            )
        store = self.store
        if not store.holds_params or self.downlink.keeps_nothing(codec, link):
            # (a head whose pservers hold the parameters has no other way: every release a pull)
            frame = pointer(store)
            return Outgoing([frame], store.version, True)
        return self.downlink.frames(
            codec, held, store.snapshot(), ref, link, hashes=hashes, instead=lambda: pointer(store)
        )

    def publish(self) -> None:
        """The batch's publish, here and now: its updates applied, each release's frames sent."""
        self.meters.publishes += 1
        wants = self.take()
        self.send_all(wants, self.encode(wants))

    async def publish_off_loop(self) -> None:
        """:meth:`publish` with the encoding in a worker thread for models of
        :data:`OFF_LOOP_PARAMS` or more (the caller, the engine task, awaits it: one writer still
        owns the state while the sockets keep flowing). Encoding that fails drops the released
        workers' sessions (:meth:`drop`) rather than leave them waiting."""
        self.meters.publishes += 1
        wants = self.take()
        try:
            if self.store.n_params >= OFF_LOOP_PARAMS:
                frames = await asyncio.to_thread(self.encode, wants)
            else:
                frames = self.encode(wants)
        except Exception:
            log.exception("publishing parameters failed; dropping %d session(s)", len(wants))
            self.drop(wants, "the daemon could not encode parameters for this worker; reconnect")
        else:
            self.send_all(wants, frames)

    def send_all(self, wants: list[Want], frames: dict[int, Outgoing]) -> None:
        for wid, *_ in wants:
            self.send(wid, frames[wid])

    def drop(self, wants: list[Want], why: str) -> None:
        """Nothing to send: rather than leave the released workers waiting for parameters, drop
        their sessions; they reconnect as themselves and get parameters in full."""
        for wid, *_ in wants:
            entry = self.members.active.get(wid)
            if entry is not None and entry.peer is not None:
                entry.peer.close(why)

    def send(self, wid: int, release: Outgoing) -> None:
        entry = self.members.active.get(wid)
        if entry is None or entry.peer is None:
            return
        self.members.update(entry, version=release.version)
        entry.held_ref = release.ref
        entry.stats.releases += 1
        for frame in release.frames:
            entry.stats.bytes_out += len(frame)
            self.meters.bytes_out += len(frame)
            entry.peer.send_params(frame, full=release.full)
        # A pipelined worker counts its pushes until each is answered with a frame; one release
        # for a wait that two of its pushes joined would leave one unanswered for good, and it
        # would never compute with a push in flight again. An empty delta ("go on") answers it.
        if entry.joined_pushes:
            empty = self.downlink.go_on(release.version)
        for _ in range(entry.joined_pushes):
            entry.stats.bytes_out += len(empty)
            self.meters.bytes_out += len(empty)
            entry.peer.send_params(empty, full=False)
        entry.joined_pushes = 0

    def _pulls(self, wid: int) -> bool:
        """Whether worker ``wid`` pulls a full release from the pservers (see :attr:`pointer`)."""
        entry = self.members.active.get(wid)
        return entry is not None and entry.pulls and entry.transport != "shm"

    @staticmethod
    def params_codec(entry: WorkerEntry) -> str:
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

    def link(self, entry: WorkerEntry) -> float | None:
        """The worker's link in bytes/s for the downlink's choice: unbounded for loopback or
        ``downlink = "full"``, unknown (deltas) for ``"delta"``."""
        mode = self.config.downlink
        if mode == "full" or (mode == "auto" and entry.same_host):
            return math.inf
        return None if mode == "delta" else entry.facts.link_bps
