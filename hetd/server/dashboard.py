"""The live dashboard on the admin port: one static page, fed by server-sent events.

Why this shape: the head node reaches no CDN and installs nothing at run time, so the page is
three small files shipped in the package (``hetd/server/static``) and the charts are SVG drawn
here, on the server, from the engine's own numbers; the browser only swaps them in. No build step,
no library, nothing fetched.

* **Auth.** ``GET /`` shows a login form; ``POST /login`` with the admin token (a form field, never
  in a URL) sets a random session id in an HttpOnly, SameSite=Strict cookie named after the admin
  port (``Secure`` under TLS). The session id is not the token, lives only in this process, and
  ends with ``POST /logout``, after :data:`SESSION_TTL_S`, or when the daemon stops. A cookie
  authenticates GETs on the admin API; a change (the swap form's ``PUT /v1/policy``, the same
  endpoint ``hetd policy set`` calls) must also carry the ``X-Hetd-Dashboard`` header, which no
  other site can make a browser send here.
* **Data.** :class:`Recorder` samples the engine once a second through ``engine.queue.call`` (status,
  workers, stages, evaluations, departures), keeps a few minutes of rates, and turns what changed
  into events (joins, leaves, swaps, stage changes, checkpoints, refused pushes).
  ``GET /v1/dashboard`` is the current state as JSON; ``GET /v1/dashboard/stream`` sends the same
  document as an SSE ``state`` event after every sample.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import math
import secrets
import time
from collections import deque
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from html import escape
from importlib import resources
from typing import Any
from urllib.parse import parse_qs

from aiohttp import web

from hetd.protocol.text import clip
from hetd.server.admin_context import (
    PUBLIC_KEY,
    SESSION_CHECK,
    AdminContext,
    AdminSlot,
    context,
    note_failure,
    too_many_failures,
)

log = logging.getLogger("hetd.server.dashboard")

SESSION_TTL_S = 12 * 3600.0
MAX_SESSIONS = 64
SAMPLE_S = 1.0  # one engine sample (and one SSE event) per second while someone watches
IDLE_SAMPLE_S = 5.0  # otherwise (events and rates still accumulate)
WATCH_S = 60.0  # a page or an API read counts as watching for this long
MAX_EVALS = 5000  # evaluations drawn in the accuracy chart (the newest)
HISTORY = 600  # samples kept for the rate charts (10 minutes)
EVENTS = 100  # recent events kept
MAX_EVENT = 600  # characters of an event's text
KEEPALIVE_S = 15.0
CHANGE_HEADER = "X-Hetd-Dashboard"
STATIC = ("dashboard.js", "dashboard.css")
SECURITY_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; "
    "img-src 'self' data:; connect-src 'self'; form-action 'self'; frame-ancestors 'none'; "
    "base-uri 'none'",
    "X-Frame-Options": "DENY",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}


# --- sessions ----------------------------------------------------------------------------------------


class Sessions:
    """Random session ids -> expiry (monotonic s); in memory only."""

    def __init__(self, ttl_s: float = SESSION_TTL_S, clock: Callable[[], float] = time.monotonic):
        self.ttl_s = ttl_s
        self._clock = clock
        self._ids: dict[str, float] = {}

    def new(self) -> str:
        now = self._clock()
        self._ids = {k: v for k, v in self._ids.items() if v > now}
        while len(self._ids) >= MAX_SESSIONS:  # the oldest goes
            del self._ids[min(self._ids, key=self._ids.__getitem__)]
        sid = secrets.token_urlsafe(32)
        self._ids[sid] = now + self.ttl_s
        return sid

    def valid(self, sid: str | None) -> bool:
        if not sid:
            return False
        expiry = next((v for k, v in self._ids.items() if hmac.compare_digest(k, sid)), None)
        return expiry is not None and expiry > self._clock()

    def end(self, sid: str | None) -> None:
        if sid:
            self._ids.pop(sid, None)


def cookie_name(request: web.Request) -> str:
    """One cookie per admin port: two daemons on one host keep apart sessions (browsers do not
    scope cookies by port)."""
    return f"hetd_session_{request.url.port or 0}"


# --- SVG charts ---------------------------------------------------------------------------------------

W, H, PAD_L, PAD_B, PAD_T, PAD_R = 560, 180, 44, 22, 10, 10
COLOURS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b")


def _fmt(v: float) -> str:
    return f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}"


def _target_metric(status: Mapping[str, Any]) -> str | None:
    """A task's target metric when it is not the accuracy (the dashboard then shows it)."""
    target = status.get("target")
    metric = target["metric"] if target else None
    return None if metric in (None, "accuracy") else str(metric)


