"""The daemon's side of the same-host shared-memory path (:mod:`hetd.protocol.shm`).

One :class:`ShmHub` per daemon owns the downlink ring, created on the first offer (a daemon with
no same-host worker creates nothing) and unlinked when the daemon stops. Each published full
``params`` frame is packed into the ring by the store (or, when no slot was free then, copied in)
once, however many workers it goes to; every one of them gets the same small ``params_ref``. The slot a worker was last sent is held for it (not rewritten)
until it is sent a newer one or leaves, so a worker that reads late under load still finds its
frame; when every slot is held (more same-host workers than slots) the frame goes over the socket. One :class:`Uplink` per session maps the worker's own ring
read-only once the worker proved (``shm_ready``) that it mapped the daemon's, and unlinks it when
the session ends (a worker killed without cleaning up leaves nothing behind).
"""

from __future__ import annotations

import logging
import threading
import weakref
from dataclasses import dataclass
from functools import partial

import numpy as np

from hetd.protocol import shm, wire
from hetd.protocol.aligned import decode_aligned
from hetd.protocol.params import params_envelope

log = logging.getLogger("hetd.server.shm")

SLOTS = 8  # the downlink ring's slots at most ...
MIN_SLOTS = 3  # ... and at least (one held by a worker, the newest, one to write)
RING_BYTES = 512 << 20  # ... as many as fit in this, between the two


@dataclass
class _Lease:
    """A slot the store packs a snapshot's frame into (:meth:`ShmHub.reserve`): busy for as long
    as ``root`` (the slot's bytes, which every view of the frame keeps alive) lives."""

    root: weakref.ref[np.ndarray]
    frame: weakref.ref[memoryview] | None = None  # the frame, once committed
    ref: shm.Ref | None = None
    version: int = -1


