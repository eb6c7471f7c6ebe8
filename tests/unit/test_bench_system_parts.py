"""The system bench's senders send each pserver what a real worker would: its part of the push."""

from __future__ import annotations

import numpy as np

from hetd.bench.system_parts import PartFrames
from hetd.bench.system_peers import PushFrame, ready_update
from hetd.protocol import pslink
from hetd.pserver.partition import partition
from workers.parts import PartsSender


def test_a_senders_part_frames_are_a_workers_for_the_same_push_whatever_its_id() -> None:
    shapes = (("body/kernel", (64, 16)), ("body/bias", (16,)), ("head/kernel", (16, 4)))
    pmap = partition(dict(shapes), 2, block_bytes=1024)  # the kernel in row blocks over both
    assert any(not p.whole for p in pmap.parts)
    info = {"map": pmap.to_dict(), "addrs": [["127.0.0.1", 1], ["127.0.0.1", 2]]}
    push = PushFrame(ready_update(shapes, "int8", seed=3))
    ours = PartFrames(info, 11, bytes(push.frame(0, 0)))
    worker = PartsSender(info)
    for pid in (1, 7, 2**40):
        pushed, wants = worker.frames(11, bytes(push.frame(pid, base=5)))
        assert pushed.id == pid
        for server, want in enumerate(wants):
            got = ours.frame(server, pid)
            assert int.from_bytes(got[:4], "big") == len(got) - 4  # the length prefix
            assert pslink.unpack(bytes(got[4:])) == pslink.unpack(b"".join(want)[4:])
    # the int8 values travel as int8 with their scale, as the daemon reads them
    tensors = pslink.unpack(bytes(ours.frame(0, 1)[4:]))["tensors"]
    assert {entry[0] for entry in tensors.values()} == {"int8"}
    assert all(np.isfinite(entry[3]) for entry in tensors.values())