def _headline(status: Mapping[str, Any]) -> dict[str, Any]:
    """The first card: the accuracy, or a task's target metric by its own name."""
    metric = _target_metric(status)
    if metric is None:
        return {"label": "Accuracy", "value": status.get("accuracy")}
    return {"label": metric, "value": (status.get("metrics") or {}).get(metric)}


def _eval_chart(
    status: Mapping[str, Any],
    evals: Sequence[tuple[float, float, float]],
    metric_evals: Sequence[tuple[float, Mapping[str, float]]],
) -> str:
    """Test accuracy and loss against time; for a task with another target metric, that metric
    and the loss (not capped: their scales are the task's). NaN points are left out."""
    metric = _target_metric(status)
    if metric is None:
        return line_chart(
            [
                ("accuracy", [(t, a) for t, _, a in evals if math.isfinite(a)]),
                ("loss", [(t, min(1.0, x)) for t, x, _ in evals if math.isfinite(x)]),
            ],
            title="test accuracy and loss (loss capped at 1) against time",
            y_min=0.0,
            y_max=1.0,
        )

    def points(name: str) -> list[tuple[float, float]]:
        return [(t, m[name]) for t, m in metric_evals if math.isfinite(m.get(name, math.nan))]

    return line_chart(
        [(metric, points(metric)), ("loss", points("loss"))],
        title=f"test {metric} and loss against time",
    )


def line_chart(
    series: Sequence[tuple[str, Sequence[tuple[float, float]]]],
    *,
    title: str,
    y_min: float | None = None,
    y_max: float | None = None,
) -> str:
    """An SVG line chart of ``(label, [(x, y), ...])`` series sharing one x axis (seconds)."""
    pts = [p for _, s in series for p in s]
    head = (
        f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {W} {H}" class="chart" '
        f'role="img" aria-label="{escape(title)}"><title>{escape(title)}</title>'
    )
    if not pts:
        return head + f'<text x="{W / 2}" y="{H / 2}" text-anchor="middle">no data yet</text></svg>'
    x0, x1 = min(p[0] for p in pts), max(p[0] for p in pts)
    lo = min(p[1] for p in pts) if y_min is None else y_min
    hi = max(p[1] for p in pts) if y_max is None else y_max
    x1, hi = (x1 if x1 > x0 else x0 + 1.0), (hi if hi > lo else lo + 1.0)

    def sx(x: float) -> float:
        return PAD_L + (x - x0) / (x1 - x0) * (W - PAD_L - PAD_R)

    def sy(y: float) -> float:
        return H - PAD_B - (y - lo) / (hi - lo) * (H - PAD_B - PAD_T)

    parts = [
        head,
        f'<rect x="{PAD_L}" y="{PAD_T}" width="{W - PAD_L - PAD_R}" '
        f'height="{H - PAD_B - PAD_T}" fill="none" stroke="#bbb"/>',
    ]
    for y in (lo, (lo + hi) / 2, hi):
        parts.append(
            f'<text x="{PAD_L - 4}" y="{sy(y) + 4:.1f}" text-anchor="end" '
            f'font-size="11">{_fmt(y)}</text>'
        )
    for x in (x0, x1):
        parts.append(
            f'<text x="{sx(x):.1f}" y="{H - 6}" text-anchor="middle" font-size="11">'
            f"{_fmt(x)} s</text>"
        )
    for i, (label, s) in enumerate(series):
        colour = COLOURS[i % len(COLOURS)]
        if s:
            coords = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in _thin(s))
            parts.append(
                f'<polyline fill="none" stroke="{colour}" stroke-width="1.5" points="{coords}"/>'
            )
        parts.append(
            f'<text x="{PAD_L + 8 + 130 * i}" y="{PAD_T + 14}" font-size="12" fill="{colour}">'
            f"{escape(label)}{'' if not s else ' ' + _fmt(s[-1][1])}</text>"
        )
    parts.append("</svg>")
    return "".join(parts)


