"""A worker's push packed as segments (``wire.pack_parts``) goes into its shared-memory ring as
the very frame ``wire.encode`` would have made, and the daemon's reader decodes it as such."""

from __future__ import annotations

import numpy as np

from hetd.codecs import registry as codecs
from hetd.protocol import shm, wire
from workers.push import frame_size, joined, restamped
from workers.shm import ShmLink


def test_a_push_packed_as_parts_lands_in_the_ring_byte_for_byte() -> None:
    grads = {"a/w": np.arange(40_000, dtype=np.float32), "b": np.ones(3, np.float32)}
    fields = dict(
        base=4,
        kind="grad",
        tensors=codecs.encode_tree(grads, codecs.none_codec()),
        samples=32,
        steps=1,
        compute_s=0.01,
        sent_at=1.5,
    )
    parts = wire.pack_parts("push", 9, **fields)
    frame = wire.encode("push", 9, **fields)
    assert len(parts.segments) > 1  # the big tensor is its own segment, not copied
    assert frame_size(parts) == len(frame) and joined(parts) == frame
    up = shm.Ring("up", 2, 1 << 20)
    down = shm.Ring("dl", 1, 1 << 20)
    reader = shm.RingReader(up.name)
    try:
        link = ShmLink(shm.RingReader(down.name), up)
        ref_frame = link.push_ref(parts, 9, {})
        assert ref_frame is not None
        ref = shm.ref_of(wire.decode(ref_frame).body)
        assert reader.read(ref) == frame
        push = reader.read_with(ref, wire.decode)
        got = codecs.decode_tree(push["tensors"])
        assert all(np.array_equal(got[k], grads[k]) for k in grads)
        # a push kept for a resend goes again whole, without its first send's stamp
        again = wire.decode(restamped(parts))
        assert again.id == 9 and "sent_at" not in again.body
        link.close()
    finally:
        reader.close()
        down.close()
        up.close()
