"""Parameters on their way to workers: full frames, or quantized deltas against what a worker holds.

For a lossless codec every release is a full ``params`` frame of the current version, encoded once
per version. For a lossy codec the daemon keeps *references*: the exact parameters a worker
reconstructed from what it was sent. A release to a worker holding reference ``R`` is one frame, the
delta ``D = params(v) - R`` in the worker's codec; the daemon replays it (``R' = R + decode(D)``, the
same float32 addition the worker does) and the worker now holds ``R'``. What the codec lost stays in
``params - R'`` and goes out with that worker's next delta, so each worker's error feedback is exact
and never accumulates. Every worker holding the same reference shares the frame and the new
reference: a delta is encoded once per (codec, base reference, version). A full frame (lossless) goes
on join, after a reconnect, or when the worker's reference was evicted; its reference is the
snapshot itself (shared, never copied). A full frame carries the snapshot's hash
(:func:`hetd.protocol.params.param_hash`, computed once per version by the store) for the worker to
check; deltas carry none (they are lossy by design).

A delta costs the daemon CPU (subtract, quantize, replay; docs/benchmark.md gives the figure) to
save bytes on the link. When the worker's measured link is so fast that the bytes saved take less
time than the encoding did (loopback, a worker on the head node), it gets the full frame instead,
which is encoded once per version for everybody.

References cost one float32 copy of the model each; the least recently used go first once there are
more than ``max_refs`` or they hold more than ``max_bytes`` (a worker that held one gets the next
release in full). A worker whose link is unbounded (loopback, ``downlink = "full"``) never gets a
delta, so none is kept for it; a loopback worker that emulates a slower link is not such a worker
(:attr:`hetd.protocol.messages.JoinIn.downlink_same_host`). Only the daemon's engine calls this (on its thread, one publish at a time).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from hetd.codecs import registry as codecs
from hetd.core.store import Snapshot
from hetd.protocol import wire

MAX_REFS = 64
MAX_REF_BYTES = 512 << 20
# s per parameter of an int8 delta, for runs that must not depend on load (docs/benchmark.md)
DELTA_S_PER_PARAM = 2.3e-9


@dataclass(frozen=True)
class Outgoing:
    """What a worker is sent: the frames, the version and reference it then holds, and whether the
    frames are one full (lossless) frame."""

    frames: list[bytes | memoryview]  # a full frame may be a view of the shared-memory ring
    version: int
    full: bool
    ref: int | None = None


@dataclass
class _Reference:
    version: int
    tensors: dict[str, np.ndarray]
    used: int
    nbytes: int = field(init=False)

    def __post_init__(self) -> None:
        self.nbytes = sum(int(t.nbytes) for t in self.tensors.values())


class Downlink:
    """Encodes parameter frames for workers by codec; the engine's only writer calls it."""

    def __init__(
        self,
        max_refs: int = MAX_REFS,
        max_bytes: int = MAX_REF_BYTES,
        s_per_param: float | None = None,
        hashes: bool = True,
    ) -> None:
        """``s_per_param``: a fixed delta cost per parameter instead of the measured one.
        ``hashes``: full frames carry the snapshot's hash (22 bytes a frame)."""
        self.hashes = hashes
        self.max_refs = max(2, max_refs)
        self.s_per_param = s_per_param
        self.max_bytes = max_bytes
        self._refs: dict[int, _Reference] = {}
        self._next_ref = 1
        self._tick = 0
        # (version, codec, with the hash) -> full frame
        self._full: dict[tuple[int, str, bool], bytes] = {}
        self._snap_refs: dict[int, int] = {}  # version -> the reference that is the snapshot
        self._deltas: dict[tuple[str, int, int], Outgoing] = {}  # (codec, base ref, version)
        self._codecs: dict[str, codecs.Codec] = {}
        self._cost: dict[str, float] = {}  # codec -> seconds per delta (EWMA), for the choice

    @property
    def refs(self) -> int:
        """References held now (for tests and status)."""
        return len(self._refs)

    def _codec(self, spec: str) -> codecs.Codec:
        codec = self._codecs.get(spec)
        if codec is None:
            codec = self._codecs[spec] = codecs.from_spec(spec)
        return codec

    def frames(
        self,
        spec: str,
        held: int | None,
        snap: Snapshot,
        ref: int | None = None,
        link_bps: float | None = None,
        *,
        hashes: bool = True,
        instead: Callable[[], bytes] | None = None,
    ) -> Outgoing:
        """The release that brings a worker of codec ``spec`` holding version ``held`` (None or -1:
        nothing usable) through reference ``ref`` (what an earlier release returned) to ``snap``;
        ``link_bps``: the worker's measured link (None: unknown, deltas are worth it); ``hashes``:
        the worker takes the ``hash`` field (a worker from before it refuses a frame with one);
        ``instead``: makes the frame a full release is sent as in place of a full frame (the
        pservers' ``params_at``), which is then not built."""
        codec = self._codec(spec)
        hashes = hashes and self.hashes
        if codec.lossless:
            frame = instead() if instead is not None else self._full_frame(snap, spec, hashes)
            return Outgoing([frame], snap.version, True)
        if link_bps == math.inf:
            # Never a delta on this link (the same host, or the operator said so): no reference
            # to keep. One would hold the snapshot's frame until evicted (at 10M parameters, 12
            # old frames under the 512 MiB cap), and each new frame would need fresh pages.
            frame = instead() if instead is not None else self._full_frame(snap, "none", hashes)
            return Outgoing([frame], snap.version, True)
        self._forget_older(snap.version)
        base = self._refs.get(ref) if ref is not None else None
        if base is None or held is None or base.version != held or held > snap.version:
            return self._full_release(snap, hashes, instead)
        self._tick += 1
        base.used = self._tick
        if base.version == snap.version:
            return Outgoing([self.go_on(snap.version)], snap.version, False, ref)
        assert ref is not None
        key = (spec, ref, snap.version)
        hit = self._deltas.get(key)
        if hit is not None and hit.ref in self._refs:
            self._refs[hit.ref].used = self._tick
            return hit
        if self._full_is_cheaper(spec, codec, base, link_bps):
            return self._full_release(snap, hashes, instead)
        started = time.perf_counter()
        release = self._delta(codec, ref, base, snap)
        took = time.perf_counter() - started
        last = self._cost.get(spec)
        self._cost[spec] = took if last is None else 0.8 * last + 0.2 * took
        self._deltas[key] = release
        return release

    def _full_is_cheaper(
        self, spec: str, codec: codecs.Codec, base: _Reference, link_bps: float | None
    ) -> bool:
        if link_bps == math.inf:  # the same host, or the operator said so
            return True
        if self.s_per_param is not None:
            cost: float | None = self.s_per_param * base.nbytes / 4
        else:
            cost = self._cost.get(spec)
        if cost is None or link_bps is None or link_bps <= 0:
            return False
        saved = base.nbytes * (1.0 - codec.ratio)
        return saved / link_bps < cost

    def _delta(self, codec: codecs.Codec, ref: int, base: _Reference, snap: Snapshot) -> Outgoing:
        # (np.asarray: the difference of two 0-d arrays is a scalar, not a buffer to reuse)
        delta = {k: np.asarray(np.subtract(snap.tensors[k], base.tensors[k])) for k in base.tensors}
        encoded = codecs.encode_tree(delta, codec)
        tensors = {}
        for k, t in encoded.items():
            step = codecs.decode_tensor(t, k)
            np.add(base.tensors[k], step, out=delta[k])  # reuse the delta's buffer
            tensors[k] = delta[k]
        frame = wire.encode(
            "params", 0, version=snap.version, full=False, base=base.version, tensors=encoded
        )
        new = self._add(_Reference(snap.version, tensors, self._tick))
        return Outgoing([frame], snap.version, False, new)

    def keeps_nothing(self, spec: str, link_bps: float | None) -> bool:
        """Whether every release :meth:`frames` makes for codec ``spec`` on this link is one full
        frame that keeps no reference (a lossless codec; a link never worth a delta)."""
        return self._codec(spec).lossless or link_bps == math.inf

    def _full_release(
        self, snap: Snapshot, hashes: bool, instead: Callable[[], bytes] | None = None
    ) -> Outgoing:
        """The snapshot in full (or as ``instead`` makes it); its reference shares the
        snapshot's read-only arrays."""
        ref = self._snap_refs.get(snap.version)
        if ref is None or ref not in self._refs:
            tensors = {
                k: v if not v.flags.writeable else np.array(v, np.float32)
                for k, v in snap.tensors.items()
            }
            ref = self._snap_refs[snap.version] = self._add(
                _Reference(snap.version, tensors, self._tick)
            )
        self._refs[ref].used = self._tick
        frame = instead() if instead is not None else self._full_frame(snap, "none", hashes)
        return Outgoing([frame], snap.version, True, ref)

    def _add(self, reference: _Reference) -> int:
        ref = self._next_ref
        self._next_ref += 1
        self._refs[ref] = reference
        self._evict(keep=ref)
        return ref

    def _evict(self, keep: int) -> None:
        total = sum(r.nbytes for r in self._refs.values())
        while len(self._refs) > 1 and (len(self._refs) > self.max_refs or total > self.max_bytes):
            oldest = min((r for r in self._refs if r != keep), key=lambda r: self._refs[r].used)
            total -= self._refs.pop(oldest).nbytes

    def _forget_older(self, version: int) -> None:
        """Frames for versions before ``version`` are never sent again."""
        if any(k[2] < version for k in self._deltas):
            self._deltas = {k: v for k, v in self._deltas.items() if k[2] >= version}
        if any(v < version for v in self._snap_refs):
            self._snap_refs = {v: r for v, r in self._snap_refs.items() if v >= version}

    @staticmethod
    def go_on(version: int) -> bytes:
        """A delta of nothing at ``version``: the worker may go on with what it has."""
        return wire.encode("params", 0, version=version, full=False, base=version, tensors={})

    def _full_frame(self, snap: Snapshot, spec: str, hashes: bool) -> bytes | memoryview:
        """The full frame of ``snap`` in lossless codec ``spec``, with the snapshot's hash when
        ``hashes`` (the worker checks it after applying the frame)."""
        if spec == "none":  # packed once by the store, from the snapshot's own memory
            packed = snap.hashed_frame() if hashes else snap.plain_frame()
            if packed is not None:
                return packed
        version = snap.version
        key = (version, spec, hashes)
        frame = self._full.get(key)
        if frame is None:
            extra = {"hash": snap.hash} if hashes else {}
            frame = wire.encode(
                "params",
                0,
                version=version,
                full=True,
                tensors=codecs.encode_tree(snap.tensors, self._codec(spec)),
                **extra,
            )
            self._full = {k: v for k, v in self._full.items() if k[0] == version}
            self._full[key] = frame
        return frame
