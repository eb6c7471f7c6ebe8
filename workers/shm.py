"""A worker's side of the same-host shared-memory path (:mod:`hetd.protocol.shm`).

A worker whose hello names ``shm`` and that the daemon sees on loopback gets a ``shm_offer``
naming the daemon's ring. :meth:`ShmLink.accept` maps it read-only, makes the worker's own ring
for its pushes and answers ``shm_ready`` with the nonce it read from the daemon's ring (the proof
that both see the same memory: a worker in another container or behind a tunnel cannot open it
and simply stays on the socket). From then on a ``params_ref`` is read from the daemon's ring
(:meth:`ShmLink.read_params`: a stale or wrong one makes the worker pull again) and a big push is
written into the worker's ring with a ``push_ref`` sent instead (:meth:`ShmLink.push_ref`).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from functools import partial

from hetd.protocol import shm, wire
from hetd.protocol.aligned import decode_aligned
from hetd.protocol.frames import Params, ParamsRef, PushRef, ShmReady, read

log = logging.getLogger("hetd.worker")

SLOTS = (
    2  # the worker's ring: pushes in flight at once (a third waits for an ack, or goes by socket)
)


def wanted(enabled: bool) -> tuple[str, ...]:
    """The hello feature to name: shared memory when enabled and this host has it."""
    return (shm.FEATURE,) if enabled and shm.available() else ()


class ShmLink:
    """The daemon's ring (read-only) and the worker's own, for one session."""

    def __init__(self, down: shm.RingReader, up: shm.Ring) -> None:
        self.down = down
        self.up = up
        self._slot_push: dict[int, int] = {}  # slot -> the push id written there last
        self.params_read = 0
        self.pushes_written = 0

    @classmethod
    def accept(cls, segment: str) -> tuple[ShmLink, bytes] | None:
        """Map the offered ring and make ours: the link and the ``shm_ready`` frame; None (and
        the socket as before) when it cannot be opened here."""
        try:
            down = shm.RingReader(segment, populate=True)
        except shm.ShmError as exc:
            log.info("shared memory offered but not usable here (%s): using the socket", exc)
            return None
        try:
            up = shm.Ring("up", SLOTS, down.slot_bytes)
        except OSError as exc:
            down.close()
            log.info("cannot make a shared-memory ring (%s): using the socket", exc)
            return None
        ready = ShmReady(down.nonce, up.name).encode()
        log.info("shared memory on: reading %s, pushing through %s", down.name, up.name)
        return cls(down, up), ready

    def read_params(self, msg: ParamsRef) -> tuple[int, Params]:
        """The size of the ``params`` frame a ``params_ref`` names, and the frame decoded
        straight from the daemon's ring: the tensors' bytes are copied out once, by the
        decoder, with no copy of the whole frame first, into 64-byte-aligned buffers that JAX
        then takes as they are (:mod:`hetd.protocol.aligned`). :class:`shm.ShmError` when it names
        none or the slot was rewritten while it was read (the caller pulls again)."""
        ref = msg.ref
        named = self.down.read_with(ref, partial(decode_aligned, max_size=ref.length))
        params = read(named)
        if not isinstance(params, Params) or params.version != msg.version:
            raise shm.ShmError(
                "bad_ref", f"params_ref of version {msg.version} names another frame"
            )
        self.params_read += 1
        return ref.length, params

    def push_ref(
        self, frame: bytes | wire.Parts, push_id: int, unacked: Mapping[int, object]
    ) -> bytes | None:
        """Write push ``push_id`` (a frame, or its :class:`hetd.protocol.wire.Parts`: their
        segments are copied into the slot as they are) into our ring and return its
        ``push_ref``; None when it should go over the socket (small, too big, or its slot still
        holds a push not yet answered)."""
        parts = (frame,) if isinstance(frame, bytes) else frame.segments
        size = len(frame) if isinstance(frame, bytes) else frame.nbytes
        if size < shm.MIN_BYTES or size > self.up.slot_bytes:
            return None
        slot = self.up.next_slot
        if self._slot_push.get(slot, 0) in unacked:
            return None
        ref = self.up.write(*parts)
        self._slot_push[slot] = push_id
        self.pushes_written += 1
        return PushRef(push_id, ref).encode()

    def close(self) -> None:
        """Unmap the daemon's ring, unlink ours."""
        self.down.close()
        self.up.close()