def _thin(points: Sequence[tuple[float, float]], most: int = 400) -> Sequence[tuple[float, float]]:
    if len(points) <= most:
        return points
    step = len(points) / most
    kept = [points[int(i * step)] for i in range(most)]
    return [*kept, points[-1]]


def stage_timeline(stages: Sequence[tuple[float, str]], first: str, now: float) -> str:
    """An SVG bar: one segment per stage, from the start to ``now``."""
    segments: list[tuple[float, float, str]] = []
    start, name = 0.0, first
    for t, stage in stages:
        segments.append((start, t, name))
        start, name = t, stage
    segments.append((start, max(now, start), name))
    span = max(now, 1e-9)
    names = list(dict.fromkeys(s for _, _, s in segments))
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {W} 40" class="timeline" '
        'role="img" aria-label="stage timeline"><title>stage timeline</title>'
    ]
    for a, b, stage in segments:
        x = PAD_L + a / span * (W - PAD_L - PAD_R)
        w = max(1.0, (b - a) / span * (W - PAD_L - PAD_R))
        colour = COLOURS[names.index(stage) % len(COLOURS)]
        parts.append(
            f'<rect x="{x:.1f}" y="4" width="{w:.1f}" height="18" fill="{colour}" '
            f'opacity="0.7"><title>{escape(stage)} {a:.1f}-{b:.1f} s</title></rect>'
        )
        if w > 40:
            parts.append(
                f'<text x="{x + 4:.1f}" y="17" font-size="11" fill="#fff">{escape(stage)}</text>'
            )
    parts.append(
        f'<text x="{PAD_L}" y="36" font-size="11">0 s</text>'
        f'<text x="{W - PAD_R}" y="36" font-size="11" text-anchor="end">{now:.0f} s</text></svg>'
    )
    return "".join(parts)


# --- the recorder -------------------------------------------------------------------------------------


@dataclass
class _Seen:
    """What the previous sample held, to tell what changed."""

    workers: dict[int, dict[str, Any]] = field(default_factory=dict)
    departure: tuple[float, int, str] | None = None
    stages: int = 0
    policy: dict[str, Any] | None = None
    checkpoint_path: str | None = None


