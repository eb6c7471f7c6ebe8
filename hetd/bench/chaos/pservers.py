"""The chaos run's pservers (``--pservers S``): the daemon's config for them, where the admin API
shows their processes, how soon the update rate is back after one is killed, and a policy's
pserver scores and its lines in ``chaos.md`` (their slices against the head's parameters are
:mod:`.slices`').

With S >= 1 the run's daemon keeps the decision log and starts S local pserver processes
(``[pservers] log = true, servers = S, backend = "local"``), which it restarts when one dies; the
workers send each pserver its part of every push and pull their full releases from the pservers
(``--no-shm``: the path a worker on another host takes). :mod:`.faults` kills one with SIGKILL.

**Updates back** after a pserver kill at ``t``: the rate over :data:`BACK_WINDOW_S` just before
the kill (``[t - 2, t]``) is the reference; the rate is back at the first poll ``u >= t + 2`` whose
window ``[u - 2, u]`` (after the kill, whole) holds at least half the reference's rate. The figure
is ``u - t``, so it is never under the window's 2 s; the target is :data:`BACK_TARGET_S`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

BACK_WINDOW_S = 2.0  # the rate's window before and after a pserver kill
BACK_TARGET_S = 10.0  # the target: updates/s back within this many seconds of the kill
RESTART_WAIT_S = 180.0  # how long a kill waits to see the restarted pserver connected


class Polled(Protocol):
    """What :func:`updates_back` reads of a run (a :class:`~hetd.bench.chaos.cluster.Cluster`,
    which imports this module: so not named here)."""

    series: list[tuple[float, int, int, int]]  # (t, version, updates_applied, workers) per poll

    def rate(self, t0: float, t1: float) -> float: ...


def config_text(servers: int, headers: bool = False) -> str:
    """The ``[pservers]`` table of a run's daemon config (empty for none); ``headers``: the head
    takes each push's header only and holds no parameters (``headers = true``)."""
    if servers < 1:
        return ""
    # port 0: the link on any free port; a restarted daemon starts its pservers afresh
    return f'[pservers]\nlog = true\nservers = {servers}\nbackend = "local"\nport = 0\n' + (
        "headers = true\n" if headers else ""
    )


def _decisions(status: Any) -> dict[str, Any]:
    """``/v1/status``' ``decisions`` (empty when the daemon did not answer or keeps none)."""
    decisions = status.get("decisions") if isinstance(status, dict) else None
    return decisions if isinstance(decisions, dict) else {}


def process_row(status: Any, server: int) -> dict[str, Any] | None:
    """Pserver ``server``'s row in ``/v1/status``' ``decisions.processes`` (pid, state, restarts),
    or None when the daemon does not answer or shows no such process."""
    rows = _decisions(status).get("processes")
    for row in rows if isinstance(rows, list) else []:
        if isinstance(row, dict) and row.get("slice") == server:
            return row
    return None


def connected(status: Any) -> list[int]:
    """The pservers ``/v1/status`` shows connected to the head's link."""
    got = _decisions(status).get("connected")
    return [x for x in got if isinstance(x, int)] if isinstance(got, list) else []


def parts_dropped(status: Any) -> int | None:
    """Pushes the head dropped because a pserver's part did not come in time (None: not shown)."""
    parts = _decisions(status).get("parts")
    dropped = parts.get("dropped") if isinstance(parts, dict) else None
    return dropped if isinstance(dropped, int) else None


def updates_back(c: Polled, t_kill: float) -> dict[str, Any]:
    """The rate over the window before the kill at ``t_kill`` and how many seconds after it the
    rate over a window was back to half of that (None: not back while the run was polled)."""
    pre = c.rate(t_kill - BACK_WINDOW_S, t_kill)
    back = None
    if pre > 0:
        for t, *_ in c.series:
            if t >= t_kill + BACK_WINDOW_S and c.rate(t - BACK_WINDOW_S, t) >= 0.5 * pre:
                back = round(t - t_kill, 3)
                break
    return {"rate_before_kill": round(pre, 2), "updates_back_s": back}


def back_verdict(backs: list[float | None]) -> str:
    """The report's line on the target: the slowest kill's figure against :data:`BACK_TARGET_S`."""
    if not backs:
        return "pserver kill: none was done"
    if any(b is None for b in backs):
        return (
            f"pserver kill: updates/s not back by the end of the run after {backs.count(None)} "
            f"of {len(backs)} kills (target <= {BACK_TARGET_S:g} s): NOT met"
        )
    worst = max(b for b in backs if b is not None)
    met = "met" if worst <= BACK_TARGET_S else "NOT met"
    return f"pserver kill: updates/s back within {worst:g} s (target <= {BACK_TARGET_S:g} s): {met}"


# --- the scores and the report ----------------------------------------------------------------------


def scores(chaos: dict[str, Any], base: dict[str, Any], headers: bool = False) -> dict[str, Any]:
    """A pservers run's scores: its kills (restarted? updates back after how long?), the pushes
    dropped for a missing part, and whether every run's slices matched its head (``headers``: a
    head of headers, checked by :func:`hetd.bench.chaos.slices.slices_of_headers`)."""
    kills = [f for f in chaos["faults"] if f["kind"] == "kill_pserver" and "pid_killed" in f]
    backs = [f.get("updates_back_s") for f in kills]
    checks = [chaos["slices"], *base["slices"]]
    return {
        "pserver_heads": "headers" if headers else "whole",
        "pserver_kills": len(kills),
        "pservers_restarted": all(f.get("pid_new") is not None for f in kills),
        "pserver_updates_back_s": backs,
        "pserver_back_verdict": back_verdict(backs),
        "parts_dropped": chaos["parts_dropped"] + base["parts_dropped"],
        "slices_match_head": all(isinstance(x, dict) and x.get("match") for x in checks),
        "slices_why": [x.get("why") for x in checks if isinstance(x, dict) and not x.get("match")],
    }


def report_lines(p: dict[str, Any], fmt: Callable[[Any], str]) -> list[str]:
    """A pservers run's part of ``chaos.md``: each kill, the verdict on the 10 s target, the
    pushes dropped and the slices' check."""
    lines = [
        "",
        f"Pserver kills (updates back: the first {BACK_WINDOW_S:g} s window after the "
        f"kill with at least half the rate of the {BACK_WINDOW_S:g} s before it):",
        "",
        "| at (s) | pserver | pid killed | new pid | new pid seen (s) | reconnected (s) "
        "| updates/s before | updates back after (s) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for f in p["chaos"]["faults"]:
        if f["kind"] == "kill_pserver":
            lines.append(
                f"| {fmt(f['injected_s'])} | {f['pserver']} | {fmt(f.get('pid_killed'))} | "
                f"{fmt(f.get('pid_new'))} | {fmt(f.get('new_pid_s'))} | "
                f"{fmt(f.get('reconnected_s'))} | {fmt(f.get('rate_before_kill'))} | "
                f"{fmt(f.get('updates_back_s'))} |"
            )
    slices = "equal to the head's parameters bit for bit in every run"
    if p.get("pserver_heads") == "headers":
        slices = (
            "at the head's checkpoint's log position and version, joined into the model's "
            "shapes, finite, the same pushes consumed, in every run"
        )
    if not p["slices_match_head"]:
        slices = "NOT as the head's checkpoint says: " + "; ".join(str(x) for x in p["slices_why"])
    return [
        *lines,
        "",
        f"{p['pserver_back_verdict']}. Pushes dropped for a missing part: {p['parts_dropped']}. "
        f"The slices saved at the last checkpoint: {slices}.",
    ]
