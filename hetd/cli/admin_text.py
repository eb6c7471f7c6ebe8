"""Readable text of the admin API's replies (``hetd status``, ``hetd workers``, ...)."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any


def policy_text(p: dict[str, Any]) -> str:
    return f"{p['name']} {json.dumps(p.get('params', {}), sort_keys=True)}"


def _duration(seconds: float) -> str:
    s = int(seconds)
    h, rem = divmod(s, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else f"{m}m{s:02d}s" if m else f"{seconds:.1f}s"


def _throughput_text(rates: dict[str, Any] | None) -> str:
    if not rates or not rates.get("window_s"):
        return "-"
    return (
        f"{rates['updates_per_s']:.1f} updates/s, {rates['mb_in_per_s']:.1f} MB/s in, "
        f"{rates['mb_out_per_s']:.1f} MB/s out (last {rates['window_s']:.0f}s)"
    )


def _latency_text(lat: dict[str, Any] | None) -> str:
    if not lat or lat.get("p50_ms") is None:
        return "-"
    return f"p50 {lat['p50_ms']:.3f} ms, p99 {lat['p99_ms']:.3f} ms ({lat['events']} events)"


def _eval_rows(st: dict[str, Any], acc: float | None) -> list[tuple[str, str]]:
    """The last evaluation: accuracy and loss, or a Task's own metrics, and its target."""
    metrics = st.get("metrics") or {}
    if acc is not None or set(metrics) <= {"loss", "accuracy"}:
        rows = [("accuracy", "-" if acc is None else f"{acc:.4f} (loss {st.get('loss', 0.0):.4f})")]
    else:
        rows = [
            (
                "metrics",
                ", ".join(f"{k} {'-' if v is None else f'{v:.4g}'}" for k, v in metrics.items()),
            )
        ]
    target = st.get("target")
    if target:
        sign = "<=" if target["mode"] == "min" else ">="
        at = target.get("reached_at_s")
        rows.append(
            (
                "target",
                f"{target['metric']} {sign} {target['value']:g}: "
                + ("not reached yet" if at is None else f"reached at {at:.1f} s"),
            )
        )
    return rows


STATE_WIDTH = 160  # characters of the policy's state on its status line (--json: all of it)
_VALUE_WIDTH = 48  # ... of one field of it


def _compact(value: Any) -> str:
    """One value of a policy's state, short: a long list or map by its size."""
    text = json.dumps(value, separators=(",", ":"), sort_keys=True, default=str)
    if len(text) <= _VALUE_WIDTH:
        return text
    if isinstance(value, list | dict):
        return f"[{len(value)} items]" if isinstance(value, list) else f"{{{len(value)} keys}}"
    return text[: _VALUE_WIDTH - 1] + "…"


def policy_state_text(state: Any, policy: str = "") -> str:
    """The running policy's state (``policy_state`` of /v1/status) on one line: each field and
    its value, long ones by their size, the line cut at :data:`STATE_WIDTH`."""
    if state is None:
        return "- (this policy keeps none)"
    if not isinstance(state, dict):
        text = _compact(state)
    else:
        fields = {k: v for k, v in state.items() if not (k == "policy" and v == policy)}
        text = ", ".join(f"{k} {_compact(v)}" for k, v in fields.items()) or "{}"
    if len(text) > STATE_WIDTH:
        text = text[: STATE_WIDTH - 1] + "… (--json: all of it)"
    return text


FORECAST_SHOWN = 4  # candidates on the forecast line, best first (--json: all of them)


def forecast_rows(st: dict[str, Any]) -> list[tuple[str, str]]:
    """The planner's last forecast (the daemon's ``planning``) and what the policy made of it (its
    state's ``last_choice``, as ``auto`` keeps it); no rows while neither has anything to say."""
    planning = st.get("planning")
    state = st.get("policy_state")
    choice = state.get("last_choice") if isinstance(state, dict) else None
    last = planning.get("last") if isinstance(planning, dict) else None
    if last is None:
        if not isinstance(state, dict) or "last_choice" not in state:
            return []  # a policy that reads no forecasts
        if planning is None:
            return [("forecast", "off ([policy] plan_every_s = 0)")]
        return [("forecast", f"none yet (every {planning['every_s']:g} s)")]
    preds = last.get("predictions") or []
    best = ", ".join(f"{p['candidate']} {p['goodput']:.0f}/s" for p in preds[:FORECAST_SHOWN])
    if len(preds) > FORECAST_SHOWN:
        best += ", …"
    text = (
        f"{last['age_s']:.0f} s ago, {len(preds)} candidate(s) in {last['cost_s']:.2f} s CPU, "
        f"goodput {best or '-'}"
    )
    if last.get("refused"):
        text += f"; {len(last['refused'])} left out"
    if isinstance(planning, dict) and planning.get("skipped"):
        text += f"; {planning['skipped']} round(s) skipped for CPU"
    rows = [("forecast", text)]
    if isinstance(choice, dict):
        running, chosen = choice.get("running"), choice.get("chosen")
        moved = f"{running} -> {chosen}" if chosen else f"stays on {running}"
        rows.append(("choice", f"{moved}: {choice.get('why', '')}"))
    return rows