class Recorder:
    """Samples the engine once a second; keeps rates and events; wakes the SSE streams."""

    def __init__(self, slot: AdminSlot) -> None:
        self.slot = slot
        self.rates: deque[tuple[float, float, float, float]] = deque(maxlen=HISTORY)
        self.events: deque[dict[str, Any]] = deque(maxlen=EVENTS)
        self.state: dict[str, Any] | None = None
        self.closing = False
        self.watched_until = 0.0  # loop time until which samples come every SAMPLE_S
        self._seen = _Seen()
        self._tick = asyncio.Condition()
        self._poke = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="hetd-dashboard")

    async def close(self) -> None:
        self.closing = True
        async with self._tick:
            self._tick.notify_all()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _run(self) -> None:
        while True:
            ctx = self.slot.ctx
            if ctx is not None:
                try:
                    await self.sample(ctx)
                except Exception:  # a slow or stopping engine: try again next second
                    log.debug("dashboard sample failed", exc_info=True)
            loop = asyncio.get_running_loop()
            pause = SAMPLE_S if loop.time() < self.watched_until else IDLE_SAMPLE_S
            with contextlib.suppress(TimeoutError):  # a new viewer cuts an idle pause short
                await asyncio.wait_for(self._poke.wait(), pause)
            self._poke.clear()

    def watch(self) -> None:
        """Someone reads the dashboard: sample every second for the next minute."""
        now = asyncio.get_running_loop().time()
        if now >= self.watched_until:
            self._poke.set()
        self.watched_until = now + WATCH_S

    async def wait(self, timeout: float) -> bool:
        """Wait for the next sample; False on timeout."""
        async with self._tick:
            try:
                await asyncio.wait_for(self._tick.wait(), timeout)
            except TimeoutError:
                return False
        return True

    async def sample(self, ctx: AdminContext) -> dict[str, Any]:
        """One sample of the engine (on its task), folded into rates and events."""
        engine = ctx.engine

        def read() -> dict[str, Any]:
            from policies.registry import policy_names

            return {
                "status": engine.status(),
                "buffered": engine.applier.buffered(),
                "workers": engine.workers(),
                "policy": {**engine.host.policy.describe(), "known": policy_names()},
                "evals": list(engine.evaluations.evals[-MAX_EVALS:]),
                "metric_evals": list(engine.evaluations.history[-MAX_EVALS:]),
                "stages": list(engine.host.stages),
                "departures": list(engine.members.departures),
            }

        raw = await asyncio.wait_for(engine.queue.call(read), ctx.timeout_s)
        daemon = ctx.daemon_status()
        self._fold(raw, daemon)
        self.state = self._document(raw, daemon)
        async with self._tick:
            self._tick.notify_all()
        return self.state

    def _event(self, t: float, kind: str, text: str) -> None:
        # (a worker's name and bye reason are cut to 200 characters each before they get here)
        self.events.append({"t": round(t, 2), "kind": kind, "text": clip(text, MAX_EVENT)})

    def _fold(self, raw: Mapping[str, Any], daemon: Mapping[str, Any]) -> None:
        st = raw["status"]
        now = float(st["uptime_s"])
        rates = st.get("throughput") or {}
        self.rates.append(
            (
                now,
                float(rates.get("updates_per_s", 0.0)),
                float(rates.get("mb_in_per_s", 0.0)),
                float(rates.get("mb_out_per_s", 0.0)),
            )
        )
        seen = self._seen
        rows = {int(w["worker"]): w for w in raw["workers"]}
        for wid, w in rows.items():
            dev = w.get("device") or {}
            device = ":".join(str(dev[k]) for k in ("platform", "kind") if dev.get(k)) or "-"
            before = seen.workers.get(wid)
            if before is None:
                self._event(now, "join", f"worker {wid} ({w['name']}) joined on {device}")
            elif w.get("refused", 0) > before.get("refused", 0):
                n = w["refused"] - before.get("refused", 0)
                self._event(now, "refusal", f"worker {wid} ({w['name']}): {n} push(es) refused")
        departures = [tuple(d) for d in raw["departures"]]
        fresh = departures
        if seen.departure is not None and seen.departure in departures:
            fresh = departures[departures.index(seen.departure) + 1 :]
        for t, wid, reason in fresh:
            name = seen.workers.get(int(wid), {}).get("name", "?")
            self._event(float(t), "leave", f"worker {wid} ({name}) left: {reason}")
        if departures:
            seen.departure = departures[-1]
        for t, stage in raw["stages"][seen.stages :]:
            self._event(float(t), "stage", f"stage {stage}")
        seen.stages = len(raw["stages"])
        policy = {"name": raw["policy"]["name"], "params": raw["policy"].get("params", {})}
        if seen.policy is not None and policy != seen.policy:
            self._event(
                now,
                "swap",
                f"policy {seen.policy['name']} {json.dumps(seen.policy['params'], sort_keys=True)}"
                f" -> {policy['name']} {json.dumps(policy['params'], sort_keys=True)}",
            )
        seen.policy = policy
        last = (daemon.get("checkpoint") or {}).get("last")
        path = last.get("path") if last else None
        if last and path and path != seen.checkpoint_path:
            self._event(now, "checkpoint", f"checkpoint at version {last['version']}: {path}")
        seen.checkpoint_path = path
        seen.workers = rows

    def _document(self, raw: Mapping[str, Any], daemon: Mapping[str, Any]) -> dict[str, Any]:
        st = dict(raw["status"])
        st["buffered"] = raw["buffered"]
        now = float(st["uptime_s"])
        evals = raw["evals"]
        total_batch = sum(int(w.get("batch_size") or 0) for w in raw["workers"]) or 1
        workers = [
            {
                "worker": w["worker"],
                "name": w["name"],
                "device": w.get("device") or {},
                # what ashl, diloco and adsp change per worker: from the worker's plan
                "stage": (w.get("plan") or {}).get("stage"),
                "local_steps": (w.get("plan") or {}).get("local_steps"),
                "local_time_s": (w.get("plan") or {}).get("local_time_s"),
                "samples_per_s": w.get("samples_per_s", 0.0),
                "batch_size": w.get("batch_size", 0),
                "batch_share": (w.get("batch_size") or 0) / total_batch,
                "staleness_mean": w.get("staleness_mean", 0.0),
                "idle_fraction": w.get("idle_fraction", 0.0),
                "codec": w.get("codec", "-"),
                "bytes_in": w.get("bytes_in", 0),
                "bytes_out": w.get("bytes_out", 0),
                "pushes": w.get("pushes", 0),
                "refused": w.get("refused", 0),
                "clock": w.get("clock", 0),
            }
            for w in raw["workers"]
        ]
        # before the first recorded switch: the stage the engine started in (unknown: "start")
        first_stage = "start" if raw["stages"] else str(st["stage"])
        rates = list(self.rates)
        return {
            "status": st,
            "policy": raw["policy"],
            "workers": workers,
            "events": list(self.events)[::-1],
            "daemon": dict(daemon),
            "headline": _headline(st),
            "charts": {
                "accuracy": _eval_chart(st, evals, raw.get("metric_evals") or []),
                "updates": line_chart(
                    [("updates/s", [(t, u) for t, u, _, _ in rates])],
                    title="updates applied per second",
                    y_min=0.0,
                ),
                "bytes": line_chart(
                    [
                        ("MB/s in", [(t, i) for t, _, i, _ in rates]),
                        ("MB/s out", [(t, o) for t, _, _, o in rates]),
                    ],
                    title="MB/s in (pushes) and out (parameters)",
                    y_min=0.0,
                ),
                "stages": stage_timeline(
                    [(float(t), str(s)) for t, s in raw["stages"]], first_stage, now
                ),
            },
        }


