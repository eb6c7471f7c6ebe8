"""The pservers' targets, read from the system bench's rows (a pure function of them).

* **Scaling**: at 32M and at 100M parameters, int8, 4 senders, over the websocket, S = 2
  pservers give at least :data:`SCALE_TARGET` times the updates/s of S = 1 (the daemon alone).
  Every cell of that codec, sender count and path the run measured with both is judged; the
  target's sizes are marked as such.
* **Backends**: at S = 2 the ray backend's updates/s and p50 push latency (a sender's push to
  its ack) are within :data:`BACKEND_TOLERANCE` of the local backend's, in every cell that ran
  both.

Each verdict compares rows measured side by side in one run (their windows alternated).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

SCALE_TARGET = 1.4  # S = 2 over S = 1, updates/s
BACKEND_TOLERANCE = 0.05  # ray against local at S = 2, either way
TARGET_SIZES = (32_000_000, 100_000_000)  # the sizes the scaling target names
SCALE_CELL = ("int8", 4, "ws")  # its codec, senders and path


def _key(row: dict[str, Any]) -> tuple[Any, ...]:
    return (row["params"], row["codec"], row["workers"], row.get("transport", "ws"))


def _variant(row: dict[str, Any]) -> tuple[int, str]:
    """(S, backend), the backend marked ``+headers`` for a daemon that takes headers only."""
    backend = str(row.get("pserver_backend", "none"))
    return int(row.get("pservers", 1)), backend + ("+headers" if row.get("pserver_headers") else "")


def _target_size(params: int) -> bool:
    return any(abs(params - size) <= 0.01 * size for size in TARGET_SIZES)


def judge(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """One verdict per comparison the rows allow: ``what`` ("scaling" or "backends"), the cell,
    the figures compared, their ratio and ``met``."""
    cells: dict[tuple[Any, ...], dict[tuple[int, str], dict[str, Any]]] = {}
    for row in rows:
        cells.setdefault(_key(row), {})[_variant(row)] = row
    out: list[dict[str, Any]] = []
    for key, by in cells.items():
        params, codec, workers, transport = key
        cell = {"params": params, "codec": codec, "workers": workers, "transport": transport}
        one = by.get((1, "none"))
        if (codec, workers, transport) == SCALE_CELL and one is not None:
            for backend in ("local", "ray", "local+headers", "ray+headers"):
                two = by.get((2, backend))
                if two is None:
                    continue
                ratio = two["updates_per_s"] / max(1e-9, one["updates_per_s"])
                out.append(
                    {
                        "what": "scaling",
                        **cell,
                        "backend": backend,
                        "target_size": _target_size(params),
                        "s1_updates_per_s": one["updates_per_s"],
                        "s2_updates_per_s": two["updates_per_s"],
                        "ratio": round(ratio, 3),
                        "met": ratio >= SCALE_TARGET,
                    }
                )
        for head in ("", "+headers"):
            out += _backends(cell, by.get((2, "local" + head)), by.get((2, "ray" + head)))
    return out


def _backends(
    cell: dict[str, Any], local: dict[str, Any] | None, ray: dict[str, Any] | None
) -> list[dict[str, Any]]:
    """The ray backend against the local one in a cell (nothing unless it ran both)."""
    out: list[dict[str, Any]] = []
    if local is not None and ray is not None:
        ups = ray["updates_per_s"] / max(1e-9, local["updates_per_s"])
        lat_l, lat_r = local.get("push_p50_ms"), ray.get("push_p50_ms")
        lat = None if not lat_l or lat_r is None else lat_r / lat_l
        met = abs(ups - 1) <= BACKEND_TOLERANCE and (
            lat is not None and abs(lat - 1) <= BACKEND_TOLERANCE
        )
        out.append(
            {
                "what": "backends",
                **cell,
                "headers": bool(local.get("pserver_headers")),
                "ratio": round(ups, 3),
                "latency_ratio": None if lat is None else round(lat, 3),
                "met": met,
            }
        )
    return out


def targets_md(verdicts: Sequence[dict[str, Any]]) -> list[str]:
    """The verdicts as lines of ``system.md`` (nothing when the run had no pservers axis)."""
    if not verdicts:
        return []
    lines = ["Pserver targets (rows of this run, side by side):", ""]
    for v in verdicts:
        cell = f"{v['params']:,} {v['codec']} x{v['workers']} {v['transport']}"
        verdict = "met" if v["met"] else "NOT met"
        if v["what"] == "scaling":
            mark = "" if v["target_size"] else " (not a size the target names)"
            lines.append(
                f"* S = 2 ({v['backend']}) / S = 1 updates/s at {cell}{mark}: "
                f"{v['s2_updates_per_s']:.2f} / {v['s1_updates_per_s']:.2f} = {v['ratio']:.2f}x "
                f"(target >= {SCALE_TARGET}x): {verdict}"
            )
        else:
            lat = "n/a" if v["latency_ratio"] is None else f"{v['latency_ratio']:.2f}x"
            head = ", headers" if v.get("headers") else ""
            lines.append(
                f"* ray / local at S = 2{head}, {cell}: updates/s {v['ratio']:.2f}x, p50 push latency "
                f"{lat} (target within {BACKEND_TOLERANCE:.0%} each): {verdict}"
            )
    return [*lines, ""]
