"""The shared-memory ring (hetd.protocol.shm): what a reader takes is exactly what was written,
or a clear error; never a frame rewritten while it was read; nothing left behind."""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import replace

import pytest

from hetd.protocol import shm


@pytest.fixture
def ring() -> Iterator[shm.Ring]:
    r = shm.Ring("dl", 2, 1024)
    yield r
    r.close()


def test_a_reader_gets_each_frame_as_written_and_the_writer_unlinks(ring: shm.Ring) -> None:
    reader = shm.RingReader(ring.name)
    assert reader.nonce == ring.nonce and len(ring.nonce) == 32
    a = ring.write(b"head-", b"x" * 100)
    b = ring.write(bytearray(b"y" * 1024))  # a whole slot
    assert reader.read(a) == b"head-" + b"x" * 100 and reader.read(b) == b"y" * 1024
    assert (a.offset, b.offset) == (ring.offset(0), ring.offset(1)) and b.gen == a.gen + 1
    with pytest.raises(shm.ShmError, match="exceeds"):
        ring.write(b"z" * 1025)
    reader.close()
    ring.close()
    assert not os.path.exists(ring.path)


def test_a_rewritten_slot_is_stale_before_or_while_it_is_read(ring: shm.Ring) -> None:
    reader = shm.RingReader(ring.name)
    old = ring.write(b"old" * 10)
    ring.write(b"other")
    ring.write(b"new" * 10)  # slot 0 again
    with pytest.raises(shm.StaleRef):
        reader.read(old)
    current = ring.write(b"abc" * 10, slot=0)

    def rewritten_meanwhile(view: memoryview) -> bytes:
        ring.write(b"torn" * 5, slot=0)  # the writer takes the slot during the read
        return bytes(view)

    with pytest.raises(shm.StaleRef):
        reader.read_with(current, rewritten_meanwhile)
    reader.close()


def test_references_outside_the_ring_are_refused(ring: shm.Ring) -> None:
    reader = shm.RingReader(ring.name)
    ref = ring.write(b"frame" * 10)
    other = shm.Ring("up", 1, 64)
    try:
        for bad, what in [
            (replace(ref, segment=other.name), "not the agreed"),
            (replace(ref, offset=ref.offset + 1), "start of a slot"),
            (replace(ref, offset=ring.offset(2)), "start of a slot"),  # past the last slot
            (replace(ref, offset=0), "start of a slot"),
            (replace(ref, length=2048), "out of range"),
            (replace(ref, length=0), "out of range"),
            (replace(ref, gen=0), "out of range"),
        ]:
            with pytest.raises(shm.ShmError, match=what):
                reader.read(bad)
        assert reader.read(ref) == b"frame" * 10  # nothing of that changed the ring
    finally:
        other.close()
        reader.close()


def test_only_hetd_rings_are_opened() -> None:
    for name in ["../etc/passwd", "hetd-dl-../../x", "other-file", "hetd-dl-XYZ"]:
        with pytest.raises(shm.ShmError, match="not a hetd segment name"):
            shm.RingReader(name)
    with pytest.raises(shm.ShmError, match="cannot open"):
        shm.RingReader("hetd-dl-0123456789abcdef")  # gone (a daemon that restarted)
    path = os.path.join(shm.SHM_DIR, "hetd-up-00000000deadbeef")
    with open(path, "wb") as fh:
        fh.write(b"not a ring" * 10)
    try:
        with pytest.raises(shm.ShmError, match="not a hetd ring"):
            shm.RingReader("hetd-up-00000000deadbeef")
    finally:
        os.unlink(path)


def test_rings_of_processes_gone_are_swept() -> None:
    dead = os.path.join(shm.SHM_DIR, "hetd-up-7ffffff0" + "ab" * 6)  # no such pid (above max)
    with open(dead, "wb"):
        pass
    alive = shm.Ring("up", 1, 64)  # ours: this process lives
    try:
        assert os.path.basename(dead) in shm.sweep_dead()
        assert not os.path.exists(dead) and os.path.exists(alive.path)
    finally:
        alive.close()
        shm.unlink(os.path.basename(dead))
