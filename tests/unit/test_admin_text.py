"""``hetd status`` as text shows what README says it shows: the running policy and its state."""

from __future__ import annotations

import numpy as np
import optax

from hetd.cli.admin_text import STATE_WIDTH, policy_state_text, status_text
from hetd.core import Engine, EngineConfig
from hetd.core.store import Store
from policies import make_policy
from tests.conftest import FakeClock


def status(policy: str) -> dict[str, object]:
    params = {"dense/w": np.ones((3, 2), np.float32)}
    engine = Engine(Store(params, optax.sgd(0.1)), make_policy(policy), EngineConfig(), FakeClock())
    body = engine.status()
    body.update({"buffered": 0, "checkpoint": {"dir": None}})  # what the daemon adds
    return body


def test_status_shows_the_policy_state() -> None:
    rows = dict(
        line.split("  ", 1) for line in status_text(status("ashl")).splitlines() if "  " in line
    )
    assert rows["policy"].strip().startswith("ashl ")
    state = rows["policy state"].strip()
    assert state.startswith('stage "profile", transitions [')  # ashl's own stage, in its state
    assert '"policy"' not in state  # the name is on the line above
    lines = status_text(status("asp")).splitlines()
    assert "policy state     - (this policy keeps none)" in lines, lines


def test_a_long_state_is_cut_and_long_fields_are_sized() -> None:
    state = {"workers": [{"id": i, "share": 0.25} for i in range(40)], "note": "x" * 500}
    text = policy_state_text(state)
    assert text.startswith("workers [40 items], note ")
    long = {f"k{i}": i for i in range(100)}
    cut = policy_state_text(long)
    assert cut.endswith("… (--json: all of it)") and len(cut) < STATE_WIDTH + 30


def test_status_shows_the_last_forecast_and_what_auto_made_of_it() -> None:
    from hetd.core.planner import describe_forecast, parse_candidates, plan
    from tests.unit.test_planner import CONFIG, SPREAD, view_of

    out = plan(view_of(SPREAD), parse_candidates("bsp,asp,lbbsp,dpmp"), CONFIG, lambda: 0.0)
    last = {**describe_forecast(out.forecast), "age_s": 3.2, "refused": [{"candidate": "dpmp"}]}
    body = status("auto")
    body["planning"] = {"every_s": 30.0, "rounds": 1, "skipped": 2, "failed": 0, "last": None}
    rows = dict(line.split("  ", 1) for line in status_text(body).splitlines() if "  " in line)
    assert rows["forecast"].strip() == "none yet (every 30 s)"  # auto, before its first
    body["planning"]["last"] = last
    body["policy_state"]["last_choice"] = {
        "running": "lbbsp",
        "chosen": None,
        "why": "the running policy is the best",
    }
    rows = dict(line.split("  ", 1) for line in status_text(body).splitlines() if "  " in line)
    best = last["predictions"][0]
    assert (
        rows["forecast"]
        .strip()
        .startswith(
            f"3 s ago, 3 candidate(s) in 0.00 s CPU, goodput {best['candidate']} "
            f"{best['goodput']:.0f}/s, "
        )
    )
    assert rows["forecast"].endswith("; 1 left out; 2 round(s) skipped for CPU")
    assert rows["choice"].strip() == "stays on lbbsp: the running policy is the best"
    body["policy_state"]["last_choice"]["chosen"] = "asp"
    text = status_text(body)
    assert "lbbsp -> asp: the running policy is the best" in text
    body["planning"] = None
    body["policy_state"]["last_choice"] = None
    assert "forecast         off ([policy] plan_every_s = 0)" in status_text(body).splitlines()
    # a policy that reads no forecasts: no rows, whatever the daemon plans
    plain = status("asp")
    plain["planning"] = {"every_s": 30.0, "rounds": 0, "skipped": 0, "failed": 0, "last": None}
    assert "forecast" not in status_text(plain)


def test_status_shows_the_decision_log_and_each_pserver() -> None:
    body = status("asp")
    assert "decision log" not in status_text(body)  # none kept: no row
    body["decisions"] = {
        "position": 120,
        "version": 40,
        "first": 100,
        "link_port": 7072,
        "saved": [100, 80],
        "connected": [0],
        "processes": [
            {"slice": 0, "pid": 4242, "state": "running", "restarts": 0, "last_exit": None},
            {"slice": 1, "pid": None, "state": "waiting", "restarts": 2, "last_exit": -9},
        ],
    }
    rows = dict(line.split("  ", 1) for line in status_text(body).splitlines() if "  " in line)
    rows = {k.strip(): v.strip() for k, v in rows.items()}
    assert rows["decision log"] == "position 120, version 40, from 100"
    assert rows["pservers"] == "0: saved 100; 1: saved 80 (not connected)"
    assert rows["pserver 0"] == "running, pid 4242, 0 restarts"
    assert rows["pserver 1"] == "waiting, no process, 2 restarts, last exit -9"
