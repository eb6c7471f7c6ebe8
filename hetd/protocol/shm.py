"""Shared-memory rings: how a daemon and a worker on the same host pass big frames without a socket.

A :class:`Ring` is one file under ``/dev/shm`` (POSIX shared memory), mapped by its writer
read-write and by its reader read-only. It holds a header (magic, slot count and size, a random
nonce) and ``slots`` slots, each a small header (generation, length) and the bytes of one frame.
The writer takes the slots in turn: it marks the slot as being written (generation 0), copies the
frame in, then stamps its length and a new, ever-increasing generation. A reference to a frame is
``(segment, offset, length, gen)``; :meth:`RingReader.read` copies those bytes out and checks the
slot's generation before and after the copy, so a reader never takes a frame that was overwritten
(or half written) while it read: it gets :class:`StaleRef` and asks again.

Who uses it (negotiated, see docs/design.md, "Shared memory"): the daemon packs each published
full ``params`` frame straight into a slot of its ring (:meth:`Ring.begin`, :meth:`Ring.commit`:
no frame of its own first) and sends every same-host worker a ``params_ref``; a
worker writes each push into its own ring and sends a ``push_ref``. Whoever created a ring unlinks
it (:meth:`Ring.close`); the daemon also unlinks a worker's ring when its session ends, so a worker
that died leaves nothing in ``/dev/shm``. A reference is checked strictly (:func:`check_ref`): the
segment must be the one agreed for that peer, and the range one whole slot's frame.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import re
import secrets
import struct
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Final, TypeVar

import numpy as np

T = TypeVar("T")
SHM_DIR: Final = "/dev/shm"
MAGIC: Final = b"HETDSHM1"
HEAD: Final = 64  # ring header: magic, slots (u32), slot size (u64), nonce (16 bytes), padding
SLOT_HEAD: Final = 16  # slot header: generation (u64, 0 while written), length (u64)
FEATURE: Final = "shm"  # named in a worker's hello ``features`` when it can take shared memory
MIN_BYTES: Final = 4096  # frames smaller than this go over the socket as before
NAME_RE: Final = re.compile(r"hetd-(dl|up)-[0-9a-f]{8,40}")


class ShmError(ValueError):
    """A reference that does not name a frame of the agreed ring. ``code``: short reason."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class StaleRef(ShmError):
    """The slot was rewritten since the reference was made (the reader was too slow)."""

    def __init__(self, message: str) -> None:
        super().__init__("stale_ref", message)


def available() -> bool:
    """Whether this host has POSIX shared memory as files (Linux's ``/dev/shm``)."""
    return os.path.isdir(SHM_DIR) and os.access(SHM_DIR, os.W_OK)


def _path(name: str) -> str:
    if not NAME_RE.fullmatch(name):
        raise ShmError("bad_ref", f"segment {name!r} is not a hetd segment name")
    return os.path.join(SHM_DIR, name)


@dataclass(frozen=True, slots=True)
class Ref:
    """Where one frame lies: the ring's name, the frame's offset and length, its slot's gen."""

    segment: str
    offset: int
    length: int
    gen: int

    def fields(self) -> dict[str, object]:
        """The wire fields of a ``params_ref`` / ``push_ref``."""
        return {
            "segment": self.segment,
            "offset": self.offset,
            "length": self.length,
            "gen": self.gen,
        }


