"""A live policy swap changes the outer optimizer: asp -> diloco on a real daemon with real
workers gets DiLoCo's Nesterov (as ``outer_optimizer = "auto"`` resolves it at start), trains on,
checkpoints it, and a daemon configured for asp restores it from that checkpoint; back to asp
gets plain averaging again."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import aiohttp
import jax
import numpy as np
import pytest

from hetd.server import checkpoint
from hetd.server.daemon import build_engine
from tests.conftest import ADMIN_TOKEN, make_config

pytestmark = pytest.mark.slow

AUTH = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
NESTEROV = "nesterov:lr=0.7,momentum=0.9"  # policies.diloco.SYNC_OUTER over an SGD inner step
PLAIN = "sgd:lr=1"


async def _call(http: aiohttp.ClientSession, url: str, method: str, body: Any = None) -> Any:
    async with http.request(method, url, json=body, headers=AUTH) as resp:
        assert resp.status == 200, await resp.text()
        return await resp.json()


def _momentum_norm(opt_state: Any) -> float:
    """The outer Nesterov's momentum trace, summed over every leaf (0 when it never moved)."""
    leaves = jax.tree.leaves(opt_state["outer"])
    return float(sum(np.abs(np.asarray(x)).sum() for x in leaves))


async def test_a_swap_to_diloco_rebuilds_the_outer_optimizer_and_checkpoints_it(
    cluster: Any, tmp_path: Path
) -> None:
    c = await cluster("asp", store={"dir": str(tmp_path), "interval_s": 0}, global_batch=64)
    for slowdown in (1, 2):
        await c.spawn(slowdown)
    await c.wait_for(lambda: c.engine.store.version >= 10, 60, "10 asp updates")
    async with aiohttp.ClientSession() as http:
        status = await _call(http, c.admin_url + "/v1/status", "GET")
        assert status["outer_optimizer"] == PLAIN

        reply = await _call(
            http, c.admin_url + "/v1/policy", "PUT", {"name": "diloco", "params": {"H": 4}}
        )
        assert reply["name"] == "diloco"
        status = await _call(http, c.admin_url + "/v1/status", "GET")
        assert status["outer_optimizer"] == NESTEROV
        version, evals = c.engine.store.version, len(c.engine.evaluations.evals)
        await c.wait_for(lambda: c.engine.store.version >= version + 6, 60, "6 diloco rounds")
        await c.wait_for(
            lambda: len(c.engine.evaluations.evals) > evals, 30, "an evaluation after the swap"
        )
        _, loss, accuracy = c.engine.evaluations.evals[-1][:3]
        assert math.isfinite(loss) and accuracy > 0.5  # digits: chance is 0.1

        # The checkpoint holds the Nesterov state and says which optimizer it belongs to.
        await _call(http, c.admin_url + "/v1/checkpoint", "POST")
        found = checkpoint.load_newest(tmp_path)
        assert found is not None
        saved = found[1]
        assert saved["outer_optimizer"] == NESTEROV and saved["policy"]["name"] == "diloco"
        assert set(saved["opt_state"]) == {"grad", "outer"}
        # A daemon started with asp (plain averaging, no outer state) restores it whole.
        fresh = build_engine(make_config("asp", global_batch=64))
        assert fresh.store.outer_spec == PLAIN
        checkpoint.restore_engine(fresh, saved)
        assert fresh.store.outer_spec == NESTEROV and fresh.host.policy.name == "diloco"
        _, restored, _ = fresh.store.state()
        moved = _momentum_norm(restored)
        assert moved > 0 and math.isclose(moved, _momentum_norm(saved["opt_state"]), rel_tol=1e-6)

        # A patch of diloco's own parameters keeps the optimizer and its momentum.
        await _call(http, c.admin_url + "/v1/policy", "PATCH", {"params": {"H": 3}})
        _, opt_state, _ = c.engine.store.state()
        assert c.engine.store.outer_spec == NESTEROV and _momentum_norm(opt_state) > 0

        # Back to asp: deltas are added as they are again, and training carries on.
        await _call(http, c.admin_url + "/v1/policy", "PUT", {"name": "asp"})
        status = await _call(http, c.admin_url + "/v1/status", "GET")
        assert status["outer_optimizer"] == PLAIN
        version = c.engine.store.version
        await c.wait_for(lambda: c.engine.store.version >= version + 10, 60, "asp again")
