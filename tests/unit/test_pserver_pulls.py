"""Releases pulled from the pservers: what a slice keeps for pulls (the version in force at each
position, the newest few, none across a restore), the head's ``params_at`` naming a snapshot's
slices, a worker's join of the slices back into the model, and a slice frame read strictly."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import numpy as np
import optax
import pytest

from hetd.core.entries import EngineConfig
from hetd.core.members import Members
from hetd.core.publish import Publisher
from hetd.core.rates import Meters
from hetd.core.store import Store
from hetd.protocol import frames, pslink, wire
from hetd.protocol.frames import ParamsAt
from hetd.protocol.messages import JoinIn
from hetd.protocol.params import param_hash
from hetd.pserver.log import DecisionLog
from hetd.pserver.partition import partition, split
from hetd.pserver.slice import SliceState
from hetd.server.pserver_pulls import Pointers
from policies.types import Plan
from tests.conftest import FakeClock, FakePeer
from workers.parts import PartsError, read_map
from workers.pulls import Puller, SliceMismatch, check_cover, join, slice_shapes

SHAPES = {"emb": (40, 3), "w": (3, 2), "b": (2,), "t": ()}
PARAMS = {
    k: np.linspace(-1, 1, int(np.prod(s)), dtype=np.float32).reshape(s) for k, s in SHAPES.items()
}
PMAP = partition(SHAPES, 2, block_bytes=200)  # emb (480 bytes) in blocks over both


def _update(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {k: rng.standard_normal(s).astype(np.float32) for k, s in SHAPES.items()}


def _pair(keep: int) -> tuple[SliceState, SliceState]:
    """Pserver 0's slice kept for pulls, and the same slice read as it goes (keeping nothing)."""
    part = split(PMAP, PARAMS)[0]
    made = [SliceState(PMAP, 0, part, optax.sgd(0.1), combine=True, keep=k) for k in (keep, 0)]
    return made[0], made[1]


def test_a_slice_keeps_the_version_in_force_at_each_position_the_newest_few() -> None:
    kept, plain = _pair(keep=2)
    log = DecisionLog()
    assert kept.release_at(0) is not None and kept.release_at(0)[0] == 0  # the start
    seen: dict[int, tuple[int, dict[str, np.ndarray]]] = {}  # position -> what was in force
    for pid in range(1, 5):
        records = [log.apply(0, pid, "grad", 1.0), log.drop(1, pid), log.step()]
        for sl in (kept, plain):
            sl.receive(0, pid, split(PMAP, _update(pid))[0])
            sl.offer(records)
            sl.advance()
        assert kept.release_at(log.position - 1) is not None  # (a drop: the older version)
        seen[log.position] = (plain.store.version, plain.params())
    assert [(p, v) for p, v, _ in kept.kept] == [(9, 3), (12, 4)]  # the newest two
    for position in (9, 10, 11, 12):  # each the version in force there, bit for bit
        version, tensors = kept.release_at(position)  # type: ignore[misc]
        want_version, want = seen[9 if position < 12 else 12]
        assert version == want_version
        assert all(tensors[k].tobytes() == want[k].tobytes() for k in want)
    assert kept.release_at(6) is None  # no longer kept: the worker asks the head again
    assert kept.release_at(13) is None  # not reached yet
    assert all(not t.flags.writeable for _, _, t in kept.kept for t in t.values())


def test_a_restore_forgets_every_release_kept_before_it() -> None:
    kept, _ = _pair(keep=4)
    log = DecisionLog()
    kept.receive(0, 1, split(PMAP, _update(1))[0])
    kept.offer([log.checkpoint("p1"), log.apply(0, 1, "grad", 1.0), log.step()])
    kept.advance()
    assert [v for _, v, _ in kept.kept] == [0, 1]
    kept.offer([log.restore("p1", 0, {})])  # back to version 0: a new history from here
    kept.advance()
    assert [(p, v) for p, v, _ in kept.kept] == [(4, 0)] and kept.release_at(3) is None