class Ring:
    """The writer's side: a ring it created, ``slots`` slots of ``slot_bytes`` each;
    ``prefault``: take its memory now (fallocate) and map it populated, so that no write faults
    a page in later (a fresh 4 KiB page per fault costs more than copying into it)."""

    def __init__(self, kind: str, slots: int, slot_bytes: int, prefault: bool = False) -> None:
        self.name = f"hetd-{kind}-{os.getpid():08x}{secrets.token_hex(6)}"  # pid, then random
        self.path = _path(self.name)
        self.slots = max(1, slots)
        self.slot_bytes = slot_bytes
        self.nonce = secrets.token_hex(16)  # 16 bytes in the header
        self.size = HEAD + self.slots * (SLOT_HEAD + slot_bytes)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            os.ftruncate(fd, self.size)
            if prefault:
                os.posix_fallocate(fd, 0, self.size)  # ENOSPC now rather than SIGBUS later
            self._mm: mmap.mmap | None = mmap.mmap(fd, self.size, flags=_flags(prefault))
        except BaseException:
            os.unlink(self.path)
            raise
        finally:
            os.close(fd)
        head = MAGIC + struct.pack("<IQ", self.slots, slot_bytes) + bytes.fromhex(self.nonce)
        self._mm[: len(head)] = head
        self._next = 0
        self._gen = 0

    def offset(self, slot: int) -> int:
        """Where slot ``slot``'s frame starts."""
        return HEAD + slot * (SLOT_HEAD + self.slot_bytes) + SLOT_HEAD

    @property
    def gen(self) -> int:
        """The generation of the newest frame written (0: none yet)."""
        return self._gen

    @property
    def next_slot(self) -> int:
        """The slot the next :meth:`write` takes."""
        return self._next

    def slot_gen(self, slot: int) -> int:
        """The generation slot ``slot`` holds now (0: being written or never)."""
        if self._mm is None:
            return 0
        gen: int = struct.unpack_from("<Q", self._mm, self.offset(slot) - SLOT_HEAD)[0]
        return gen

    def write(self, *parts: bytes | bytearray | memoryview, slot: int | None = None) -> Ref:
        """Copy a frame (the concatenation of ``parts``) into slot ``slot`` (default: the next in
        turn); its reference."""
        length = sum(memoryview(p).nbytes for p in parts)
        if length > self.slot_bytes:
            raise ShmError(
                "too_large", f"a {length}-byte frame exceeds the {self.slot_bytes}-byte slot"
            )
        if slot is None:
            slot = self._next
        buf = self.begin(slot)
        pos = 0
        for p in parts:
            n = memoryview(p).nbytes
            buf[pos : pos + n] = np.frombuffer(p, np.uint8)
            pos += n
        del buf
        return self.commit(slot, length)

    def begin(self, slot: int) -> np.ndarray:
        """Take slot ``slot`` for a frame written in place: mark it as being written (a reader
        of its last frame now gets :class:`StaleRef`) and return its bytes, writable; the writer
        fills a prefix of them, then calls :meth:`commit`. The returned array (and every view of
        it) keeps the mapping alive: :meth:`close` still unlinks the segment."""
        mm = self._mm
        if mm is None:
            raise ShmError("closed", f"segment {self.name} is closed")
        if not 0 <= slot < self.slots:
            raise ShmError("bad_ref", f"slot {slot} is not one of the {self.slots}")
        at = self.offset(slot)
        struct.pack_into("<QQ", mm, at - SLOT_HEAD, 0, 0)  # being written
        self._next = (slot + 1) % self.slots
        return np.frombuffer(mm, np.uint8, self.slot_bytes, at)

    def commit(self, slot: int, length: int) -> Ref:
        """Stamp slot ``slot`` (taken with :meth:`begin`) as holding a ``length``-byte frame
        under a new generation; its reference."""
        mm = self._mm
        if mm is None:
            raise ShmError("closed", f"segment {self.name} is closed")
        if not 0 < length <= self.slot_bytes:
            raise ShmError("too_large", f"a {length}-byte frame does not fit a slot")
        at = self.offset(slot)
        self._gen += 1
        struct.pack_into("<QQ", mm, at - SLOT_HEAD, self._gen, length)
        return Ref(self.name, at, length, self._gen)

    def close(self) -> None:
        """Unlink, and unmap unless frames written in place are still referenced (their
        mapping then goes with the last of them); idempotent."""
        if self._mm is not None:
            with contextlib.suppress(BufferError):  # views from begin() still alive
                self._mm.close()
            self._mm = None
        unlink(self.name)


def sweep_dead() -> list[str]:
    """Unlink the rings of our user whose creating process is gone (killed before it could
    clean up); the names removed."""
    removed = []
    with contextlib.suppress(OSError):
        for name in os.listdir(SHM_DIR):
            if not NAME_RE.fullmatch(name) or len(name) < 16:
                continue
            try:
                pid = int(name[8:16], 16)
                if os.stat(os.path.join(SHM_DIR, name)).st_uid != os.getuid():
                    continue
                os.kill(pid, 0)
            except ProcessLookupError:
                unlink(name)
                removed.append(name)
            except (OSError, ValueError):
                continue
    return removed


def _flags(populate: bool) -> int:
    return mmap.MAP_SHARED | (getattr(mmap, "MAP_POPULATE", 0) if populate else 0)


