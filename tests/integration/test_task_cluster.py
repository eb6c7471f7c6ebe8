"""A user's own Task with a real daemon and real ``hetd-worker`` processes: trained to its target
(metrics by name in status, /metrics and the CLI), exported in the user's structure, checkpointed
and resumed; and every bad input refused in one line while the daemon keeps running."""

from __future__ import annotations

import asyncio
import json
import logging
import os
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import pytest

from hetd.local.procs import spawn_daemon, spawn_worker, stop_processes, worker_env
from tests.conftest import ADMIN_TOKEN, WORKER_TOKEN, Cluster
from tests.integration.test_admin import hetd_cli

pytestmark = pytest.mark.slow

TASKS = Path(__file__).resolve().parent.parent / "tasks"
LINREG = f"{TASKS / 'linreg.py'}:task"
AUTH = {"Authorization": f"Bearer {ADMIN_TOKEN}"}


async def _worker(url: str, spec: str | None, variant: str = "") -> asyncio.subprocess.Process:
    env = {**worker_env(WORKER_TOKEN), "HETD_TEST_TASK_VARIANT": variant}
    task = ["--task", spec] if spec else []
    return await spawn_worker(
        url, *task, "--max-retries", "3", env=env, stderr=asyncio.subprocess.PIPE
    )


async def _exits(proc: asyncio.subprocess.Process, timeout: float = 120) -> tuple[int, str]:
    assert proc.stderr is not None
    err = await asyncio.wait_for(proc.stderr.read(), timeout)
    code = await asyncio.wait_for(proc.wait(), timeout)
    return code, err.decode()


async def test_a_task_trains_to_its_target_and_comes_out_in_its_own_structure(
    cluster: Any, tmp_path: Path
) -> None:
    c: Cluster = await cluster("ssp", task=LINREG, store={"dir": str(tmp_path / "state")})
    for _ in range(2):
        await c.spawn(1.0, 0.0, "--task", LINREG)
    # both workers in (on a loaded machine the first can reach the target before the second has
    # joined) and the target reached
    await c.wait_for(
        lambda: len(c.engine.workers()) == 2 and c.engine.evaluations.target_at is not None,
        150,
        "both workers joined and the task's target (r2 >= 0.98)",
    )
    # two workers: the data cut in two, one half each
    assert sorted(tuple(w["shard"]) for w in c.engine.workers()) == [(0, 2), (1, 2)]

    code, out, err = await hetd_cli("status", "--json", "--admin-url", c.admin_url)
    assert code == 0, err
    status = json.loads(out)
    assert set(status["metrics"]) == {"loss", "mse", "r2"}
    assert status["target"]["metric"] == "r2" and status["target"]["reached_at_s"] > 0
    assert status["accuracy"] is None  # this task has no accuracy
    code, text, err = await hetd_cli("status", "--admin-url", c.admin_url)
    assert "target" in text and "reached at" in text and "r2" in text, text
    async with (
        aiohttp.ClientSession() as http,
        http.get(f"{c.admin_url}/metrics", headers=AUTH) as resp,
    ):
        prom = await resp.text()
    assert 'hetd_eval_metric{metric="r2"}' in prom

    # schedules advance once per applied update: the optimizer's own count says so
    await stop_processes(c.procs)
    await c.wait_for(lambda: not c.engine.members.facts, 30, "the workers to leave")
    _, opt_state, version = c.engine.store.state()
    counts = [int(leaf) for leaf in _count_leaves(opt_state)]
    assert counts and all(n == c.engine.applier.updates_applied for n in counts), (counts, version)

    # hetd export writes the user's tree: a list of two weights and a 0-d bias
    code, _, err = await hetd_cli("export", "--out", "out", "--admin-url", c.admin_url)
    assert code == 0, err
    from flax import serialization

    import tests.tasks.linreg as linreg

    blob = (tmp_path / "state" / "exports" / "out" / "params.msgpack").read_bytes()
    restored = serialization.from_state_dict(linreg.init(None), serialization.msgpack_restore(blob))
    assert isinstance(restored["w"], list) and np.shape(restored["b"]) == ()
    snap = c.engine.store.snapshot()
    np.testing.assert_array_equal(np.asarray(restored["w"][1]), snap.tensors["w/1"])

    # a checkpoint of the task's optimizer state, resumed by a new daemon
    code, _, err = await hetd_cli("checkpoint", "--admin-url", c.admin_url)
    assert code == 0, err
    await c.daemon.stop()
    again: Cluster = await cluster("ssp", task=LINREG, store={"dir": str(tmp_path / "state")})
    assert again.engine.store.version == version
    _, resumed, _ = again.engine.store.state()
    assert [int(x) for x in _count_leaves(resumed)] == counts


def _count_leaves(tree: Any) -> list[Any]:
    """The ``count`` fields of an optax state (schedules and Adam keep one)."""
    import jax

    found = []
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        if path and getattr(path[-1], "name", None) == "count":
            found.append(leaf)
    return found


async def test_workers_that_do_not_bring_the_daemons_task_are_refused(cluster: Any) -> None:
    c: Cluster = await cluster("asp", task=LINREG)
    bare = await _worker(c.url, None)
    other = await _worker(c.url, LINREG, variant="wide")
    code, err = await _exits(bare)
    assert code == 2 and "trains the task 'linreg'" in err and "--task" in err, err
    code, err = await _exits(other)
    assert code == 2 and "is not this worker's 'linreg'" in err and "extra" in err, err
    # and a task worker at a daemon of the bundled models
    plain: Cluster = await cluster("asp")
    code, err = await _exits(await _worker(plain.url, LINREG))
    assert code == 2 and "bundled model 'mlp'" in err, err


