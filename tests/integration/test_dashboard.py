"""The dashboard on a real daemon with two real workers: over HTTP (always), and in headless
Chromium driven by selenium (when Debian's chromium and chromium-driver are installed; ``.ci/run``
installs them when it runs as root).

Both tests share one daemon and its workers (one start-up, not two); each swaps to a policy of its
own (HTTP: ssp, browser: dssp), so either passes alone or after the other, in any order."""

from __future__ import annotations

import asyncio
import json
import shutil
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import pytest_asyncio

from tests.conftest import ADMIN_TOKEN, Cluster, clusters

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]

LIVE_TIMEOUT_S = 120.0  # two workers importing JAX and compiling on a loaded 2-core machine


async def next_state(resp: aiohttp.ClientResponse, timeout: float) -> dict[str, Any]:
    """The next ``state`` event of an SSE stream."""
    event = None
    while True:
        line = (await asyncio.wait_for(resp.content.readline(), timeout)).decode()
        if line.startswith("event:"):
            event = line.split(":", 1)[1].strip()
        elif line.startswith("data:") and event == "state":
            doc: dict[str, Any] = json.loads(line.split(":", 1)[1])
            return doc
        elif not line:
            raise AssertionError("the stream ended")


async def state_where(
    resp: aiohttp.ClientResponse, predicate: Any, what: str, timeout: float = LIVE_TIMEOUT_S
) -> dict[str, Any]:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    last: dict[str, Any] | None = None
    while loop.time() < deadline:
        last = await next_state(resp, max(0.1, deadline - loop.time()))
        if predicate(last):
            return last
    raise AssertionError(f"no state with {what} within {timeout} s; last: {last}")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def shared() -> AsyncIterator[Cluster]:
    """One asp daemon with a fast and a slow worker, for every test of this module."""
    async with clusters() as make:
        c = await make("asp")
        await c.spawn(1.0, 0.02)
        await c.spawn(2.0, 0.02)
        yield c


def live(doc: dict[str, Any]) -> bool:
    """Two workers joined, both pushed, and the model moved."""
    workers = doc["workers"]
    return (
        len(workers) == 2 and all(w["pushes"] > 0 for w in workers) and doc["status"]["version"] > 0
    )