def unlink(name: str) -> None:
    """Remove a segment by name, if it is still there."""
    with contextlib.suppress(FileNotFoundError, ShmError):
        os.unlink(_path(name))


class RingReader:
    """The reader's side: another process's ring, mapped read-only. Opening checks the header
    (a file that is not a hetd ring is refused) and gives the nonce the writer put there."""

    def __init__(self, name: str, populate: bool = False) -> None:
        """``populate``: map every page now (a ring its writer prefaulted)."""
        self.name = name
        path = _path(name)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError as exc:
            raise ShmError("no_segment", f"cannot open segment {name}: {exc.strerror}") from None
        try:
            st = os.fstat(fd)
            if st.st_uid != os.getuid() or st.st_size < HEAD:
                raise ShmError("bad_segment", f"segment {name} is not ours or too small")
            self._mm: mmap.mmap | None = mmap.mmap(
                fd, st.st_size, flags=_flags(populate), prot=mmap.PROT_READ
            )
        finally:
            os.close(fd)
        self.size = st.st_size
        mm = self._mm
        if mm[: len(MAGIC)] != MAGIC:
            self.close()
            raise ShmError("bad_segment", f"segment {name} is not a hetd ring")
        self.slots, self.slot_bytes = struct.unpack_from("<IQ", mm, len(MAGIC))
        self.nonce = bytes(mm[len(MAGIC) + 12 : len(MAGIC) + 28]).hex()
        if HEAD + self.slots * (SLOT_HEAD + self.slot_bytes) != self.size:
            self.close()
            raise ShmError("bad_segment", f"segment {name}: header does not match its size")

    def read(self, ref: Ref) -> bytes:
        """A copy of the frame ``ref`` names; :class:`ShmError` when it names none,
        :class:`StaleRef` when its slot was rewritten before or during the copy."""
        return self.read_with(ref, bytes)

    def read_with(self, ref: Ref, take: Callable[[memoryview], T]) -> T:
        """``take`` applied to the frame ``ref`` names, in place (``take`` must copy what it
        keeps: the view is released on return), checked like :meth:`read`: a frame rewritten
        while ``take`` read it raises :class:`StaleRef`, whatever ``take`` made of it."""
        mm = self._mm
        if mm is None:
            raise ShmError("closed", f"segment {self.name} is closed")
        check_ref(self, ref)
        at = ref.offset - SLOT_HEAD
        if struct.unpack_from("<QQ", mm, at) != (ref.gen, ref.length):
            raise StaleRef(f"segment {ref.segment}: slot rewritten before gen {ref.gen} was read")
        whole = memoryview(mm)
        view = whole[ref.offset : ref.offset + ref.length]
        try:
            result = take(view)
        except Exception:
            if struct.unpack_from("<Q", mm, at)[0] != ref.gen:  # torn, not malformed
                raise StaleRef(f"segment {ref.segment}: slot rewritten while read") from None
            raise
        finally:
            view.release()
            whole.release()
        if struct.unpack_from("<Q", mm, at)[0] != ref.gen:
            raise StaleRef(f"segment {ref.segment}: slot rewritten while gen {ref.gen} was read")
        return result

    def close(self) -> None:
        """Unmap (idempotent); the writer unlinks."""
        if self._mm is not None:
            self._mm.close()
            self._mm = None


def check_ref(ring: RingReader, ref: Ref) -> None:
    """``ref`` names the whole frame of one slot of ``ring``, or :class:`ShmError` says why not."""
    if ref.segment != ring.name:
        raise ShmError("bad_ref", f"segment {ref.segment!r} is not the agreed {ring.name!r}")
    stride = SLOT_HEAD + ring.slot_bytes
    slot, rest = divmod(ref.offset - HEAD - SLOT_HEAD, stride)
    if ref.offset < HEAD + SLOT_HEAD or rest or slot >= ring.slots:
        raise ShmError("bad_ref", f"offset {ref.offset} is not the start of a slot")
    if not 0 < ref.length <= ring.slot_bytes or ref.gen < 1:
        raise ShmError("bad_ref", f"length {ref.length} / gen {ref.gen} out of range")


def ref_of(body: Mapping[str, Any]) -> Ref:
    """The :class:`Ref` in a ``params_ref`` / ``push_ref`` body that wire.decode validated."""
    return Ref(str(body["segment"]), int(body["offset"]), int(body["length"]), int(body["gen"]))