class ShmHub:
    """The downlink ring and the frames written into it (each once).

    It is also the store's frame sink (:class:`hetd.core.peers.FrameSink`): once a same-host
    worker took the ring, the store packs each snapshot's frame straight into a free slot
    (:meth:`reserve`, :meth:`commit`) instead of into fresh memory, so publishing a version to
    every same-host worker costs one copy of the parameters and no page faults. That slot stays
    busy while anything in the daemon still references the frame or the snapshot's tensors (a
    socket worker's send, an evaluation, a checkpoint); when every slot is busy the store packs
    a fresh frame as before and :meth:`publish` copies it in."""

    def __init__(self, slots: int = SLOTS, ring_bytes: int = RING_BYTES) -> None:
        self.slots = slots
        self.ring_bytes = ring_bytes
        self.ring: shm.Ring | None = None
        self.closed = False
        self._lock = threading.Lock()  # offer and the store's reserve run in threads
        # signature of a frame copied in -> (its reference, its version, its slot): the newest few
        self._written: dict[tuple[int, int, bytes], tuple[shm.Ref, int, int]] = {}
        self._leases: dict[int, _Lease] = {}  # slot -> the store's frame packed there
        self._held: dict[int, int] = {}  # holder (a session) -> the slot it was last sent
        self._last_slot = -1  # the slot a frame was copied into last (it may still go to others)
        self.frames_written = 0  # params frames put into the ring (packed there or copied)
        self.frames_packed = 0  # ... of which packed in place by the store
        self.bytes_written = 0
        self.pushes_read = 0  # pushes read from workers' rings

    def offer(self, slot_bytes: int) -> shm.Ring | None:
        """The ring to offer a same-host worker (made now if need be: call it in a thread, it
        takes the ring's memory); None when this host has no shared memory, the daemon is
        stopping, the ring is too small for ``slot_bytes`` or cannot be made (logged once)."""
        with self._lock:
            if self.closed or not shm.available():
                return None
            if self.ring is not None:
                return self.ring if self.ring.slot_bytes >= slot_bytes else None
            gone = shm.sweep_dead()
            if gone:
                log.info("removed %d shared-memory rings of processes gone: %s", len(gone), gone)
            slots = max(MIN_SLOTS, min(self.slots, self.ring_bytes // max(1, slot_bytes)))
            try:
                ring = shm.Ring("dl", slots, slot_bytes, prefault=True)
            except OSError as exc:
                log.warning("no shared memory for same-host workers: %s", exc)
                self.closed = True
                return None
            if self.closed:  # the daemon stopped meanwhile
                ring.close()
                return None
            self.ring = ring
            return ring

    def reserve(self, nbytes: int) -> np.ndarray | None:
        """A free slot's bytes for the store to pack an ``nbytes`` frame into (then
        :meth:`commit`); None when there is no ring, the frame does not fit or every slot is
        busy. Thread-safe."""
        ring = self.ring
        if ring is None or not shm.MIN_BYTES <= nbytes <= ring.slot_bytes:
            return None
        with self._lock:
            if self.closed or self.ring is not ring:
                return None
            slot = self._free_slot(ring, None)
            if slot is None:
                return None
            try:
                root = ring.begin(slot)
            except shm.ShmError:
                return None
            self._leases[slot] = _Lease(weakref.ref(root))
            self._written = {k: v for k, v in self._written.items() if v[2] != slot}
            return root

    def commit(self, buf: np.ndarray, frame: memoryview, version: int) -> None:
        """The store packed ``frame`` (of ``version``) into ``buf`` (from :meth:`reserve`): it is
        readable now, and :meth:`publish` sends it by reference. Thread-safe."""
        with self._lock:
            ring = self.ring
            for slot, lease in self._leases.items():
                if lease.root() is buf and ring is not None and lease.ref is None:
                    try:
                        lease.ref = ring.commit(slot, frame.nbytes)
                    except shm.ShmError:  # closed: the daemon is stopping
                        return
                    lease.frame = weakref.ref(frame)
                    lease.version = version
                    self.frames_written += 1
                    self.frames_packed += 1
                    self.bytes_written += frame.nbytes
                    return

    def publish(self, frame: bytes | memoryview, holder: int) -> bytes | None:
        """The ``params_ref`` frame that sends a full ``params`` frame to ``holder`` (copied into
        the ring on its first call, unless the store packed it there); None when it should go
        over the socket (small, no ring, or no free slot)."""
        ring = self.ring
        if ring is None or len(frame) < shm.MIN_BYTES or len(frame) > ring.slot_bytes:
            return None
        with self._lock:
            for slot, lease in self._leases.items():
                if lease.ref is not None and lease.frame is not None and lease.frame() is frame:
                    self._held[holder] = slot
                    return wire.encode("params_ref", 0, version=lease.version, **lease.ref.fields())
            key = (id(frame), len(frame), bytes(frame[:48]) + bytes(frame[-24:]))
            hit = self._written.get(key)
            if hit is None or ring.slot_gen(hit[2]) != hit[0].gen:
                version = params_version(frame)
                free = self._free_slot(ring, holder)
                if version is None or free is None:
                    return None
                try:
                    hit = (ring.write(frame, slot=free), version, free)
                except shm.ShmError:  # closed: the daemon is stopping
                    return None
                self._leases.pop(free, None)
                self._last_slot = free
                self.frames_written += 1
                self.bytes_written += len(frame)
                self._written = {k: v for k, v in self._written.items() if v[1] >= version - 4}
                self._written[key] = hit
            ref, version, slot = hit
            self._held[holder] = slot
            return wire.encode("params_ref", 0, version=version, **ref.fields())

    def _free_slot(self, ring: shm.Ring, holder: int | None) -> int | None:
        """A slot nobody holds (the holder's own counts as free: a newer frame replaces it),
        whose packed frame nothing references, other than the one copied into last; in turn
        from the ring's next."""
        busy = {s for h, s in self._held.items() if h != holder} | {self._last_slot}
        busy |= {s for s, lease in self._leases.items() if lease.root() is not None}
        for i in range(ring.slots):
            slot = (ring.next_slot + i) % ring.slots
            if slot not in busy:
                return slot
        return None

    def release(self, holder: int) -> None:
        """``holder`` left: the slot it held is free."""
        with self._lock:
            self._held.pop(holder, None)

    def close(self) -> None:
        """Unlink the ring; no more offers."""
        with self._lock:
            self.closed = True
            if self.ring is not None:
                self.ring.close()
                self.ring = None
            self._written, self._held, self._leases = {}, {}, {}


def params_version(frame: bytes | memoryview) -> int | None:
    """A full ``params`` frame's version, read from the fields before its tensors."""
    env = params_envelope(frame)
    return None if env is None or env[0].get("full") is not True else env[1]


class Uplink:
    """One worker's ring, mapped read-only after it proved it mapped ours."""

    def __init__(self, hub: ShmHub, nonce: str, segment: str) -> None:
        """Check the proof and map the ring; :class:`hetd.protocol.shm.ShmError` says why not."""
        ring = hub.ring
        if ring is None or nonce != ring.nonce:
            raise shm.ShmError("bad_nonce", "shm_ready: the nonce is not the one in our segment")
        if not segment.startswith("hetd-up-"):
            raise shm.ShmError("bad_ref", f"shm_ready: {segment!r} is not a worker segment")
        self.reader = shm.RingReader(segment)
        self.hub = hub

    def read_push(self, msg: wire.Message, max_bytes: int) -> tuple[wire.Message, int]:
        """The ``push`` a ``push_ref`` names, and its size; :class:`hetd.protocol.wire.ProtocolError`
        with the push's id when the reference or the frame is not right (nothing is applied)."""
        ref = shm.ref_of(msg.body)
        try:  # unpacked from the mapping: the tensors' bytes copied out once, 64-byte aligned,
            # so the optimizer step takes them without another copy (hetd.protocol.aligned)
            push = self.reader.read_with(ref, partial(decode_aligned, max_size=max_bytes))
        except shm.ShmError as exc:
            raise wire.ProtocolError(
                exc.code, f"push_ref {msg.id}: {exc.message}", msg.id
            ) from None
        except wire.ProtocolError as exc:
            raise wire.ProtocolError(
                exc.code, f"push_ref {msg.id}: {exc.message}", msg.id
            ) from None
        if push.type != "push" or push.id != msg.id:
            raise wire.ProtocolError(
                "bad_ref",
                f"push_ref {msg.id}: names a {push.type} {push.id}, not push {msg.id}",
                msg.id,
            )
        self.hub.pushes_read += 1
        return push, ref.length

    def close(self) -> None:
        """Unmap the worker's ring and unlink it."""
        self.reader.close()
        shm.unlink(self.reader.name)
