"""The ``hetd`` admin commands as an operator runs them (the installed console script, as a real
subprocess, token from the environment) against a real daemon on loopback, and the periodic
checkpoint timer writing and pruning files on its own while a real worker trains."""

from __future__ import annotations

import asyncio
import json
import os
import re
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import aiohttp
import pytest

from hetd.local.procs import stop_processes
from hetd.server import checkpoint
from policies.registry import policy_names
from tests.conftest import ADMIN_TOKEN, WORKER_TOKEN, Cluster

pytestmark = pytest.mark.slow

# The console script installed next to this interpreter (.venv/bin/hetd), not ``python -m hetd``.
HETD = Path(sys.executable).with_name("hetd")

MakeStored = Callable[..., Awaitable[Cluster]]


async def hetd(
    *args: str, token: str | None = ADMIN_TOKEN, url: str | None = None
) -> tuple[int, str, str]:
    """Run ``hetd ARGS`` as a subprocess (without blocking the daemon's event loop).

    ``token`` goes to ``HETD_ADMIN_TOKEN`` (None: unset), ``url`` to ``HETD_ADMIN_URL``.
    """
    assert HETD.exists(), f"{HETD} is not installed (pip install -e .)"
    env = {k: v for k, v in os.environ.items() if k not in ("HETD_ADMIN_TOKEN", "HETD_ADMIN_URL")}
    if token is not None:
        env["HETD_ADMIN_TOKEN"] = token
    if url is not None:
        env["HETD_ADMIN_URL"] = url
    proc = await asyncio.create_subprocess_exec(
        str(HETD),
        *args,
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


def parse_policy_get(out: str) -> tuple[str, dict[str, object], list[str]]:
    """``hetd policy get``'s text: ``NAME {params JSON}`` then ``known: a, b, c``."""
    lines = out.strip().splitlines()
    assert len(lines) == 2, out
    name, _, params = lines[0].partition(" ")
    assert lines[1].startswith("known: "), out
    return name, json.loads(params), lines[1].removeprefix("known: ").split(", ")


async def healthz(c: Cluster) -> dict[str, object]:
    async with (
        aiohttp.ClientSession() as http,
        http.get(c.admin_url + "/healthz") as resp,
    ):
        assert resp.status == 200
        reply: dict[str, object] = await resp.json()
        return reply


@pytest.fixture
def stored(cluster, tmp_path: Path) -> MakeStored:  # type: ignore[no-untyped-def]
    """``await stored(interval_s=..., keep=...)``: a daemon (policy asp) checkpointing into
    ``tmp_path / "state"`` (the ``cluster`` fixture stops it and its workers)."""

    async def make(interval_s: float, keep: int) -> Cluster:
        store = {"dir": str(tmp_path / "state"), "interval_s": interval_s, "keep": keep}
        c: Cluster = await cluster("asp", store=store)
        return c

    return make


async def test_policy_get_shows_the_running_policy_and_a_wrong_token_is_refused(  # type: ignore[no-untyped-def]
    cluster,
) -> None:
    c = await cluster("ssp", {"staleness": 2})
    code, out, err = await hetd("policy", "get", "--admin-url", c.admin_url)
    assert code == 0, err
    name, params, known = parse_policy_get(out)
    assert name == "ssp" and params == {"staleness": 2, "weight": None, "patience": 10.0}
    assert {"name": name, "params": params} == c.engine.host.policy.describe()
    assert known == policy_names() and {"asp", "bsp", "ssp"} <= set(known)

    # It shows the *running* policy: after a hot change through the API, the new parameters.
    async with (
        aiohttp.ClientSession() as http,
        http.patch(
            c.admin_url + "/v1/policy",
            json={"params": {"staleness": 5}},
            headers={"Authorization": f"Bearer {ADMIN_TOKEN}"},
        ) as resp,
    ):
        assert resp.status == 200, await resp.text()
    # ... and the URL can come from HETD_ADMIN_URL instead of --admin-url.
    code, out, err = await hetd("policy", "get", url=c.admin_url)
    assert code == 0, err
    assert parse_policy_get(out)[:2] == ("ssp", {"staleness": 5, "weight": None, "patience": 10.0})
    code, out, err = await hetd("policy", "get", "--admin-url", c.admin_url, "--json")
    assert code == 0, err
    assert json.loads(out) == {**c.engine.host.policy.describe(), "known": policy_names()}

    # A wrong token (or the worker's token, or none): exit 1, nothing on stdout, a clear reason
    # on stderr — and the token itself is never echoed.
    for token in ("wrong-token", WORKER_TOKEN):
        code, out, err = await hetd("policy", "get", "--admin-url", c.admin_url, token=token)
        assert code == 1 and out == "", (code, out, err)
        assert err.startswith("hetd: 401 unauthorized: missing or wrong admin token"), err
        assert token not in err
    code, out, err = await hetd("policy", "get", "--admin-url", c.admin_url, token=None)
    assert code == 1 and out == "", (code, out, err)
    assert "401 unauthorized" in err and "set HETD_ADMIN_TOKEN" in err, err
    # No daemon at the URL is another exit code, naming the URL.
    code, out, err = await hetd("policy", "get", "--admin-url", "http://127.0.0.1:1")
    assert code == 3 and "cannot reach the admin API at http://127.0.0.1:1" in err, err

    # The daemon shrugged all that off: alive, same policy, and the right token still works.
    assert (await healthz(c))["ok"] is True
    assert c.daemon._engine_task is not None and not c.daemon._engine_task.done()
    assert c.engine.host.policy.describe() == {
        "name": "ssp",
        "params": {"staleness": 5, "weight": None, "patience": 10.0},
    }
    code, out, err = await hetd("policy", "get", "--admin-url", c.admin_url)
    assert code == 0 and parse_policy_get(out)[0] == "ssp", err

    # This daemon has no state directory: 'hetd checkpoint' is refused with the reason.
    code, out, err = await hetd("checkpoint", "--admin-url", c.admin_url)
    assert code == 1 and out == "" and "409 no_state_dir" in err, (code, out, err)


CHECKPOINT_LINE = re.compile(r"checkpoint (\S+) \(version (\d+), (\d+) bytes\)")


async def test_checkpoint_cli_writes_a_file_named_for_its_version(
    stored: MakeStored, tmp_path: Path
) -> None:
    state_dir = tmp_path / "state"
    c = await stored(interval_s=0.0, keep=3)  # no timer: every file here is the CLI's
    await c.spawn()
    await c.wait_for(lambda: c.engine.store.version >= 20, 60, "20 updates from the worker")
    assert checkpoint.list_checkpoints(state_dir) == []
    before = c.engine.store.version

    code, out, err = await hetd("checkpoint", "--admin-url", c.admin_url)
    assert code == 0, err
    m = CHECKPOINT_LINE.fullmatch(out.strip())
    assert m, out
    path, version, nbytes = Path(m[1]), int(m[2]), int(m[3])
    assert before <= version <= c.engine.store.version
    assert path.parent.resolve() == state_dir.resolve()
    assert path.name == f"ckpt-00000001-v{version}.msgpack"
    assert path.is_file() and path.stat().st_size == nbytes
    assert checkpoint.list_checkpoints(state_dir) == [(1, path)]
    saved = checkpoint.decode(path.read_bytes())
    assert saved["version"] == version and saved["policy"]["name"] == "asp"
    assert saved["workers"] and all(w["active"] for w in saved["workers"].values())

    # A second one while training goes on: the next sequence number, a version no lower.
    await c.wait_for(lambda: c.engine.store.version > version, 30, "more updates")
    code, out, err = await hetd("checkpoint", "--admin-url", c.admin_url, "--json")
    assert code == 0, err
    reply = json.loads(out)
    assert reply["seq"] == 2 and reply["version"] > version
    second = Path(reply["path"])
    assert second.is_file() and f"-v{reply['version']}." in second.name
    assert [p for _, p in checkpoint.list_checkpoints(state_dir)] == [second, path]
    ck = c.daemon.checkpointer
    assert ck is not None and ck.written == 2 and ck.last is not None
    assert ck.last.to_json() == reply


async def test_timer_checkpoints_on_its_own_and_keeps_only_the_newest(
    stored: MakeStored, tmp_path: Path
) -> None:
    state_dir, keep, interval = tmp_path / "state", 2, 0.5
    c = await stored(interval_s=interval, keep=keep)
    ck = c.daemon.checkpointer
    assert ck is not None
    await c.spawn()
    await c.wait_for(lambda: c.engine.store.version > 0, 60, "the worker's first update")

    # Watch the directory while the timer works; nobody asks for a checkpoint.
    seen: set[str] = set()
    most = 0
    deadline = time.monotonic() + 15
    while ck.written < 5:
        assert time.monotonic() < deadline, f"only {ck.written} timed checkpoints in 15s"
        names = {p.name for _, p in checkpoint.list_checkpoints(state_dir)}
        seen |= names
        most = max(most, len(names))
        await asyncio.sleep(0.02)
    # A write lands before the prune, so keep + 1 files can exist for a moment, never more.
    assert most <= keep + 1, most

    # Stop training; once the version stands still the timer has nothing new to keep.
    await stop_processes(c.procs)
    await c.wait_for(lambda: not c.engine.members.facts, 10, "the worker to leave")
    final_version = c.engine.store.version
    await asyncio.sleep(2.5 * interval)  # one last timed write of the final version at most
    written = ck.written
    files = checkpoint.list_checkpoints(state_dir)
    await asyncio.sleep(2.5 * interval)
    assert ck.written == written and checkpoint.list_checkpoints(state_dir) == files

    # Exactly the newest `keep` files are left, each valid and named for the version it holds;
    # every older one was pruned.
    assert [seq for seq, _ in files] == [written, written - 1]
    versions = []
    for seq, path in files:
        saved = checkpoint.decode(path.read_bytes())
        assert path.name == f"ckpt-{seq:08d}-v{saved['version']}.msgpack"
        versions.append(saved["version"])
    assert versions[0] == final_version and versions[0] > versions[1]
    assert ck.last is not None and Path(ck.last.path) == files[0][1]
    seen |= {p.name for _, p in files}
    assert len(seen) > keep  # the watch saw files that are gone now
    for name in seen - {p.name for _, p in files}:
        assert not (state_dir / name).exists(), name
    assert not list(state_dir.glob(".*.tmp"))