# --- routes -------------------------------------------------------------------------------------------

SESSIONS = web.AppKey("dashboard_sessions", Sessions)
RECORDER = web.AppKey("dashboard_recorder", Recorder)


def _static(name: str) -> str:
    return resources.files("hetd.server").joinpath("static", name).read_text(encoding="utf-8")


def _page(name: str, **values: str) -> web.Response:
    text = _static(name)
    for key, value in values.items():
        text = text.replace("{{" + key + "}}", escape(value))
    return web.Response(text=text, content_type="text/html", headers=SECURITY_HEADERS)


def session_of(request: web.Request) -> str | None:
    return request.cookies.get(cookie_name(request))


def logged_in(request: web.Request) -> bool:
    return request.app[SESSIONS].valid(session_of(request))


def session_check(request: web.Request) -> bool:
    """The admin guard's second way in: a dashboard session; changes also need the header."""
    if not logged_in(request):
        return False
    return request.method in ("GET", "HEAD") or request.headers.get(CHANGE_HEADER) == "1"


async def index(request: web.Request) -> web.Response:
    """The dashboard when logged in, else the login form."""
    if logged_in(request):
        return _page("dashboard.html")
    return _page("login.html", message="")


async def login(request: web.Request) -> web.StreamResponse:
    """The login form's POST: the token as a form field; a session cookie on success."""
    slot = request.app[RECORDER].slot
    busy = too_many_failures(slot, request)  # counted per address: parallel guesses too
    if busy is not None:
        page = _page("login.html", message="too many wrong tokens: try again later")
        page.set_status(429)
        page.headers.update({k: v for k, v in busy.headers.items() if k == "Retry-After"})
        return page
    raw = await request.read()
    if len(raw) > 4096:
        raise web.HTTPRequestEntityTooLarge(max_size=4096, actual_size=len(raw))
    form = parse_qs(raw.decode("utf-8", "replace"))
    token = (form.get("token") or [""])[0]
    if not slot.token or not hmac.compare_digest(token.encode(), slot.token.encode()):
        log.warning("dashboard: refused a login from %s (wrong token)", request.remote)
        if slot.token:
            note_failure(slot, request)
        await asyncio.sleep(0.3)  # a guess costs time
        reason = "no admin token is configured" if not slot.token else "wrong token"
        page = _page("login.html", message=reason)
        page.set_status(401)
        return page
    sid = request.app[SESSIONS].new()
    response = _see_root()
    response.set_cookie(
        cookie_name(request),
        sid,
        max_age=int(SESSION_TTL_S),
        path="/",
        httponly=True,
        samesite="Strict",
        secure=slot.tls,
    )
    log.info("dashboard: login from %s", request.remote)
    return response


