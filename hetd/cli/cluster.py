"""``hetd cluster up|status|down``: a head and its pservers placed on a Ray cluster.

``up`` joins a running Ray cluster (``ray start --head`` makes one; ``--address`` or
``RAY_ADDRESS`` names it), reserves the detached placement group ``hetd`` (one bundle of one CPU
for the head, one per pserver) and starts the head as the detached actor ``hetd-head``: it runs
``hetd serve`` on the config given, with ``[pservers] log = true, servers = S, backend = "ray"``
(written to ``<[store] dir>/cluster.toml``), and that daemon starts the S pserver actors in the
group's other bundles. Ray restarts an actor whose process died, and finds each by name. Workers
connect to the head's worker port as always. ``down`` stops the head (it drains, saves its final
checkpoint, and stops its pservers), then removes the actors and the group.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hetd.cli.common import EXIT_UNREACHABLE, EXIT_USAGE, Sub
from hetd.config import toml_text

STRATEGIES = ("STRICT_PACK", "PACK", "SPREAD", "STRICT_SPREAD")
HEAD_RESTARTS = 5  # restarts of the head's actor (each resumes from its newest checkpoint)
TOKENS = ("HETD_WORKER_TOKEN", "HETD_ADMIN_TOKEN")  # passed on to the head from this shell


def add_cluster(sub: Sub) -> None:
    p = sub.add_parser(
        "cluster",
        help="a head and its pservers on a Ray cluster (up, status, down; pip install 'hetd[ray]')",
        description="Place a hetd head and S pservers on a running Ray cluster as named, "
        "detached actors in one placement group; Ray restarts them when they die.",
    )
    verbs = p.add_subparsers(dest="verb", required=True, metavar="VERB")
    where = argparse.ArgumentParser(add_help=False)
    where.add_argument(
        "--address",
        default=None,
        help="the Ray cluster (default: RAY_ADDRESS, else the one started on this host)",
    )
    up = verbs.add_parser("up", parents=[where], help="start the head and its pservers")
    up.add_argument("--backend", choices=("ray",), default="ray", help="who places them (ray)")
    up.add_argument("--pservers", type=int, required=True, help="how many pservers (S >= 1)")
    up.add_argument("--config", required=True, help="the head's hetd.toml (needs [store] dir)")
    up.add_argument(
        "--strategy",
        choices=STRATEGIES,
        default="STRICT_PACK",
        help="the placement group's strategy (default STRICT_PACK: one node, since the "
        "pservers' link listens on loopback only)",
    )
    up.add_argument("--timeout", type=float, default=120.0, help="s to wait for the reservation")
    up.set_defaults(run=_up)
    status = verbs.add_parser("status", parents=[where], help="the head's and pservers' actors")
    status.add_argument("--json", action="store_true", help="one JSON object")
    status.set_defaults(run=_status)
    down = verbs.add_parser("down", parents=[where], help="stop them and free the group")
    down.add_argument(
        "--timeout", type=float, default=120.0, help="s for the head to drain and stop"
    )
    down.set_defaults(run=_down)


# --- the head's config ------------------------------------------------------------------------------


def head_config(path: Path, servers: int) -> dict[str, Any]:
    """The config at ``path`` with the pservers the cluster runs, and its state directory made
    absolute (the actors run elsewhere); checked as ``hetd serve`` would check it."""
    from hetd import config

    if servers < 1:
        raise config.ConfigError(f"--pservers must be >= 1, got {servers}")
    try:
        raw = tomllib.loads(path.read_text())
    except OSError as exc:
        raise config.ConfigError(f"cannot read config {path}: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise config.ConfigError(f"config {path} is not valid TOML: {exc}") from None
    store = dict(raw.get("store", {}))
    if not store.get("dir"):
        raise config.ConfigError(
            "[store] dir is needed: the head's checkpoints and the pservers' slices live there"
        )
    store["dir"] = str((path.parent / str(store["dir"])).resolve())
    raw["store"] = store
    raw["pservers"] = dict(raw.get("pservers", {}), log=True, servers=servers, backend="ray")
    config.check_serving(config.from_mapping(raw))
    return raw


# --- the verbs --------------------------------------------------------------------------------------


def _join(address: str | None) -> Any:
    from hetd.server.pserver_ray import NAMESPACE, load_ray

    ray = load_ray()
    address = address or os.environ.get("RAY_ADDRESS") or "auto"
    try:
        ray.init(address=address, namespace=NAMESPACE, log_to_driver=False, logging_level="ERROR")
    except ConnectionError as exc:
        raise OSError(
            f"no Ray cluster at {address!r} ({exc}): start one with `ray start --head`, or name "
            "it with --address or RAY_ADDRESS"
        ) from None
    return ray


def _on_ray(address: str | None, verb: Callable[[Any], int]) -> int:
    """Run ``verb`` on the Ray cluster at ``address`` (joined, then left), or say why not."""
    try:
        ray = _join(address)
    except OSError as exc:
        print(f"hetd: {exc}", file=sys.stderr)
        return EXIT_UNREACHABLE
    try:
        return verb(ray)
    finally:
        ray.shutdown()


def _up(args: argparse.Namespace) -> int:
    from hetd.server import pserver_ray as pr

    raw = head_config(Path(args.config), args.pservers)
    state = Path(raw["store"]["dir"])
    state.mkdir(parents=True, exist_ok=True)
    effective = state / "cluster.toml"
    effective.write_text(toml_text(raw))

    def up(ray: Any) -> int:
        if pr.group(ray) is not None:
            print("hetd: a hetd cluster is up already: hetd cluster down first", file=sys.stderr)
            return EXIT_USAGE
        pg = pr.place(ray, 1 + args.pservers, args.strategy, args.timeout)
        strategies = ray.util.scheduling_strategies
        env = {k: os.environ[k] for k in TOKENS if k in os.environ}
        env["RAY_ADDRESS"] = ray.get_runtime_context().gcs_address
        head = (
            pr.remote_actor(ray)
            .options(
                name=pr.HEAD,
                namespace=pr.NAMESPACE,
                lifetime="detached",
                max_restarts=HEAD_RESTARTS,
                num_cpus=1,
                scheduling_strategy=strategies.PlacementGroupSchedulingStrategy(
                    placement_group=pg, placement_group_bundle_index=0
                ),
            )
            .remote(
                [sys.executable, "-m", "hetd", "serve", "--config", str(effective)],
                str(state / "head.log"),
                "",
                env,
                os.getpriority(os.PRIO_PROCESS, 0),  # this command's, not Ray's workers'
            )
        )
        info = ray.get(head.info.remote(), timeout=args.timeout)
        server = raw.get("server", {})
        print(
            f"hetd-head up (pid {info['child']}, its log {state / 'head.log'}): workers connect "
            f"to ws://{server.get('host', '127.0.0.1')}:{server.get('port', 7070)}; "
            f"{args.pservers} pservers start as {pr.pserver_name(0)}.. "
            "(hetd cluster status)"
        )
        return 0

    return _on_ray(args.address, up)


def rows(ray: Any) -> list[dict[str, Any]]:
    """The head's and the pservers' actors in the group ``hetd`` and how each stands."""
    from hetd.server import pserver_ray as pr

    pg = pr.group(ray)
    if pg is None:
        return []
    names = [pr.HEAD] + [pr.pserver_name(s) for s in range(len(pg.bundle_specs) - 1)]
    out = []
    for name in names:
        row: dict[str, Any] = {"actor": name}
        try:
            actor = ray.get_actor(name, namespace=pr.NAMESPACE)
        except ValueError:
            out.append(dict(row, state="absent"))
            continue
        try:
            info = ray.get(actor.info.remote(), timeout=10.0)
        except Exception as exc:  # restarting, or dead for good
            out.append(dict(row, state="unreachable", reason=type(exc).__name__))
            continue
        state = "running" if info["status"] is None else f"exited {info['status']}"
        out.append(dict(row, state=state, pid=info["child"], node=info["node"]))
    return out


def _status(args: argparse.Namespace) -> int:
    found: list[dict[str, Any]] = []

    def read(ray: Any) -> int:
        found.extend(rows(ray))
        return 0

    if (unreachable := _on_ray(args.address, read)) != 0:
        return unreachable
    if args.json:
        print(json.dumps({"actors": found}))
    elif not found:
        print("no hetd cluster is up")
    for row in found if not args.json else []:
        where = f"pid {row['pid']} on node {row['node'][:12]}" if "pid" in row else ""
        print(f"{row['actor']:<18} {row['state']:<12} {where}".rstrip())
    return 0 if found else 1


def _down(args: argparse.Namespace) -> int:
    from hetd.server import pserver_ray as pr

    def down(ray: Any) -> int:
        pg = pr.group(ray)
        if pg is None:
            print("no hetd cluster is up")
            return 0
        servers = len(pg.bundle_specs) - 1
        began = time.monotonic()
        try:  # the head drains, saves its final checkpoint and stops its pservers
            head = ray.get_actor(pr.HEAD, namespace=pr.NAMESPACE)
            status = ray.get(head.stop.remote(args.timeout), timeout=args.timeout + 10.0)
            print(f"hetd-head stopped (status {status}) in {time.monotonic() - began:.1f} s")
        except Exception as exc:
            print(f"hetd: the head did not stop cleanly: {exc}", file=sys.stderr)
        for name in [pr.HEAD] + [pr.pserver_name(s) for s in range(servers)]:
            with contextlib.suppress(ValueError):  # gone already (the head stopped its pservers)
                ray.kill(ray.get_actor(name, namespace=pr.NAMESPACE), no_restart=True)
        ray.util.remove_placement_group(pg)
        print("the placement group hetd is removed")
        return 0

    return _on_ray(args.address, down)
