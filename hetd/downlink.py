"""Parameters on their way to workers: full frames, or quantized deltas shared by a codec group.

For a lossless codec every release is a full ``params`` frame of the current version, encoded once
per version. For a lossy codec ``c`` the daemon keeps one *reference* ``R_c``: the parameters every
worker of that group reconstructs. Advancing it to version ``v`` encodes ``D = params(v) - R_c`` once,
and every worker holding the previous reference applies the same frame (``R_c += decode(D)``). What
the codec lost stays in ``params - R_c`` and goes out with the next delta — error feedback for the
whole group, so every frame is encoded once per (codec, base version) and shared. A worker that
holds anything but the previous reference gets the reference in full (lossless), which puts it back
in the group: a release is always one frame. (A chain of k deltas would cost k lossy frames — more
than one full frame once k * ratio >= 1, as with int8 and four asynchronous workers — and a worker
counts each frame as a release.) Under the daemon the engine publishes once for every command
already queued, so the reference moves once per publish and a busy group mostly holds the previous
one.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass

import numpy as np

from hetd import codecs, wire
from hetd.store import Snapshot


@dataclass
class _Reference:
    version: int
    tensors: dict[str, np.ndarray]
    last: tuple[int, int, bytes] | None = None  # (from version, to version, frame)
    full: tuple[int, bytes] | None = None


class Downlink:
    """Encodes parameter frames for workers by codec; the engine's only writer calls it."""

    def __init__(self) -> None:
        self._refs: dict[str, _Reference] = {}
        self._full: dict[tuple[int, str], bytes] = {}
        self._codecs: dict[str, codecs.Codec] = {}

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
        holders: Collection[int | None] | None = None,
    ) -> tuple[list[bytes], int, bool]:
        """Frames that bring a worker of codec ``spec`` holding version ``held`` (None or -1:
        nothing usable) to ``snap``; the version it then holds; whether they are one full frame.

        ``holders`` are the versions held by every worker of this codec released with it (the
        engine's publish knows them all). When none of them holds the group's reference, a delta
        would serve nobody: the reference is reset to ``snap`` itself (lossless, nothing left for
        error feedback) and everyone gets it in full — the quantize-and-track work is skipped.
        """
        codec = self._codec(spec)
        if codec.lossless:
            return [self._full_frame(snap.version, snap.tensors, spec)], snap.version, True
        ref = self._refs.get(spec)
        if ref is None or (
            ref.version < snap.version and holders is not None and ref.version not in holders
        ):
            # A store snapshot's arrays are read-only: the reference shares them until it
            # advances (anything writable is copied, so the reference never writes into it).
            tensors = {
                k: v if not v.flags.writeable else np.array(v, np.float32)
                for k, v in snap.tensors.items()
            }
            ref = self._refs[spec] = _Reference(snap.version, tensors)
        elif ref.version < snap.version:
            self._advance(ref, codec, snap)
        chain = self._chain(ref, held)
        if chain is None:
            if ref.full is None or ref.full[0] != ref.version:
                frame = wire.encode(
                    "params",
                    0,
                    version=ref.version,
                    full=True,
                    tensors=codecs.encode_tree(ref.tensors, codecs.get_codec("none")),
                )
                ref.full = (ref.version, frame)
            return [ref.full[1]], ref.version, True
        return chain, ref.version, False

    def _advance(self, ref: _Reference, codec: codecs.Codec, snap: Snapshot) -> None:
        delta = {k: np.subtract(snap.tensors[k], ref.tensors[k]) for k in ref.tensors}
        encoded = codecs.encode_tree(delta, codec)
        for k, t in encoded.items():
            step = codecs.decode_tensor(t, k)
            if ref.tensors[k].flags.writeable:
                ref.tensors[k] += step
            else:  # still the snapshot's (read-only) array: the first advance copies it
                ref.tensors[k] = np.add(ref.tensors[k], step)
        frame = wire.encode(
            "params", 0, version=snap.version, full=False, base=ref.version, tensors=encoded
        )
        ref.last = (ref.version, snap.version, frame)
        ref.version = snap.version

    def _chain(self, ref: _Reference, held: int | None) -> list[bytes] | None:
        if held is None:
            return None
        if held == ref.version:
            return [self._empty(ref.version)]
        if ref.last is not None and ref.last[0] == held and ref.last[1] == ref.version:
            return [ref.last[2]]
        return None

    def _empty(self, version: int) -> bytes:
        """A delta of nothing: the worker may go on with what it has."""
        return wire.encode("params", 0, version=version, full=False, base=version, tensors={})

    def _full_frame(self, version: int, tensors: Mapping[str, np.ndarray], spec: str) -> bytes:
        key = (version, spec)
        frame = self._full.get(key)
        if frame is None:
            frame = wire.encode(
                "params",
                0,
                version=version,
                full=True,
                tensors=codecs.encode_tree(tensors, self._codec(spec)),
            )
            self._full = {k: v for k, v in self._full.items() if k[0] == version}
            self._full[key] = frame
        return frame
