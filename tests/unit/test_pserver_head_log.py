"""The daemon keeps the decision log when ``[pservers] log`` says so, and its checkpoints keep the
log's place: a restart goes on from that position, its restore entry names the checkpoint entry,
and a slice that followed the log before the restart and after it ends with the restarted store.

The engine is the daemon's own (:func:`hetd.server.build.build_head` on the bundled MLP and the
digits set), driven by pushes of real gradients; the checkpoint goes through the file format and
back. Off by default: no log, today's checkpoint, nothing else changes.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from hetd import config as config_mod
from hetd.core.engine import Engine
from hetd.core.ingest import decode_hello
from hetd.core.store import make_optimizer
from hetd.protocol import wire
from hetd.protocol.messages import Ack, PushIn
from hetd.pserver.log import CheckpointEntry, DecisionLog, RestoreEntry
from hetd.pserver.partition import join, partition, split
from hetd.pserver.slice import SliceState
from hetd.server import checkpoint
from hetd.server.build import build_engine, build_head
from hetd.server.daemon import Daemon
from tests.conftest import FakeClock, FakePeer, make_config


def _config(tmp_path: Path, **pservers: Any) -> config_mod.Config:
    cfg = make_config("asp", optimizer="adam", lr=0.01)
    cfg = config_mod.replace(cfg, "server", admin_port=-1)
    cfg = config_mod.replace(cfg, "store", dir=str(tmp_path / "state"), interval_s=0.0)
    return config_mod.replace(cfg, "pservers", **pservers) if pservers else cfg


def _hello(name: str) -> Any:
    fields = {"name": name, "device": {"platform": "cpu"}, "codecs": ["none"]}
    return decode_hello(wire.decode(wire.encode("hello", 7, **fields)))


def _push(engine: Engine, wid: int, pid: int, peer: FakePeer, seed: int) -> dict[str, np.ndarray]:
    """A gradient-shaped update (seeded) pushed by ``wid`` on the current version; acked."""
    rng = np.random.default_rng(seed)
    grad = {
        k: rng.standard_normal(s).astype(np.float32) * np.float32(0.1)
        for k, s in engine.store.shapes.items()
    }
    engine.push(PushIn(wid, pid, engine.store.version, "grad", grad, 32, 1, 1.0, None, None, 1))
    assert isinstance(peer.replies[-1], Ack)
    return grad


def test_the_settings_are_checked() -> None:
    cfg = config_mod.Config()
    assert (cfg.pservers.log, cfg.pservers.servers) == (False, 0)
    with pytest.raises(config_mod.ConfigError, match=r"servers = 2 needs log = true"):
        config_mod.replace(cfg, "pservers", servers=2)
    with pytest.raises(config_mod.ConfigError, match=r"loopback only"):
        config_mod.replace(cfg, "pservers", log=True, servers=1, host="0.0.0.0")
    with pytest.raises(config_mod.ConfigError, match=r"\[pservers\] servers = 65"):
        config_mod.replace(cfg, "pservers", log=True, servers=65)
    with pytest.raises(config_mod.ConfigError, match=r"\[pservers\] log must be bool"):
        config_mod.from_mapping({"pservers": {"log": "yes"}})
    with pytest.raises(config_mod.ConfigError, match=r"\[pservers\] unknown keys \['count'\]"):
        config_mod.from_mapping({"pservers": {"count": 2}})
    logged = config_mod.replace(make_config("asp"), "pservers", log=True)
    with pytest.raises(config_mod.ConfigError, match=r"needs \[store\] dir"):
        config_mod.check_serving(logged)  # a daemon would refuse it; an admin client reads it


def test_off_by_default_the_engine_keeps_no_log_and_the_checkpoint_no_place(
    tmp_path: Path,
) -> None:
    engine = build_engine(_config(tmp_path))
    assert engine.store.decisions is None
    assert "decisions" not in checkpoint.engine_state(engine)


def _train(
    engine: Engine, peers: dict[int, FakePeer], pids: dict[int, int], n: int, seed: int
) -> dict[tuple[int, int], dict[str, np.ndarray]]:
    """``n`` pushes, the workers in turn; each push's update by (worker, id)."""
    out = {}
    for i in range(n):
        wid = sorted(peers)[i % len(peers)]
        pids[wid] += 1
        out[(wid, pids[wid])] = _push(engine, wid, pids[wid], peers[wid], seed + i)
    return out