async def test_dashboard_over_http_login_cookie_live_stream_and_swap(shared: Cluster) -> None:
    c = shared
    port = c.daemon.admin_port
    jar = aiohttp.CookieJar(unsafe=True)  # keep cookies for 127.0.0.1
    async with aiohttp.ClientSession(cookie_jar=jar) as http:
        # no session: the login form, which posts the token in its body
        async with http.get(c.admin_url + "/") as resp:
            page = await resp.text()
            assert resp.status == 200 and 'name="token"' in page and 'method="post"' in page
            assert "script-src 'self'" in resp.headers["Content-Security-Policy"]
        async with http.get(c.admin_url + "/v1/dashboard") as resp:
            assert resp.status == 401
        async with http.post(c.admin_url + "/login", data={"token": "wrong"}) as resp:
            assert resp.status == 401 and "wrong token" in await resp.text()
        assert not jar.filter_cookies(c.admin_url)

        async with http.post(
            c.admin_url + "/login", data={"token": ADMIN_TOKEN}, allow_redirects=False
        ) as resp:
            assert resp.status == 303 and resp.headers["Location"] == "/"
            set_cookie = resp.headers["Set-Cookie"]
        assert set_cookie.startswith(f"hetd_session_{port}=")
        assert "HttpOnly" in set_cookie and "SameSite=Strict" in set_cookie
        assert ADMIN_TOKEN not in set_cookie  # a random session id, not the token

        async with http.get(c.admin_url + "/") as resp:
            assert resp.status == 200 and 'id="swap"' in await resp.text()
        async with http.get(c.admin_url + "/ui/dashboard.js") as resp:
            assert resp.status == 200 and "EventSource" in await resp.text()

        async with http.get(c.admin_url + "/v1/dashboard/stream") as stream:
            assert stream.status == 200 and stream.content_type == "text/event-stream"
            doc = await state_where(stream, live, "2 workers and version > 0")
            names = sorted(w["name"] for w in doc["workers"])
            assert names == ["w0-x1", "w1-x2"]
            assert abs(sum(w["batch_share"] for w in doc["workers"]) - 1.0) < 1e-9
            assert all(w["samples_per_s"] > 0 and w["codec"] for w in doc["workers"])
            # each worker's plan: its local steps and stage (what ashl and diloco change)
            assert all(w["local_steps"] >= 1 and w["stage"] for w in doc["workers"])
            charts = doc["charts"]
            assert {"accuracy", "updates", "bytes", "stages"} <= set(charts)
            assert all(svg.startswith("<svg") for svg in charts.values())
            assert "<polyline" in charts["updates"]
            kinds = [e["kind"] for e in doc["events"]]
            assert kinds.count("join") == 2, doc["events"]

            # the swap form's endpoint: PUT /v1/policy, with the cookie and the dashboard header
            body = {"name": "ssp", "params": {"staleness": 2}}
            async with http.put(c.admin_url + "/v1/policy", json=body) as resp:
                assert resp.status == 401  # a cookie alone changes nothing (cross-site forms)
            async with http.put(
                c.admin_url + "/v1/policy", json=body, headers={"X-Hetd-Dashboard": "1"}
            ) as resp:
                assert resp.status == 200, await resp.text()
            doc = await state_where(
                stream, lambda d: d["policy"]["name"] == "ssp", "the new policy", 30
            )
            assert doc["policy"]["params"]["staleness"] == 2
            assert any(e["kind"] == "swap" and "-> ssp" in e["text"] for e in doc["events"])
        assert c.engine.host.policy.name == "ssp"

        async with http.post(c.admin_url + "/logout", allow_redirects=False) as resp:
            assert resp.status == 303
        async with http.get(c.admin_url + "/v1/dashboard") as resp:
            assert resp.status == 401


# In the browser: the swap button's label, the workers table's headers and first row, the
# policy's parameters, and every element of the policy box (parameters, swap form) that sticks out
# of that box or of the page.
LAYOUT_JS = """
const box = document.getElementById("swap").closest(".box").getBoundingClientRect();
const out = [];
for (const el of document.querySelectorAll("#policy-params, #policy-params *, #swap, #swap *")) {
  const r = el.getBoundingClientRect();
  if (r.width && (r.left < box.left - 0.5 || r.right > box.right + 0.5)) {
    out.push((el.id || el.tagName) + " " + Math.round(r.left) + "-" + Math.round(r.right));
  }
}
const pairs = [...document.querySelectorAll("#policy-params > div")];
return {
  button: document.getElementById("swap-button").innerText.trim(),
  headers: [...document.querySelectorAll("#workers thead th")].map((th) => th.innerText.trim()),
  row: [...document.querySelectorAll("#workers tbody tr:first-child td")].map((td) => td.innerText),
  params: Object.fromEntries(pairs.map((d) => [d.children[0].innerText, d.children[1].innerText])),
  outside: out,
  box: [box.left, box.right],
  page: [document.documentElement.scrollWidth, window.innerWidth],
};
"""


def _browser() -> tuple[str, str] | str:
    """(chromium, chromedriver) paths, or why the browser test cannot run here."""
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "selenium is not installed (pip install '.[test]')"
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = shutil.which("chromedriver")
    if chromium is None or driver is None:
        return (
            "no chromium/chromedriver on this machine (Debian: apt-get install chromium "
            "chromium-driver; .ci/run does it as root); the HTTP-level dashboard test above "
            "covers login, cookie, stream and swap without a browser"
        )
    return chromium, driver


