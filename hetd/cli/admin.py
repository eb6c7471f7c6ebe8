"""The admin commands: ``status``, ``workers``, ``policy get|set|patch``, ``checkpoint`` and
``export`` talk to a running daemon's admin API through :mod:`hetd.cli.client`."""

from __future__ import annotations

import argparse
import json
from typing import Any

from hetd.cli.admin_text import policy_text, status_text, workers_text
from hetd.cli.client import AdminError, admin_command, admin_request, emit
from hetd.cli.common import EXIT_USAGE, Sub, json_params


def _key_value(text: str) -> tuple[str, Any]:
    """``k=v``; ``v`` is read as JSON when it parses (3, 0.5, true, null, [1,2]), else a string."""
    key, sep, raw = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    try:
        value = json.loads(raw)
    except json.JSONDecodeError:
        value = raw
    return key, value


def add_status(sub: Sub, client: argparse.ArgumentParser) -> None:
    s = sub.add_parser(
        "status",
        parents=[client],
        help="version, stage, policy, workers, accuracy of a running daemon",
        description="GET /v1/status of a running daemon.",
    )
    s.set_defaults(run=_status)


def add_workers(sub: Sub, client: argparse.ArgumentParser) -> None:
    s = sub.add_parser(
        "workers",
        parents=[client],
        help="one row per active worker",
        description="GET /v1/workers: device, clock, speed, batch, codec, path, staleness, idle "
        "fraction and last sign of life of every active worker.",
    )
    s.set_defaults(run=_workers)


def add_policy(sub: Sub, client: argparse.ArgumentParser) -> None:
    p = sub.add_parser(
        "policy",
        help="show or hot-swap the running policy",
        description="Show or hot-swap the policy of a running daemon. A refused change (unknown "
        "name, bad parameters) leaves the running policy in place and says why.",
    )
    ps = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    g = ps.add_parser(
        "get", parents=[client], help="the running policy and the known names (GET /v1/policy)"
    )
    g.set_defaults(run=_policy_get)
    s = ps.add_parser(
        "set",
        parents=[client],
        help="replace the policy (PUT /v1/policy)",
        description="Replace the running policy by NAME with the given parameters (the factory's "
        "defaults for any not given).",
    )
    s.add_argument("name", help="policy name, e.g. bsp, asp, ssp (see 'hetd policy get')")
    _param_flags(s)
    s.set_defaults(run=_policy_set)
    m = ps.add_parser(
        "patch",
        parents=[client],
        help="change parameters of the running policy (PATCH /v1/policy)",
        description="Change some parameters of the running policy, keeping the others; "
        "a null value (--param k=null) removes a parameter so its default applies.",
    )
    _param_flags(m)
    m.set_defaults(run=_policy_patch)


def _param_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--params",
        type=json_params,
        default=None,
        metavar="JSON",
        help="parameters as a JSON object, e.g. '{\"staleness\": 5}'",
    )
    p.add_argument(
        "--param",
        type=_key_value,
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="one parameter (repeatable; VALUE is JSON when it parses, else a string); "
        "applied after --params",
    )


def add_checkpoint(sub: Sub, client: argparse.ArgumentParser) -> None:
    s = sub.add_parser(
        "checkpoint",
        parents=[client],
        help="write a checkpoint now (POST /v1/checkpoint)",
        description="Ask a running daemon to write a checkpoint into its state directory now.",
    )
    s.set_defaults(run=_checkpoint)


def add_export(sub: Sub, client: argparse.ArgumentParser) -> None:
    s = sub.add_parser(
        "export",
        parents=[client],
        help="write the model for the JAX ecosystem (POST /v1/export)",
        description="Ask a running daemon to write its current model into NAME under its export "
        "root on the daemon's machine ([store] export_dir; by default the state directory's "
        "exports/): an orbax CheckpointManager directory (step = version; items params, "
        "opt_state, meta), a bare params.msgpack that flax.serialization.msgpack_restore reads, "
        "and model.json: the model, version and every parameter's shape. Prints the full path.",
    )
    s.add_argument(
        "--out",
        default="model",
        metavar="NAME",
        help="directory under the daemon's export root, e.g. model or runs/a (created; default "
        "model); absolute paths, '..' and symbolic links are refused",
    )
    s.set_defaults(run=_export)


def _params_of(args: argparse.Namespace) -> dict[str, Any]:
    params = dict(args.params or {})
    params.update(dict(args.param))
    return params


@admin_command
def _status(args: argparse.Namespace) -> None:
    emit(args, admin_request(args, "GET", "/v1/status"), status_text)


@admin_command
def _workers(args: argparse.Namespace) -> None:
    emit(args, admin_request(args, "GET", "/v1/workers"), workers_text)


@admin_command
def _policy_get(args: argparse.Namespace) -> None:
    emit(
        args,
        admin_request(args, "GET", "/v1/policy"),
        lambda r: f"{policy_text(r)}\nknown: {', '.join(r.get('known', []))}",
    )


def _swapped(reply: dict[str, Any]) -> str:
    return f"policy {policy_text(reply['previous'])} -> {policy_text(reply)}"


@admin_command
def _policy_set(args: argparse.Namespace) -> None:
    body = {"name": args.name, "params": _params_of(args)}
    emit(args, admin_request(args, "PUT", "/v1/policy", body), _swapped)


@admin_command
def _policy_patch(args: argparse.Namespace) -> None:
    params = _params_of(args)
    if not params:
        raise AdminError(EXIT_USAGE, "policy patch: give --params JSON or --param KEY=VALUE")
    emit(args, admin_request(args, "PATCH", "/v1/policy", {"params": params}), _swapped)


@admin_command
def _export(args: argparse.Namespace) -> None:
    emit(
        args,
        admin_request(args, "POST", "/v1/export", {"out": args.out}),
        lambda r: (
            f"exported version {r['version']} to {r['dir']} (orbax step {r['step']}"
            f"{'' if r['written'] else ', already there'}) and {r['params_msgpack']}"
            + (f", described in {r['model_json']}" if r.get("model_json") else "")
        ),
    )


@admin_command
def _checkpoint(args: argparse.Namespace) -> None:
    emit(
        args,
        admin_request(args, "POST", "/v1/checkpoint"),
        lambda r: f"checkpoint {r['path']} (version {r['version']}, {r['nbytes']} bytes)",
    )