async def logout(request: web.Request) -> web.StreamResponse:
    request.app[SESSIONS].end(session_of(request))
    response = _see_root()
    response.del_cookie(cookie_name(request), path="/")
    return response


def _see_root() -> web.Response:
    return web.Response(status=303, headers={**SECURITY_HEADERS, "Location": "/"})


def _asset(name: str) -> Callable[[web.Request], Awaitable[web.Response]]:
    kind = "application/javascript" if name.endswith(".js") else "text/css"

    async def serve(request: web.Request) -> web.Response:
        return web.Response(text=_static(name), content_type=kind, headers=SECURITY_HEADERS)

    return serve


async def state(request: web.Request) -> web.Response:
    """The dashboard's document now (what each SSE event carries)."""
    recorder = request.app[RECORDER]
    recorder.watch()
    ctx = context(request)  # 503 while starting
    doc = recorder.state if recorder.state is not None else await recorder.sample(ctx)
    return web.json_response(doc)


async def stream(request: web.Request) -> web.StreamResponse:
    """Server-sent events: a ``state`` event after every sample; comments keep it open."""
    recorder = request.app[RECORDER]
    recorder.watch()
    response = web.StreamResponse(
        headers={
            "Content-Type": "text/event-stream",
            "Cache-Control": "no-store",
            "X-Accel-Buffering": "no",
        }
    )
    await response.prepare(request)
    await response.write(b"retry: 2000\n\n")
    try:
        if recorder.state is not None:
            await response.write(_sse(recorder.state))
        while not recorder.closing:
            recorder.watch()
            if await recorder.wait(KEEPALIVE_S) and recorder.state is not None:
                await response.write(_sse(recorder.state))
            elif not recorder.closing:
                await response.write(b": keep-alive\n\n")
    except (ConnectionError, asyncio.CancelledError):  # the viewer left (while a write waited
        pass  # for it: ConnectionError, not ConnectionResetError)
    return response


def _sse(doc: Mapping[str, Any]) -> bytes:
    return b"event: state\ndata: " + json.dumps(doc, separators=(",", ":")).encode() + b"\n\n"


def install(app: web.Application, slot: AdminSlot) -> None:
    """Add the dashboard's routes and its recorder to the admin app."""
    recorder = Recorder(slot)
    app[SESSIONS] = Sessions()
    app[RECORDER] = recorder
    app[SESSION_CHECK] = session_check
    app[PUBLIC_KEY] = frozenset({"/", "/login", "/logout", *(f"/ui/{n}" for n in STATIC)})
    app.router.add_get("/", index)
    app.router.add_post("/login", login)
    app.router.add_post("/logout", logout)
    for name in STATIC:
        app.router.add_get(f"/ui/{name}", _asset(name))
    app.router.add_get("/v1/dashboard", state)
    app.router.add_get("/v1/dashboard/stream", stream)

    async def on_startup(app: web.Application) -> None:
        recorder.start()

    async def on_shutdown(app: web.Application) -> None:
        await recorder.close()

    app.on_startup.append(on_startup)
    app.on_shutdown.append(on_shutdown)