async def test_dashboard_in_headless_chromium(shared: Cluster, tmp_path: Path) -> None:
    found = _browser()
    if isinstance(found, str):
        pytest.skip(found)
    chromium, driver_path = found
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select, WebDriverWait

    c = shared

    def drive() -> dict[str, Any]:
        options = webdriver.ChromeOptions()
        options.binary_location = chromium
        for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"):
            options.add_argument(flag)
        options.add_argument("--window-size=1280,1400")
        browser = webdriver.Chrome(options=options, service=Service(executable_path=driver_path))
        try:
            browser.get(c.admin_url + "/")
            browser.find_element(By.ID, "token").send_keys(ADMIN_TOKEN)
            browser.find_element(By.ID, "login-button").click()
            wait = WebDriverWait(browser, LIVE_TIMEOUT_S, poll_frequency=0.25)
            wait.until(lambda b: b.find_element(By.ID, "nworkers").text == "2")
            wait.until(lambda b: int(b.find_element(By.ID, "version").text or 0) > 0)
            wait.until(lambda b: len(b.find_elements(By.CSS_SELECTOR, "#workers tbody tr")) == 2)
            assert browser.find_element(By.ID, "connection").text == "live"
            assert browser.find_elements(By.CSS_SELECTOR, "#chart-updates svg polyline")
            cookies = browser.get_cookies()
            url_after_login = browser.current_url

            Select(browser.find_element(By.ID, "swap-name")).select_by_value("dssp")
            params = browser.find_element(By.ID, "swap-params")
            params.clear()
            params.send_keys('{"s_lo": 2}')
            browser.find_element(By.ID, "swap-button").click()
            WebDriverWait(browser, 30, poll_frequency=0.25).until(
                lambda b: (
                    b.find_element(By.ID, "policy-name").text == "dssp"
                    and "swap" in b.find_element(By.ID, "events").text
                )
            )
            browser.save_screenshot(str(tmp_path / "dashboard.png"))
            layout = browser.execute_script(LAYOUT_JS)
            # a long parameter list (as ashl's) and a long value wrap inside the box too
            browser.execute_script(
                "showParams(Object.fromEntries([...Array(30).keys()].map("
                "(i) => ['parameter_' + i, i === 7 ? Array(120).fill(0.125) : i])))"
            )
            stressed = browser.execute_script(LAYOUT_JS)
            return {
                "cookies": cookies,
                "url": url_after_login,
                "result": browser.find_element(By.ID, "swap-result").text,
                "workers": browser.find_element(By.CSS_SELECTOR, "#workers tbody").text,
                "layout": layout,
                "stressed": stressed,
            }
        finally:
            browser.quit()

    seen = await asyncio.to_thread(drive)
    (session,) = [k for k in seen["cookies"] if k["name"].startswith("hetd_session_")]
    assert session["httpOnly"] is True and session["sameSite"] == "Strict"
    assert ADMIN_TOKEN not in seen["url"] and ADMIN_TOKEN not in session["value"]
    assert seen["result"].startswith("now dssp")
    assert "w0-x1" in seen["workers"] and "w1-x2" in seen["workers"]
    layout = seen["layout"]
    assert layout["button"] == "Swap policy"
    assert layout["params"]["s_lo"] == "2", layout["params"]  # a key/value list
    headers = layout["headers"]
    assert "stage" in headers and "local steps" in headers, headers
    row = dict(zip(headers, layout["row"], strict=True))
    assert int(row["local steps"]) >= 1 and row["stage"] not in ("", "–"), row
    for name in ("layout", "stressed"):
        fit = seen[name]
        assert not fit["outside"], (name, fit["box"], fit["outside"])
        assert fit["page"][0] <= fit["page"][1], (name, fit["page"])  # no sideways scrolling
    assert len(seen["stressed"]["params"]) == 30
    assert c.engine.host.policy.name == "dssp"
    shot = tmp_path / "dashboard.png"
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 10_000