async def test_a_worker_whose_data_fails_exits_and_the_daemon_goes_on(cluster: Any) -> None:
    c: Cluster = await cluster("asp", task=LINREG)
    code, err = await _exits(await _worker(c.url, LINREG, variant="bad_data"))
    assert code == 2 and "train_data failed: OSError: the data disk went away" in err, err
    good = await _worker(c.url, LINREG)
    c.procs.append(good)
    await c.wait_for(lambda: c.engine.applier.updates_applied >= 5, 120, "a good worker's updates")
    assert [w["shard"] for w in c.engine.workers()] == [[0, 1]]  # alone: all of the data


async def test_nan_metrics_show_as_null_and_training_goes_on(cluster: Any) -> None:
    os.environ["HETD_TEST_TASK_VARIANT"] = "nan_eval"  # the daemon's own import of the task
    try:
        import importlib

        import tests.tasks.linreg as linreg

        importlib.reload(linreg)
        c: Cluster = await cluster("asp", task="tests.tasks.linreg:task")
    finally:
        del os.environ["HETD_TEST_TASK_VARIANT"]
        importlib.reload(linreg)
    c.procs.append(await _worker(c.url, "tests.tasks.linreg:task", variant="nan_eval"))
    await c.wait_for(
        lambda: c.engine.applier.updates_applied >= 5 and bool(c.engine.evaluations.evals),
        120,
        "updates",
    )
    code, out, err = await hetd_cli("status", "--json", "--admin-url", c.admin_url)
    assert code == 0, err
    status = json.loads(out)
    assert status["metrics"]["r2"] is None and status["metrics"]["mse"] is not None
    assert status["target"]["reached_at_s"] is None


async def _serve_refused(*args: str) -> str:
    """``hetd serve ARGS`` on free ports: it must exit 2 without a traceback; its stderr."""
    proc = await spawn_daemon(
        *args,
        "--port",
        "0",
        "--admin-port",
        "-1",
        env={**os.environ, "HETD_WORKER_TOKEN": WORKER_TOKEN},
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    _, err = await asyncio.wait_for(proc.communicate(), 120)
    text = err.decode()
    assert proc.returncode == 2 and "Traceback" not in text, text[-2000:]
    return text


@pytest.mark.parametrize(
    ("spec", "says"),
    [
        ("no_such_pkg_q:task", "cannot import 'no_such_pkg_q'"),
        (f"{TASKS / 'linreg.py'}:init", "building the task failed"),
        (f"{TASKS / 'linreg.py'}:X", "is a ndarray, not a hetd.Task"),
        (f"{TASKS / 'not_scalar.py'}:task", "loss must return a scalar"),
    ],
)
def test_hetd_serve_refuses_a_bad_task_in_one_line(
    spec: str, says: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``hetd serve``'s own entry point in this process (its parser, config, daemon start and
    error handling: all but the interpreter's exit, which the model check below runs as a real
    process): exit status 2 and the reason as the last ``hetd:`` line, no traceback."""
    from hetd.cli.main import main

    monkeypatch.setenv("HETD_WORKER_TOKEN", WORKER_TOKEN)
    levels = {name: logging.getLogger(name).level for name in ("", "hetd", "absl")}
    try:
        code = main(["serve", "--task", spec, "--port", "0", "--admin-port", "-1"])
    finally:  # hetd's logging set-up, undone for the tests after this one
        for name, level in levels.items():
            logging.getLogger(name).setLevel(level)
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err, err[-2000:]
    lines = [line for line in err.splitlines() if line.startswith("hetd:")]
    assert lines and says in lines[-1], err[-2000:]


async def test_hetd_worker_refuses_a_bad_task_before_connecting() -> None:
    # nothing listens on port 9: the task is checked before any connection is tried
    proc = await _worker("ws://127.0.0.1:9", f"{TASKS / 'linreg.py'}:nope")
    code, err = await _exits(proc)
    assert code == 2 and "has no attribute 'nope'" in err and "Traceback" not in err, err


async def test_hetd_demo_stops_at_a_tasks_target(tmp_path: Path) -> None:
    from hetd.local.demo import DemoOptions, replace, result_text, run_demo

    opts = replace(
        DemoOptions(),
        task=LINREG,
        slowdowns=(1.0, 2.0),
        policy="asp",
        policy_params=(),
        budget_s=150.0,
        quiet=True,
        out=str(tmp_path / "demo"),
    )
    summary = await run_demo(opts)
    assert summary["time_to_target_s"] is not None, summary
    assert summary["stop_metrics"]["r2"] >= 0.98 and "r2" in summary["final_metrics"]
    text = result_text(summary)
    assert text.startswith("target r2 >= 0.98 reached at"), text
    assert (tmp_path / "demo" / "accuracy.png").is_file()


async def test_hetd_serve_refuses_a_model_that_does_not_fit_the_labels() -> None:
    text = await _serve_refused("--model", "tests.tasks.three_outputs:model", "--dataset", "digits")
    assert "3 outputs" in text and "10 classes" in text, text[-2000:]
