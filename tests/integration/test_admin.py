"""The admin API on a real daemon on loopback, with real worker processes and the real CLI."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from hetd import config as config_mod
from hetd.server.daemon import Daemon
from tests.conftest import ADMIN_TOKEN, WORKER_TOKEN, Cluster, make_config

pytestmark = pytest.mark.slow

AUTH = {"Authorization": f"Bearer {ADMIN_TOKEN}"}

# (method, path, JSON body) — every route of the admin API.
ROUTES: list[tuple[str, str, Any]] = [
    ("GET", "/v1/status", None),
    ("GET", "/v1/workers", None),
    ("GET", "/v1/policy", None),
    ("PUT", "/v1/policy", {"name": "asp"}),
    ("PATCH", "/v1/policy", {"params": {}}),
    ("POST", "/v1/checkpoint", None),
    ("POST", "/v1/export", {"out": "hetd-test-admin-export"}),
    ("GET", "/metrics", None),
    ("GET", "/openapi.json", None),
    ("GET", "/v1/dashboard", None),
    ("GET", "/v1/replicas", None),
    # no workers here: refused (409) with the reason
    (
        "POST",
        "/v1/replicas",
        {"members": [1, 2], "cuts": [0, 1, 2], "micro": 8, "micro_batches": 2},
    ),
]
# Routes a test reads only in part: the token is checked all the same.
STREAMS = [("GET", "/v1/dashboard/stream", None)]
# Routes without a token: liveness, and the dashboard's login page and static files.
PUBLIC = {("GET", "/healthz"), ("GET", "/"), ("POST", "/login"), ("POST", "/logout")}
PUBLIC |= {("GET", "/ui/dashboard.js"), ("GET", "/ui/dashboard.css")}


async def call(
    http: aiohttp.ClientSession,
    c: Cluster,
    method: str,
    path: str,
    body: Any = None,
    headers: dict[str, str] | None = None,
    data: str | bytes | None = None,
) -> tuple[int, Any]:
    """One request; the reply as (status, JSON or text)."""
    async with http.request(
        method,
        c.admin_url + path,
        json=body if data is None else None,
        data=data,
        headers=AUTH if headers is None else headers,
    ) as resp:
        if resp.content_type == "application/json":
            return resp.status, await resp.json()
        return resp.status, await resp.text()


async def hetd_cli(*args: str, token: str = ADMIN_TOKEN) -> tuple[int, str, str]:
    """Run the real ``hetd`` command line; the token comes from the environment."""
    env = {**os.environ, "HETD_ADMIN_TOKEN": token}
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "hetd",
        *args,
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await proc.communicate()
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


async def test_every_route_wants_the_admin_token_and_is_documented(cluster) -> None:  # type: ignore[no-untyped-def]
    c = await cluster("ssp", {"staleness": 3})
    refused = [{}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Bearer {WORKER_TOKEN}"}]
    refused += [{"Authorization": ADMIN_TOKEN}, {"Authorization": f"Basic {ADMIN_TOKEN}"}]
    async with aiohttp.ClientSession() as http:
        for method, path, body in ROUTES + STREAMS:
            for headers in refused:
                status, reply = await call(http, c, method, path, body, headers)
                assert status == 401, (method, path, headers, reply)
                assert reply["error"] == "unauthorized" and "admin token" in reply["message"]
            if (method, path, body) in STREAMS:  # never ends: its first line is enough
                async with http.get(c.admin_url + path, headers=AUTH) as resp:
                    assert resp.status == 200 and resp.content_type == "text/event-stream"
                    assert (await resp.content.readline()).startswith(b"retry:")
                continue
            status, reply = await call(http, c, method, path, body)
            # No state directory is configured here: checkpointing and exporting (no export
            # root) are refused with a reason.
            conflict = path in ("/v1/checkpoint", "/v1/export") or (method, path) == (
                "POST",
                "/v1/replicas",
            )
            assert status == (409 if conflict else 200), (method, path, reply)
        status, reply = await call(http, c, "GET", "/healthz", headers={})
        assert status == 200 and reply["ok"] is True

        # Every registered route is in the OpenAPI document, and nothing else.
        status, doc = await call(http, c, "GET", "/openapi.json")
        assert doc["openapi"].startswith("3.1")
        documented = {(m.upper(), p) for p, ops in doc["paths"].items() for m in ops}
        assert c.daemon.admin_app is not None
        served = {
            (r.method, r.resource.canonical)
            for r in c.daemon.admin_app.router.routes()
            if r.method != "HEAD" and r.resource is not None
        }
        guarded = {(m, p) for m, p, _ in ROUTES + STREAMS}
        assert served == documented == guarded | PUBLIC
        for path, ops in doc["paths"].items():
            for method, op in ops.items():
                assert "200" in op["responses"]
                assert (method.upper(), path) in PUBLIC or "401" in op["responses"]
        # ... and every key of the status it serves is in the document's Status
        status, served_status = await call(http, c, "GET", "/v1/status")
        described = doc["components"]["schemas"]["Status"]["properties"]
        missing = sorted(set(served_status) - set(described))
        assert status == 200 and not missing, missing


async def test_no_admin_token_configured_refuses_every_call_but_healthz() -> None:
    cfg = config_mod.replace(make_config("asp"), "server", admin_token="")
    daemon = Daemon(cfg)
    await daemon.start()
    c = Cluster(daemon, f"ws://127.0.0.1:{daemon.port}")
    try:
        async with aiohttp.ClientSession() as http:
            for method, path, body in ROUTES + STREAMS:
                for headers in ({}, AUTH, {"Authorization": "Bearer "}):
                    status, reply = await call(http, c, method, path, body, headers)
                    assert status == 401 and "no admin token is configured" in reply["message"]
            assert (await call(http, c, "GET", "/healthz", headers={}))[0] == 200
        assert daemon.engine.host.policy.name == "asp"
    finally:
        await daemon.stop()


async def test_bad_operator_input_gets_400_and_changes_nothing(cluster) -> None:  # type: ignore[no-untyped-def]
    c = await cluster("ssp", {"staleness": 3})
    before = c.engine.host.policy.describe()
    bad: list[tuple[str, Any, str | None, str]] = [
        ("PUT", None, "{not json", "bad_json"),
        ("PUT", None, '{"name": "asp", "params": {"weight": NaN}}', "bad_json"),
        ("PUT", None, "\xff\xfe", "bad_json"),
        ("PUT", None, "[1, 2]", "bad_request"),
        ("PUT", {"params": {}}, None, "bad_request"),
        ("PUT", {"name": 3}, None, "bad_request"),
        ("PUT", {"name": ""}, None, "bad_request"),
        ("PUT", {"name": "ssp", "params": [3]}, None, "bad_request"),
        ("PUT", {"name": "ssp", "colour": "red"}, None, "bad_request"),
        ("PUT", {"name": "nope"}, None, "bad_policy"),
        ("PUT", {"name": "ssp", "params": {"staleness": -1}}, None, "bad_policy"),
        ("PUT", {"name": "ssp", "params": {"staleness": "x"}}, None, "bad_policy"),
        ("PUT", {"name": "ssp", "params": {"stalenes": 2}}, None, "bad_policy"),
        ("PATCH", {}, None, "bad_request"),
        ("PATCH", {"params": "x"}, None, "bad_request"),
        ("PATCH", {"params": {"staleness": 1.5}}, None, "bad_policy"),
        ("PATCH", {"params": {"bogus": 1}}, None, "bad_policy"),
    ]
    async with aiohttp.ClientSession() as http:
        for method, body, data, code in bad:
            headers = {**AUTH, "Content-Type": "application/json"}
            status, reply = await call(http, c, method, "/v1/policy", body, headers, data)
            assert (status, reply["error"]) == (400, code), (body, data, reply)
            assert reply["message"]
            if code == "bad_policy":  # the reply shows the policy that keeps running
                assert reply["policy"] == before
        status, reply = await call(http, c, "GET", "/v1/policy")
        assert {"name": reply["name"], "params": reply["params"]} == before
        assert {"asp", "bsp", "ssp"} <= set(reply["known"])
        status, reply = await call(http, c, "PUT", "/v1/policy", data=b"x" * (2 * 1024 * 1024))
        assert status == 413
        status, reply = await call(http, c, "GET", "/v1/nothing")
        assert status == 404 and reply["error"] == "not_found"
        status, reply = await call(http, c, "DELETE", "/v1/policy")
        assert status == 405
        # A merge patch: null removes a parameter (its default applies).
        status, reply = await call(http, c, "PATCH", "/v1/policy", {"params": {"staleness": 1}})
        assert status == 200 and reply["params"]["staleness"] == 1
        assert reply["previous"] == before
        status, reply = await call(http, c, "PATCH", "/v1/policy", {"params": {"staleness": None}})
        assert status == 200 and reply["params"]["staleness"] == 3
    assert c.engine.host.policy.describe() == before
    # The CLI reports refusals on stderr with a non-zero exit and never needs the token in argv.
    code, _, err = await hetd_cli("policy", "set", "nope", "--admin-url", c.admin_url)
    assert code == 1 and "400 bad_policy" in err and "known policies" in err
    code, _, err = await hetd_cli("status", "--admin-url", c.admin_url, token="wrong")
    assert code == 1 and "401" in err


def metric_families(text: str) -> dict[str, Any]:
    return {f.name: f for f in text_string_to_metric_families(text)}


async def test_hot_swap_under_load_loses_no_update(cluster) -> None:  # type: ignore[no-untyped-def]
    """bsp -> ssp -> asp while 3 real workers train: no update lost, nobody disconnected, clocks
    and the version carry on; status, workers and metrics describe every worker."""
    c = await cluster("bsp")
    for slowdown in (1, 1.5, 2):
        await c.spawn(slowdown)
    await c.wait_for(lambda: len(c.engine.members.facts) == 3, 60, "3 workers to join")
    ids = set(c.engine.members.facts)

    def clocks() -> dict[int, int]:
        return {w: f.clock for w, f in c.engine.members.facts.items()}

    await c.wait_for(lambda: min(clocks().values(), default=0) >= 5, 60, "5 BSP rounds")
    history: list[tuple[str, int, dict[int, int]]] = []
    async with aiohttp.ClientSession() as http:
        for name, params in (("ssp", {"staleness": 2}), ("asp", {})):
            version, before = c.engine.store.version, clocks()
            status, reply = await call(
                http, c, "PUT", "/v1/policy", {"name": name, "params": params}
            )
            assert status == 200, reply
            assert reply["name"] == name and c.engine.host.policy.name == name
            assert c.engine.applier.buffered() == 0  # the swap applied what BSP had buffered
            history.append((name, version, before))
            await c.wait_for(
                lambda v=version: c.engine.store.version >= v + 15, 30, f"progress under {name}"
            )
        # The CLI drives the same API: back to ssp, then a parameter change.
        code, out, err = await hetd_cli(
            "policy", "set", "ssp", "--param", "staleness=3", "--admin-url", c.admin_url
        )
        assert code == 0 and "asp" in out and "ssp" in out, err
        code, out, err = await hetd_cli(
            "policy", "patch", "--params", '{"staleness": 1}', "--admin-url", c.admin_url, "--json"
        )
        assert code == 0 and json.loads(out)["params"]["staleness"] == 1, err
        version = c.engine.store.version
        await c.wait_for(lambda: c.engine.store.version >= version + 10, 30, "progress after CLI")

        # Nobody was disconnected and every clock carried on.
        assert set(c.engine.members.facts) == ids and not c.engine.members.departures, (
            c.engine.members.departures
        )
        assert all(p.returncode is None for p in c.procs)
        for _, _, before in history:
            assert all(clocks()[w] >= before[w] for w in ids)
        # No update lost: each push was applied, buffered (then flushed) or dropped on purpose
        # (none here), and every applied update moved the version once.
        for w in ids:
            st = c.engine.members.stats[w]
            assert st.pushes == st.applied + st.buffered + st.dropped, (w, st)
            assert st.dropped == 0
        assert c.engine.applier.updates_applied == c.engine.store.version

        status, st = await call(http, c, "GET", "/v1/status")
        assert status == 200
        assert st["policy"] == {
            "name": "ssp",
            "params": {"staleness": 1, "weight": None, "patience": 10.0},
        }
        assert st["workers"] == 3 and st["stage"] == "main" and st["uptime_s"] > 0
        assert st["version"] >= version + 10 and st["updates_applied"] == st["version"]
        assert st["daemon"]["admin_port"] == c.daemon.admin_port
        status, body = await call(http, c, "GET", "/v1/workers")
        rows = {r["worker"]: r for r in body["workers"]}
        assert set(rows) == ids
        for r in rows.values():
            assert r["device"]["platform"] == "cpu" and r["clock"] > 5
            assert r["samples_per_s"] > 0 and r["batch_size"] > 0 and r["codec"]
            assert 0 <= r["idle_fraction"] <= 1 and r["last_seen_s"] < 5
            assert r["staleness_mean"] >= 0

        pushes_before = sum(c.engine.members.stats[w].pushes for w in ids)
        status, text = await call(http, c, "GET", "/metrics")
        assert status == 200
        pushes_after = sum(
            c.engine.members.stats[w].pushes for w in ids
        )  # workers are still pushing
        fams = metric_families(text)
        assert fams["hetd_version"].samples[0].value >= version + 10
        assert fams["hetd_workers"].samples[0].value == 3
        names = {f.name for f in c.engine.members.facts.values()}
        for family in (
            "hetd_worker_samples",
            "hetd_worker_samples_per_second",
            "hetd_worker_wait_seconds",
            "hetd_worker_received_bytes",
            "hetd_worker_sent_bytes",
            "hetd_worker_updates_applied",
            "hetd_worker_local_steps",
            "hetd_worker_bits",
            "hetd_worker_topk_ratio",
            "hetd_worker_lr_scale",
        ):
            assert {s.labels["name"] for s in fams[family].samples} == names, family
        codecs_shown = {
            (s.labels["name"], s.labels["codec"]) for s in fams["hetd_worker_codec"].samples
        }
        assert codecs_shown == {(n, "none") for n in names}
        stale = [s for s in fams["hetd_worker_staleness"].samples if s.name.endswith("_count")]
        assert {s.labels["name"] for s in stale} == names
        assert pushes_before <= sum(s.value for s in stale) <= pushes_after
        assert any(s.labels.get("name") == "ssp" for s in fams["hetd_policy"].samples)

    code, out, err = await hetd_cli("status", "--admin-url", c.admin_url)
    assert code == 0 and "ssp" in out and "workers" in out, err
    code, out, err = await hetd_cli("workers", "--admin-url", c.admin_url)
    assert code == 0 and all(n in out for n in names), err