def test_the_heads_params_at_names_the_versions_slices_and_a_worker_joins_them_back() -> None:
    store = Store(PARAMS, optax.sgd(0.1))
    store.hashes = True
    log = DecisionLog()
    log.apply(0, 1, "grad", 1.0)
    pointers = Pointers(PMAP, log)
    frame = pointers(store)
    assert pointers(store) is frame and pointers.made == 1  # once per version
    named = frames.decode(frame)
    assert isinstance(named, ParamsAt)
    assert (named.version, named.position, named.hash) == (0, 1, None)  # no whole's hash
    snap = store.snapshot()
    slices = split(PMAP, snap.tensors)
    assert named.slices == tuple(param_hash(s) for s in slices)
    shapes, cuts, servers = read_map(PMAP.to_dict())
    assert slice_shapes(shapes, cuts, servers) == [PMAP.slice_shapes(s) for s in range(2)]
    joined = join([{k: np.array(v) for k, v in s.items()} for s in slices], shapes, cuts)
    assert sorted(joined) == sorted(PARAMS)
    assert all(joined[k].shape == PARAMS[k].shape for k in PARAMS)
    assert param_hash(joined) == snap.hash
    store.decisions = log  # (the store logs where its queued steps run)
    log.apply(0, 2, "grad", 1.0)
    store.apply("grad", _update(1), 1.0)  # a new version, read in place (no snapshot taken)
    named = frames.decode(pointers(store))
    assert isinstance(named, ParamsAt) and (named.version, pointers.made) == (1, 2)
    assert named.position == 3  # after the step the store logged before reading the version
    assert named.slices == tuple(param_hash(s) for s in split(PMAP, store.snapshot().tensors))


def _members() -> Members:
    clock = FakeClock()
    return Members(EngineConfig(), clock, clock.now())


def _admit(m: Members, name: str, codec: str, *features: str) -> tuple[int, FakePeer]:
    peer = FakePeer()
    hello = JoinIn(id=1, name=name, device={}, codecs=(codec,), features=frozenset(features))
    entry = m.admit(hello, peer, codec, Plan(batch_size=32))
    m.shard_for(entry)
    return entry.facts.worker, peer


class _Sink:
    """A frame sink that counts the snapshots' frames packed into it."""

    def __init__(self) -> None:
        self.committed: list[int] = []

    def reserve(self, nbytes: int) -> np.ndarray | None:
        return np.zeros(nbytes, np.uint8)

    def commit(self, buf: np.ndarray, frame: memoryview, version: int) -> None:
        self.committed.append(version)


def test_a_publish_to_workers_that_all_pull_copies_no_snapshot_and_builds_no_full_frame() -> None:
    m = _members()
    store = Store(PARAMS, optax.sgd(0.1))
    log = DecisionLog()
    pub = Publisher(m, store, EngineConfig(), Meters())
    pub.pointer = pointers = Pointers(PMAP, log)
    sink = _Sink()  # every snapshot the head takes packs its full frame here
    pub.sink_to(sink)
    pub.defer()
    a, pa = _admit(m, "a", "none", "pulls")
    b, pb = _admit(m, "b", "none", "pulls")
    for version in (1, 2):
        store.apply("grad", _update(version), 1.0)
        log.apply(0, version, "grad", 1.0)
        pub.release(m.active[a])
        pub.release(m.active[b])
        pub.publish()
        for peer in (pa, pb):
            named = frames.decode(peer.frames[-1])
            assert isinstance(named, ParamsAt) and named.version == version
        assert pa.frames[-1] is pb.frames[-1]  # one frame per version
    assert sink.committed == [] and pointers.made == 2  # no copy of the model, no full frame
    assert m.facts[a].version == 2 and m.stats[a].releases == 2

    c, pc = _admit(m, "c", "none")  # one that does not pull: the head packs its frame
    pub.release(m.active[a])
    pub.release(m.active[c])
    pub.publish()
    assert sink.committed == [2] and wire.decode(pc.frames[-1])["full"]
    assert isinstance(frames.decode(pa.frames[-1]), ParamsAt)


def test_a_pulling_worker_on_a_delta_link_pulls_its_full_release_then_takes_deltas() -> None:
    m = _members()
    store = Store(PARAMS, optax.sgd(0.1))
    log = DecisionLog()
    pub = Publisher(m, store, EngineConfig(), Meters())
    pub.pointer = Pointers(PMAP, log)
    a, pa = _admit(m, "a", "int8", "pulls")
    pub.release(m.active[a])  # nothing held: a full release, named by position
    named = frames.decode(pa.frames[-1])
    assert isinstance(named, ParamsAt) and named.version == 0
    assert pub.downlink.refs == 1  # what it pulls is the reference its deltas build on
    store.apply("grad", _update(1), 1.0)
    log.apply(0, 1, "grad", 1.0)
    pub.release(m.active[a])
    delta = wire.decode(pa.frames[-1])
    assert delta.type == "params" and not delta["full"] and delta["base"] == 0
    assert delta["version"] == 1


