"""``hetd status`` as text shows what README says it shows: the running policy and its state."""

from __future__ import annotations

import numpy as np
import optax

from hetd.cli.admin_text import STATE_WIDTH, policy_state_text, status_text
from hetd.core.engine import Engine, EngineConfig
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
