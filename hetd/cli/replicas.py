"""``hetd replicas``: the pipeline replicas of a running daemon (docs/policies.md §11), read from
``GET /v1/replicas``, or one formed with ``--form`` (``POST /v1/replicas``)."""

from __future__ import annotations

import argparse
from typing import Any

from hetd.cli.admin_text import table
from hetd.cli.client import admin_command, admin_request, emit
from hetd.cli.common import Sub


def _ints(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected integers like 1,2 got {text!r}") from None


def add_replicas(sub: Sub, client: argparse.ArgumentParser) -> None:
    s = sub.add_parser(
        "replicas",
        parents=[client],
        help="the pipeline replicas: members (stage order), steps assembled and aborted",
        description="GET /v1/replicas of a running daemon: every pipeline replica, its members "
        "in stage order, generation, steps assembled and aborted, and its step timeout. With "
        "--form MEMBERS --cuts CUTS: form replica 0 from connected workers (POST /v1/replicas).",
    )
    s.add_argument("--form", type=_ints, metavar="W0,W1", help="worker ids in stage order")
    s.add_argument("--cuts", type=_ints, metavar="0,K,L", help="block cuts, from 0 to the end")
    s.add_argument("--micro", type=int, default=16, help="samples per micro-batch (16)")
    s.add_argument("--micro-batches", type=int, default=4, help="micro-batches per step (4)")
    s.set_defaults(run=_replicas)


def replicas_text(reply: dict[str, Any]) -> str:
    """One row per replica that ran."""
    rows = []
    for r in [reply, *reply.get("others", [])]:
        if not r.get("members") and not r.get("gen"):
            continue
        members = r.get("members") or []
        rows.append(
            [
                str(r["replica"]),
                " > ".join(str(m) for m in members) or "-",
                str(r["gen"]),
                str(r["step"]),
                str(r["assembled"]),
                str(r["aborted"]),
                str(r.get("timeouts", 0)),
                f"{r.get('timeout_s', 0.0):.0f} s",
            ]
        )
    if not rows:
        return "no pipeline replicas"
    head = ["replica", "stages", "gen", "step", "assembled", "aborted", "timeouts", "timeout"]
    return table(head, rows)


@admin_command
def _replicas(args: argparse.Namespace) -> None:
    if args.form is None:
        emit(args, admin_request(args, "GET", "/v1/replicas"), replicas_text)
        return
    body = {
        "members": args.form,
        "cuts": args.cuts or [],
        "micro": args.micro,
        "micro_batches": args.micro_batches,
    }
    emit(args, admin_request(args, "POST", "/v1/replicas", body), replicas_text)