def log_rows(st: dict[str, Any]) -> list[tuple[str, str]]:
    """The decision log and its pservers (the daemon's ``decisions``), when one is kept."""
    d = st.get("decisions")
    if not isinstance(d, dict):
        return []
    rows = [
        ("decision log", f"position {d['position']}, version {d['version']}, from {d['first']}")
    ]
    saved = d.get("saved")
    if saved is not None:
        connected = set(d.get("connected") or ())
        cells = [
            f"{i}: saved {pos}{'' if i in connected else ' (not connected)'}"
            for i, pos in enumerate(saved)
        ]
        rows.append(("pservers", "; ".join(cells) or "none"))
    parts = d.get("parts")
    if isinstance(parts, dict):
        rows.append(
            (
                "pushes' parts",
                f"{parts['decided']} decided with every part, {parts['dropped']} dropped "
                f"without, {parts['waiting']} waiting",
            )
        )
    if d.get("head") == "headers":
        rows.append(("head", "takes push headers only; the pservers hold the parameters"))
    for p in d.get("processes") or ():
        pid = f"pid {p['pid']}" if p.get("pid") is not None else "no process"
        exit_ = f", last exit {p['last_exit']}" if p.get("last_exit") is not None else ""
        rows.append(
            (f"pserver {p['slice']}", f"{p['state']}, {pid}, {p['restarts']} restarts{exit_}")
        )
    return rows


def status_text(st: dict[str, Any]) -> str:
    """A readable /v1/status."""
    acc = st.get("accuracy")
    ck = st.get("checkpoint") or {}
    last = ck.get("last")
    rows: list[tuple[str, str]] = [
        ("version", str(st["version"])),
        ("stage", str(st["stage"])),
        ("policy", policy_text(st["policy"])),
        ("policy state", policy_state_text(st.get("policy_state"), st["policy"].get("name", ""))),
        *forecast_rows(st),
        ("outer optimizer", str(st.get("outer_optimizer", "-"))),
        ("uptime", _duration(float(st["uptime_s"]))),
        ("workers", str(st["workers"])),
        ("updates applied", str(st["updates_applied"])),
        ("buffered", str(st.get("buffered", 0))),
        *_eval_rows(st, acc),
        ("throughput", _throughput_text(st.get("throughput"))),
        ("engine latency", _latency_text(st.get("engine_latency"))),
        (
            "checkpoints",
            "off"
            if not ck.get("dir")
            else f"{ck['dir']}, last: "
            + (f"version {last['version']} ({os.path.basename(last['path'])})" if last else "none"),
        ),
        *log_rows(st),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """Left-aligned columns."""
    widths = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(headers)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)).rstrip()]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    return "\n".join(lines)


def _replica_cells(workers: Sequence[dict[str, Any]]) -> dict[int, str]:
    """Each pipeline stage's REPLICA cell: its replica's workers in stage order and which
    stage it is (``2 > 1 (stage 0)``); data-parallel workers have none."""
    stages: dict[int, dict[int, int]] = {}  # head -> stage -> worker
    for w in workers:
        row = w.get("replica")
        if row:
            stages.setdefault(row[0], {})[row[1]] = w["worker"]
    cells = {}
    for by_stage in stages.values():
        order = " > ".join(str(by_stage[s]) for s in sorted(by_stage))
        for s, wid in by_stage.items():
            cells[wid] = f"{order} (stage {s})"
    return cells


def workers_text(reply: dict[str, Any]) -> str:
    """A readable /v1/workers."""
    rows = []
    replicas = _replica_cells(reply["workers"])
    for w in reply["workers"]:
        dev = w.get("device") or {}
        device = ":".join(str(dev[k]) for k in ("platform", "kind") if dev.get(k)) or "-"
        rows.append(
            [
                str(w["worker"]),
                str(w["name"]),
                device,
                str(w["clock"]),
                f"{w.get('samples_per_s', 0.0):.0f}",
                str(w.get("batch_size", "-")),
                str(w.get("codec", "-")),
                str(w.get("path", "-")),
                f"{w.get('staleness_mean', 0.0):.2f}",
                f"{100 * w.get('idle_fraction', 0.0):.0f}%",
                f"{w.get('last_seen_s', 0.0):.1f}s",
                replicas.get(w["worker"], "-"),
            ]
        )
    if not rows:
        return "no active workers"
    headers = [
        "ID",
        "NAME",
        "DEVICE",
        "CLOCK",
        "SAMPLES/S",
        "BATCH",
        "CODEC",
        "PATH",
        "STALENESS",
        "IDLE",
        "SEEN",
        "REPLICA",
    ]
    return table(headers, rows)