def test_a_restart_goes_on_from_the_logs_place_and_a_slice_follows_it(tmp_path: Path) -> None:
    cfg = _config(tmp_path, log=True)
    engine, head = build_head(cfg, FakeClock())
    log = engine.store.decisions
    assert isinstance(log, DecisionLog) and head.optimizer is not None
    peers = {engine.join(_hello(f"w{i}"), p): p for i, p in enumerate([FakePeer(), FakePeer()])}
    pids = dict.fromkeys(peers, 0)
    pushes = _train(engine, peers, pids, 6, seed=1)
    state = checkpoint.engine_state(engine)
    place = json.loads(state["decisions"])
    ref = engine.applier.checkpoint_ref
    assert ref is not None and place["ref"] == ref and place["position"] == log.position
    assert place["version"] == state["version"] == 6
    assert dict(place["last_pid"]) == pids  # each worker's last logged push
    written = checkpoint.write(Path(cfg.store.dir), state, keep=2)
    before = log.since(0)  # what a pserver read before the head stopped
    pushes |= _train(engine, peers, pids, 3, seed=50)  # lost with the head: never checkpointed

    again, _ = build_head(cfg, FakeClock())
    found = checkpoint.load_newest(Path(cfg.store.dir))
    assert found is not None and found[0].path == written.path
    checkpoint.restore_engine(again, found[1])
    relog = again.store.decisions
    assert isinstance(relog, DecisionLog)
    after = relog.since(relog.first - 1)
    assert relog.first == place["position"] + 1  # the log goes on from the checkpoint's place
    restore = after[-1]
    assert isinstance(restore.entry, RestoreEntry) and restore.entry.ref == ref
    assert restore.version == 6 == again.store.version
    # the workers come back (resuming as the checkpoint knew them) and go on pushing
    peers2 = {}
    for wid in sorted(peers):
        peer = FakePeer()
        assert again.join(_resume(found[1], wid), peer) == wid
        peers2[wid] = peer
    known = {wid: int(found[1]["workers"][str(wid)]["last_push"]) for wid in peers2}
    assert known == dict(place["last_pid"]) != pids  # the head forgot the lost pushes
    pushes2 = _train(again, peers2, pids, 5, seed=100)  # a worker's ids go on growing

    # one slice (a whole-model pserver) follows the first log up to the checkpoint, then the
    # restarted one: it loads what it saved at the checkpoint entry and ends with the new store
    pmap = partition(dict(engine.store.shapes), 1, block_bytes=0)
    sl = SliceState(pmap, 0, split(pmap, head.params)[0], make_optimizer(head.optimizer))
    for (wid, pid), g in pushes.items():
        sl.receive(wid, pid, split(pmap, g)[0])
    upto = [r for r in before if r.position <= place["position"]]
    assert isinstance(upto[-1].entry, CheckpointEntry)
    sl.offer(upto)
    assert sl.advance() == place["position"]
    assert sl.held() == 3  # the lost pushes' parts, never logged again
    for (wid, pid), g in pushes2.items():
        sl.receive(wid, pid, split(pmap, g)[0])
    sl.offer(relog.since(relog.first - 1))
    assert sl.advance() == relog.position
    assert sl.held() == 0  # ... freed once the log passed their ids by
    got = join(pmap, [sl.params()])
    end = dict(again.store.snapshot().tensors)
    assert all(got[k].tobytes() == end[k].tobytes() for k in end)


def _resume(state: dict[str, Any], wid: int) -> Any:
    w = state["workers"][str(wid)]
    fields = {
        "name": w["name"],
        "device": {"platform": "cpu"},
        "codecs": ["none"],
        "resume": {"worker_id": wid, "secret": w["secret"]},
    }
    return decode_hello(wire.decode(wire.encode("hello", 7, **fields)))


async def test_the_daemon_keeps_the_log_and_resumes_it_from_its_checkpoint(
    tmp_path: Path,
) -> None:
    cfg = _config(tmp_path, log=True)
    daemon = Daemon(cfg)
    await daemon.start()
    try:
        first = await daemon.checkpoint()
        described = daemon.describe()["decisions"]
        # a checkpoint entry, and (no pserver reads the log) the records it covers forgotten
        assert described["position"] >= 1 and described["first"] == described["position"] + 1
    finally:
        await daemon.stop()  # the last checkpoint: one more entry
    again = Daemon(cfg)
    await again.start()
    try:
        assert again.resumed_from is not None and again.resumed_from.seq == first.seq + 1
        log = again.engine.store.decisions
        assert isinstance(log, DecisionLog)
        kept = log.since(log.first - 1)
        assert isinstance(kept[-1].entry, RestoreEntry)
        assert kept[-1].position > described["position"] + 1  # past both checkpoint entries
        assert again.describe()["decisions"]["position"] == log.position
    finally:
        await again.stop(final_checkpoint=False)


def test_a_malformed_log_place_is_a_checkpoint_error(tmp_path: Path) -> None:
    cfg = _config(tmp_path, log=True)
    engine = build_engine(cfg)
    state = checkpoint.engine_state(engine)
    bad = dict(state, decisions=json.dumps({"position": "x"}))
    with pytest.raises(checkpoint.CheckpointError, match="malformed decision log"):
        checkpoint.restore_engine(build_engine(cfg), bad)
    # a checkpoint written without a log resumes a daemon that keeps one at position 0
    fresh = build_engine(cfg)
    checkpoint.restore_engine(fresh, {k: v for k, v in state.items() if k != "decisions"})
    log = fresh.store.decisions
    assert isinstance(log, DecisionLog) and log.first == 1
    last = log.since(0)[-1]
    assert isinstance(last.entry, RestoreEntry) and last.version == state["version"]