def test_a_slice_frame_is_read_back_only_as_the_pservers_parts() -> None:
    part = split(PMAP, PARAMS)[1]
    shapes = PMAP.slice_shapes(1)
    body = b"".join(bytes(s) for s in pslink.slice_frame(7, 3, part))[4:]
    msg = pslink.unpack(body)
    got = pslink.read_slice(msg, shapes)
    assert all(got[k].tobytes() == np.asarray(part[k]).tobytes() for k in shapes)
    key = next(iter(shapes))
    bad = [
        {**msg, "tensors": {k: v for k, v in msg["tensors"].items() if k != key}},  # one missing
        {**msg, "tensors": {**msg["tensors"], key: ["int8", *msg["tensors"][key][1:]]}},
        {**msg, "tensors": {**msg["tensors"], key: ["float32", [999], msg["tensors"][key][2]]}},
        {**msg, "tensors": {**msg["tensors"], key: [*msg["tensors"][key][:2], b"\0" * 3]}},
    ]
    for wrong in bad:
        with pytest.raises(pslink.FrameError):
            pslink.read_slice(wrong, shapes)
    with pytest.raises(ValueError, match="float32"):
        pslink.slice_frame(7, 3, {"x": np.zeros(3, np.float64)})


def test_a_map_that_does_not_cover_every_tensor_exactly_once_is_refused() -> None:
    shapes, cuts, _ = read_map(PMAP.to_dict())
    check_cover(shapes, cuts)  # the planner's map covers the model
    blocks = [c for c in cuts if not c[4]]
    whole = next(c for c in cuts if c[4])
    wrong = [
        [c for c in cuts if c is not blocks[-1]],  # a block missing: rows left out
        [*cuts, blocks[0]],  # a block twice
        [c for c in cuts if c is not whole],  # a tensor missing
        [*cuts, whole],  # a tensor twice
        [c if c is not blocks[0] else (*c[:3], c[3] - 1, *c[4:]) for c in cuts],  # a gap
    ]
    for cut in wrong:
        with pytest.raises(PartsError, match="exactly once"):
            check_cover(shapes, cut)
    with pytest.raises(PartsError, match="exactly once"):  # (a worker refuses the welcome)
        addrs = [["127.0.0.1", 1], ["127.0.0.1", 2]]
        Puller({"map": {**PMAP.to_dict(), "parts": PMAP.to_dict()["parts"][1:]}, "addrs": addrs})


async def _serve_slices(
    parts: list[dict[str, np.ndarray]], done: list[asyncio.Event]
) -> list[asyncio.Server]:
    """One loopback server per pserver answering each ``pull`` with its part (as a pserver
    answers: the slice at the position and version asked); each connection, once the worker
    closed it, sets an event of ``done``."""

    def answer(part: dict[str, np.ndarray]) -> Callable[..., Awaitable[None]]:
        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            closed = asyncio.Event()
            done.append(closed)
            while True:
                try:
                    n = int.from_bytes(await reader.readexactly(4), "big")
                    ask = pslink.unpack(await reader.readexactly(n))
                except (asyncio.IncompleteReadError, ConnectionError):
                    break
                for seg in pslink.slice_frame(ask["position"], ask["version"], part):
                    writer.write(seg)
                await writer.drain()
            writer.close()
            closed.set()

        return serve

    return [await asyncio.start_server(answer(p), "127.0.0.1", 0) for p in parts]


async def test_a_worker_pulls_the_version_named_and_refuses_a_slice_that_is_not_it() -> None:
    store = Store(PARAMS, optax.sgd(0.1))
    log = DecisionLog()
    named = frames.decode(Pointers(PMAP, log)(store))
    assert isinstance(named, ParamsAt)
    good = [{k: np.array(v) for k, v in s.items()} for s in split(PMAP, PARAMS)]
    bad = [dict(s) for s in good]
    key = next(k for k in bad[1] if bad[1][k].size > 1)
    flipped = bad[1][key].copy()
    flipped.flat[0] = np.nextafter(flipped.flat[0], np.float32(2))  # one value, one ulp off
    bad[1][key] = flipped
    for parts, ok in ((good, True), (bad, False)):
        done: list[asyncio.Event] = []
        servers = await _serve_slices(parts, done)
        addrs = [["127.0.0.1", s.sockets[0].getsockname()[1]] for s in servers]
        puller = Puller({"map": PMAP.to_dict(), "addrs": addrs})
        try:
            if ok:
                got = await puller.fetch(named)
                assert got is not None and got[0].version == 0
                assert all(got[0].tensors[k].tobytes() == PARAMS[k].tobytes() for k in PARAMS)
            else:
                with pytest.raises(SliceMismatch, match="pserver 1's slice"):
                    await puller.fetch(named)
        finally:
            puller.close()
            for s in servers:
                s.close()
            async with asyncio.timeout(10):
                for closed in done:
                    await closed.wait()
