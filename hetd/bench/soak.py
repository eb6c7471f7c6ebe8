"""``hetd bench --suite soak``: many light workers against one real daemon for minutes; does the
daemon's memory stay flat, and does anything go wrong that no fault caused?

Owns :func:`run_soak`. It starts ``hetd serve`` as a subprocess (digits, a small MLP, asp, the
admin API on loopback) and ``--workers`` no-compute workers (the system benchmark's protocol-v1
peers, :mod:`hetd.bench.system_peers`: hello, then one push of a ready-made update for every
``params`` frame, as fast as the daemon answers), each in a process of its own without JAX, so
64 of them fit beside the daemon on a small machine (a real ``hetd-worker`` is 350–550 MB).
Every ``--sample-s`` it reads the daemon's resident memory (``/proc/PID/status``) and its
counters (``/v1/status``). It writes ``soak.json`` and ``soak.md``: RSS over time, its growth
after the first minute (the warm-up: caches, compiled steps, pools), updates per second, and the
errors: peers that ended with one, pushes not applied, workers the daemon lost.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hetd.bench.system_limit import free_port
from hetd.bench.system_peers import Job, PeerPool, Report, Shapes
from hetd.local.procs import spawn_daemon, stop_processes, wait_ready, worker_env

WARMUP_S = 60.0  # growth is measured from the first sample at or after this


@dataclass(frozen=True)
class SoakOptions:
    """What ``hetd bench --suite soak`` takes."""

    out: Path
    workers: int = 64
    minutes: float = 10.0
    sample_s: float = 10.0
    hidden: int = 32  # the MLP's hidden width on digits


def rss_bytes(pid: int) -> int:
    """Resident memory of a process (Linux ``/proc``)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise OSError(f"no VmRSS for process {pid}")


def _get(url: str, token: str) -> Any:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"})
    with urllib.request.urlopen(req, timeout=5.0) as reply:
        return json.loads(reply.read())


def _shapes(hidden: int) -> Shapes:
    import jax  # the parent only: peers import no JAX

    from hetd.zoo.data import load_dataset
    from hetd.zoo.models import get_model

    data = load_dataset("digits", seed=0)
    model = get_model("mlp", data.num_classes, hidden=[hidden])
    tree = jax.eval_shape(lambda k: model.init(k, data.input_shape), jax.random.PRNGKey(0))
    return tuple((path, tuple(v.shape)) for path, v in sorted(tree.items()))


def growth(samples: list[dict[str, Any]], warmup_s: float = WARMUP_S) -> float | None:
    """RSS growth as a fraction, from the first sample at or after ``warmup_s`` to the largest
    later one; None when the run is too short to have both."""
    after = [s for s in samples if s["t_s"] >= warmup_s]
    if len(after) < 2:
        return None
    base = float(after[0]["rss_bytes"])
    return float(max(s["rss_bytes"] for s in after)) / base - 1.0


