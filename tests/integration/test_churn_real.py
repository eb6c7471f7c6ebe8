"""Churn in real mode: ``hetd bench --mode real`` carries out a scenario's ``[[events]]`` with real
``hetd-worker`` processes (a crash is SIGKILL, a clean leave SIGTERM, a join a process started
beforehand that connects at its time), and
the daemon loses no update: every push is answered exactly once, and every answer that applied
something moved the version by one."""

from __future__ import annotations

from pathlib import Path

import pytest

from hetd.bench.real import run_real
from hetd.core.engine import Engine
from hetd.protocol.messages import Ack, Reply
from hetd.sim.results import PolicySpec
from hetd.sim.scenario import load_scenario
from workers.client import STOPPED

pytestmark = pytest.mark.slow

CHURN = """
name = "tiny-churn"
dataset = "digits"
model = "mlp"
model_kwargs = { hidden = [32] }
global_batch = 64
base_batch = 32
base_step_s = 0.02
target_accuracy = 0.8
budget_s = 25.0
eval_interval_s = 0.5
lr = 0.2
# a crash closes its socket on loopback: heard at once. The timeout is for a loaded host, where
# a heartbeat may come seconds late (2 s cut off live workers here)
heartbeat_timeout_s = 8.0

[[workers]]
slowdown = 1.0
name = "steady"

[[workers]]
slowdown = 1.0
name = "doomed"

[[workers]]
slowdown = 2.0
name = "quitter"

[[events]]
at_s = 1.0
leave = "doomed"
how = "crash"

[[events]]
at_s = 1.5
join = { slowdown = 1.0, name = "late" }

[[events]]
at_s = 3.0
leave = "quitter"
how = "clean"
"""


def test_a_crash_a_join_and_a_clean_leave_lose_no_update(tmp_path: Path) -> None:
    path = tmp_path / "churn.toml"
    path.write_text(CHURN)
    sc = load_scenario(str(path))
    seen: list[Engine] = []
    acks: list[tuple[int, int, str]] = []  # (worker, push id, status), every answer in order

    def observe(engine: Engine) -> None:
        seen.append(engine)
        send = engine.members.send

        def spy(wid: int, reply: Reply) -> None:
            if isinstance(reply, Ack):
                acks.append((wid, reply.id, reply.status))
            send(wid, reply)

        engine.members.send = spy  # type: ignore[method-assign]

    result = run_real(sc, PolicySpec("bsp"), 0, sc.lr, lambda t: None, observe=observe)
    (engine,) = seen
    names = {
        wid: f.name for wid, f in [*engine.members.facts.items(), *engine.members.departed.items()]
    }
    gone: dict[str, list[str]] = {}  # name -> why it left, in order (the daemon's stop last)
    for _, wid, reason in engine.members.departures:
        gone.setdefault(names.get(wid, "?"), []).append(reason)
    # the crashed worker said nothing; the stopped one said bye at its event; the others stayed
    # to the end (each left once, after those two), where the bench stops them (SIGTERM) before
    # the daemon: they say bye too
    assert gone["w1"] == ["connection closed"], gone
    assert gone["w2"] == gone["w0"] == gone["w3"] == [STOPPED], gone
    order = [names.get(wid) for _, wid, _ in engine.members.departures]
    assert order[:2] == ["w1", "w2"] and sorted(order[2:]) == ["w0", "w3"], order
    # the joiner joined and trained under BSP with the steady worker, after the crash
    late = next(wid for wid, name in names.items() if name == "w3")
    assert engine.members.departed[late].samples > 0
    # every push answered once: per worker, the answered ids run without a gap or a repeat
    for wid in {w for w, _, _ in acks}:
        ids = [i for w, i, status in acks if w == wid and status != "duplicate"]
        assert ids == list(range(ids[0], ids[0] + len(ids))), (names.get(wid), ids)
    # nothing applied twice or lost between the answers and the store: the t = 0 restart
    # moves the version once without an update
    assert engine.applier.updates_applied == engine.store.version - 1
    assert result.final_accuracy > result.curve[0][1]
    assert set(result.idle_fraction) >= {"0", "3"}
