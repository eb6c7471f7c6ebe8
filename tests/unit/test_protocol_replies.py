"""Control replies typed both ways: what the engine sends (:mod:`hetd.protocol.messages`) reads
back on the worker as the same value (:func:`~hetd.protocol.messages.read_reply`)."""

from __future__ import annotations

from hetd.protocol import wire
from policies.types import Plan


def test_every_control_reply_reads_back_as_what_was_sent() -> None:
    from hetd.protocol.messages import (
        Ack,
        Bye,
        ErrorReply,
        PlanUpdate,
        ProfileRequest,
        ShardUpdate,
        Welcome,
        read_reply,
    )

    setup = {"model": {"spec": "mlp", "kwargs": {}}, "dataset": {"spec": "digits"}, "train": {}}
    sent = [
        Ack(7, 12, "dropped", "too stale"),
        Ack(8, 13, "applied"),
        ErrorReply(9, "out_of_range", "update norm 1e9 ..."),
        PlanUpdate(Plan(batch_size=16, stage="shl")),
        ShardUpdate(1, 3),
        ProfileRequest(3, 32),
        Bye("daemon stopping"),
        Welcome(1, 4, Plan(batch_size=8), 2.0, 1, 4, setup, "s3cret"),
        Welcome(1, 5, Plan(batch_size=8), 2.0, 0, 1, setup),
    ]
    for reply in sent:
        assert read_reply(wire.decode(reply.encode())) == reply
    assert read_reply(wire.decode(wire.encode("pull", 0, have=None))) is None