async def run_soak(opts: SoakOptions) -> dict[str, Any]:
    """Run the soak; returns the document also written to ``opts.out``."""
    port, admin_port = free_port(), free_port()
    worker_token, admin_token = secrets.token_hex(16), secrets.token_hex(16)
    config = (
        '[server]\nhost = "127.0.0.1"\n'
        f"port = {port}\nadmin_port = {admin_port}\nheartbeat_timeout_s = 30.0\n"
        f'[train]\ndataset = "digits"\nmodel = "mlp"\nmodel_kwargs = {{ hidden = [{opts.hidden}] }}\n'
        "eval_interval_s = 5.0\nprofile_steps = 0\n"
        '[policy]\nname = "asp"\nparams = {}\n'
    )
    shapes = _shapes(opts.hidden)
    env = worker_env(worker_token, admin_token)
    admin = f"http://127.0.0.1:{admin_port}"
    samples: list[dict[str, Any]] = []
    reports: list[Report] = []
    pool = PeerPool(opts.workers)
    with tempfile.TemporaryDirectory(prefix="hetd-soak-") as tmp:
        cfg = Path(tmp) / "hetd.toml"
        cfg.write_text(config)
        daemon = await spawn_daemon("--config", str(cfg), env=env)

        async def answers() -> bool:
            with contextlib.suppress(OSError, ValueError):
                await asyncio.to_thread(_get, f"{admin}/v1/status", admin_token)
                return True
            return False

        try:
            await wait_ready(answers, daemon, timeout=60.0, interval=0.1)  # up to 60 s to listen
            jobs = [
                Job(
                    "hetd",
                    f"ws://127.0.0.1:{port}/v1/ws",
                    shapes=shapes,
                    token=worker_token,
                    seed=i,
                )
                for i in range(opts.workers)
            ]
            await pool.start(jobs, timeout=120.0)
            t0 = time.monotonic()
            end = t0 + opts.minutes * 60.0
            while True:
                status = await asyncio.to_thread(_get, f"{admin}/v1/status", admin_token)
                samples.append(
                    {
                        "t_s": round(time.monotonic() - t0, 2),
                        "rss_bytes": rss_bytes(daemon.pid),
                        "version": status["version"],
                        "workers": status["workers"],
                    }
                )
                if time.monotonic() >= end:
                    break
                await asyncio.sleep(min(opts.sample_s, max(0.0, end - time.monotonic())))
            reports = await pool.stop(opts.workers, timeout=120.0)
        finally:
            pool.close()
            with contextlib.suppress(Exception):
                await stop_processes([daemon])
    doc = _summary(opts, samples, reports)
    opts.out.mkdir(parents=True, exist_ok=True)
    (opts.out / "soak.json").write_text(json.dumps(doc, indent=1) + "\n")
    (opts.out / "soak.md").write_text(markdown(doc))
    return doc


def _summary(
    opts: SoakOptions, samples: list[dict[str, Any]], reports: list[Report]
) -> dict[str, Any]:
    pushes = sum(r.pushes for r in reports)
    applied = sum(r.applied for r in reports)
    span = samples[-1]["t_s"] - samples[0]["t_s"] if len(samples) > 1 else 0.0
    updates = samples[-1]["version"] - samples[0]["version"] if samples else 0
    return {
        "workers": opts.workers,
        "minutes": opts.minutes,
        "samples": samples,
        "rss_first_mb": samples[0]["rss_bytes"] / 1e6 if samples else None,
        "rss_last_mb": samples[-1]["rss_bytes"] / 1e6 if samples else None,
        "rss_growth_after_warmup": growth(samples),
        "updates_per_s": updates / span if span > 0 else None,
        "pushes": pushes,
        "applied": applied,
        "errors": {
            "peers_with_error": [r.error for r in reports if r.error],
            "pushes_not_applied": pushes - applied,
            "workers_lost": opts.workers - min((s["workers"] for s in samples), default=0),
        },
    }


def markdown(doc: dict[str, Any]) -> str:
    """``soak.md``: the figures a person reads."""
    g = doc["rss_growth_after_warmup"]
    errors = doc["errors"]
    ups = doc["updates_per_s"]
    lines = [
        f"# hetd bench soak: {doc['workers']} workers, {doc['minutes']:g} min",
        "",
        "| measure | value |",
        "|---|---|",
        f"| daemon RSS first / last | {doc['rss_first_mb']:.0f} / {doc['rss_last_mb']:.0f} MB |",
        "| RSS growth after the first minute | "
        + ("run too short" if g is None else f"{100 * g:.1f} %")
        + " |",
        "| updates/s | " + ("–" if ups is None else f"{ups:.0f}") + " |",
        f"| pushes / applied | {doc['pushes']} / {doc['applied']} |",
        f"| peers that ended with an error | {len(errors['peers_with_error'])} |",
        f"| pushes not applied | {errors['pushes_not_applied']} |",
        f"| workers lost | {errors['workers_lost']} |",
        "",
    ]
    return "\n".join(lines)
