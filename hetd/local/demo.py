"""``hetd demo``: a daemon and local workers of different speeds, a progress bar, a result.

Everything a user needs to see hetd work, with no config and no network: the data set ships inside
a package, the workers are real ``hetd-worker`` processes on loopback, slowed by emulation.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import math
import secrets
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tqdm import tqdm

from hetd import config as config_mod
from hetd.core.evals import metrics_of
from hetd.local.procs import spawn_worker, stop_processes, worker_env
from hetd.server.daemon import Daemon
from workers.imports import operator_flags


@dataclass(frozen=True)
class DemoOptions:
    """What ``hetd demo`` takes; the defaults are the embedded demo."""

    policy: str = "auto"
    policy_params: tuple[tuple[str, Any], ...] = ()
    slowdowns: tuple[float, ...] = (1.0, 1.0, 2.0, 4.0)
    dataset: str = "mnist5k"
    model: str = "mlp"
    hidden: int = 256
    lr: float = 0.2
    base_step_s: float = 0.01  # emulated seconds per step of the fastest worker
    target: float = 0.92  # test accuracy; a language model's (target_loss > 0) is its loss
    budget_s: float = 150.0
    out: str | None = None
    quiet: bool = False
    model_kwargs: tuple[tuple[str, Any], ...] = ()  # besides mlp's hidden
    dataset_kwargs: tuple[tuple[str, Any], ...] = ()
    optimizer: str = "sgd"  # the daemon's, as [train] optimizer
    batch_size: int = 32  # each worker's (the global batch is this x the workers)
    target_loss: float = 0.0  # > 0: stop at this test loss instead of an accuracy
    prompt: str = ""  # a language model writes after this at the end (empty: no samples)
    sample_bytes: int = 160  # bytes written per sample
    temperatures: tuple[float, ...] = (0.6, 0.9)  # one sample each; 0: greedy
    task: str = ""  # a user's hetd.Task (pkg.module:attr or file.py:attr): its target stops the run


TRANSFORMER = DemoOptions(
    dataset="pydoc",
    dataset_kwargs=(("context", 64),),
    model="transformer",
    model_kwargs=(("size", "0.5m"),),
    optimizer="adam",
    batch_size=16,
    lr=0.003,
    base_step_s=0.02,
    target_loss=2.7,
    prompt="The ",
)
"""``hetd demo --model transformer``: the 0.5M byte-level LM on the standard library's docs
(``pydoc``), to a test loss of 2.7 nats per byte (3.9 bits), then text written from a prompt,
sampled: greedy decoding of a barely trained byte model repeats the commonest byte, a space."""


def reached_target(opts: DemoOptions, loss: float | None, acc: float | None) -> bool:
    """Whether one evaluation meets the demo's target (a loss, or an accuracy)."""
    if opts.target_loss > 0:
        return loss is not None and loss <= opts.target_loss
    return acc is not None and acc >= opts.target


TAIL_LINES = 20


async def _drain(proc: asyncio.subprocess.Process, tail: deque[str]) -> None:
    if proc.stderr is None:
        return
    async for line in proc.stderr:
        tail.append(line.decode(errors="replace").rstrip())


def _record_versions(engine: Any, out: list[tuple[int, float]]) -> None:
    """Wrap the engine's evaluator so each evaluation's version is known: ``engine.evaluations.evals`` keeps
    (time, loss, accuracy) only, and the demo reports which version met the target."""
    evaluate = engine.evaluations.evaluator
    if evaluate is None:
        return

    def recording(snap: Any) -> tuple[float, float]:
        result: tuple[float, float] = evaluate(snap)  # an Evaluation keeps its metrics
        out.append((int(snap.version), result[1]))
        return result

    engine.evaluations.evaluator = recording


def waiting_for(status: dict[str, Any] | None, spawned: int, alive: int) -> str:
    """What the demo is waiting for, in words, for the progress bar."""
    if status is None:
        return "daemon loading the model and data"
    joined = int(status["workers"])
    if not status["updates_applied"]:
        if joined < spawned:
            return f"workers starting ({joined}/{spawned} joined, {alive} running)"
        return (
            f"workers compiling their step ({joined}/{spawned} joined), waiting for the first push"
        )
    if status["accuracy"] is None and not status.get("metrics"):
        return f"training, waiting for the first evaluation ({joined} workers)"
    return f"training ({joined} workers)"


async def run_demo(opts: DemoOptions) -> dict[str, Any]:
    """Run the demo; returns the summary (also written to ``opts.out``).

    The daemon listens first and builds its model while the workers start (they compile at the
    same time). The run stops at the first evaluation that meets ``opts.target``; that evaluation
    is reported as ``stop_accuracy``. Pushes already in flight are applied while the workers stop,
    so the final model is evaluated again and reported apart, as ``final_accuracy``.
    """
    token = secrets.token_hex(16)
    cfg = config_mod.Config()
    cfg = config_mod.replace(
        cfg, "server", port=0, admin_port=0, worker_token=token, admin_token=secrets.token_hex(16)
    )
    cfg = config_mod.replace(
        cfg,
        "train",
        dataset=opts.dataset,
        model=opts.model,
        model_kwargs=({"hidden": [opts.hidden]} if opts.model == "mlp" else {})
        | dict(opts.model_kwargs),
        dataset_kwargs=dict(opts.dataset_kwargs),
        optimizer=opts.optimizer,
        batch_size=opts.batch_size,
        global_batch=opts.batch_size * len(opts.slowdowns),
        lr=opts.lr,
        eval_interval_s=0.5,
        target_accuracy=opts.target if opts.target_loss <= 0 and not opts.task else 0.0,
        task=opts.task,
    )
    cfg = config_mod.replace(cfg, "policy", name=opts.policy, params=dict(opts.policy_params))
    daemon = Daemon(cfg)
    launched = time.monotonic()
    port = await daemon.listen()
    url = f"ws://127.0.0.1:{port}"
    # this command named the model and data set: its workers may build them (workers.imports)
    task_args = (
        ("--task", opts.task) if opts.task else operator_flags(opts.model, cfg.train.dataset)
    )
    procs = [
        await spawn_worker(
            url,
            "--name",
            f"demo-{i}-x{s:g}",
            "--emulate-slowdown",
            str(s),
            "--emulate-base-step",
            str(opts.base_step_s),
            *task_args,
            env=worker_env(token),
            stderr=asyncio.subprocess.PIPE,
        )
        for i, s in enumerate(opts.slowdowns)
    ]
    building = asyncio.create_task(daemon.build(), name="hetd-demo-build")
    # Each worker's stderr is drained as it runs (a full pipe would block it) and its last lines
    # kept, so a worker that dies can say why.
    tails: list[deque[str]] = [deque(maxlen=TAIL_LINES) for _ in procs]
    drains = [asyncio.create_task(_drain(p, t)) for p, t in zip(procs, tails, strict=True)]
    # The run's clock (budget, time to target, elapsed) starts when the daemon is ready, as the
    # workers can train from then on; the daemon's own build time is reported apart.
    t0: float | None = None
    evaluated: list[tuple[int, float]] = []  # (version, accuracy) of each evaluation
    first_push: float | None = None
    reached: float | None = None
    stop_acc: float | None = None
    stop_loss: float | None = None
    stop_version: int | None = None
    stop_metrics: dict[str, Any] | None = None
    bar = tqdm(total=100, disable=opts.quiet, unit="%", bar_format="{l_bar}{bar}| {postfix}")
    finished = False  # False on the way out with an error: the daemon is stopped here then
    try:
        while t0 is None or time.monotonic() - t0 < opts.budget_s:
            await asyncio.sleep(0.5)
            if building.done():
                building.result()  # a failed build raises here
            status = daemon.engine.status() if daemon.ready else None
            if status is not None and t0 is None:
                t0 = time.monotonic()
                _record_versions(daemon.engine, evaluated)
            alive = sum(p.returncode is None for p in procs)
            waiting = waiting_for(status, len(procs), alive)
            acc = (status or {}).get("accuracy") or 0.0
            loss = (status or {}).get("loss")
            if status is not None and first_push is None and status["updates_applied"]:
                first_push = time.monotonic()
            bar.n = round(100 * _progress(opts, loss, acc, status), 1)
            version = status["version"] if status is not None else 0
            bar.set_postfix_str(
                f"{_metric_text(opts, loss, acc, status)} v{version}, {waiting}, "
                f"t {time.monotonic() - launched:.0f}s"
            )
            task_target = (status or {}).get("target") if opts.task else None
            if opts.task and status is not None and reached is None:
                if task_target and task_target["reached_at_s"] is not None:
                    reached = time.monotonic() - (t0 or launched)
                    stop_metrics = dict(status["metrics"])
                    stop_version = int(status["version"])
                    break
            elif (
                status is not None
                and reached is None
                and status["accuracy"] is not None
                and reached_target(opts, loss, acc)
            ):
                reached = time.monotonic() - (t0 or launched)
                stop_acc = acc
                stop_loss = loss
                # the version that evaluation saw (the store has moved on since)
                seen = [v for v, a in evaluated if a == acc]
                stop_version = seen[-1] if seen else int(status["version"])
                break
            if alive == 0:
                await asyncio.gather(*drains, return_exceptions=True)  # their last words
                said = "\n".join(
                    f"--- worker {i} (exit {p.returncode}):\n" + "\n".join(t)
                    for i, (p, t) in enumerate(zip(procs, tails, strict=True))
                )
                raise RuntimeError(f"every worker process exited:\n{said}")
        await building  # within the budget or not, the engine must exist for the summary
        finished = True
    finally:
        bar.close()
        workers = daemon.engine.workers() if daemon.ready else []  # before they leave
        await stop_processes(procs)
        for task in drains:
            task.cancel()
        if not building.done():
            building.cancel()
            with contextlib.suppress(BaseException):
                await building
        elapsed = time.monotonic() - (t0 or launched)
        build_s = (t0 or time.monotonic()) - launched
        if not daemon.ready or not finished:  # no summary to make: close its ports now
            await daemon.stop()
    engine = daemon.engine
    evaluate = engine.evaluations.evaluator
    assert evaluate is not None  # build_engine always sets one
    final = engine.store.snapshot()
    result = await asyncio.to_thread(evaluate, final)
    final_loss, final_acc = result
    final_metrics = metrics_of(result)
    await daemon.stop()
    samples = await asyncio.to_thread(write_samples, opts, dict(final.tensors))
    pushes = sum(w["pushes"] for w in workers)
    train_s = time.monotonic() - (first_push or t0 or launched)
    target = engine.evaluations.target
    summary = {
        "policy": engine.host.policy.describe(),
        "dataset": opts.dataset if not opts.task else None,
        # a user's Task: its name, its target and the metrics of the stop and the final model
        "task": opts.task or None,
        "task_target": None
        if target is None
        else {"metric": target.metric, "mode": target.mode, "value": target.value},
        "stop_metrics": stop_metrics,
        "final_metrics": final_metrics,
        "metric_curve": [[t, m] for t, m in engine.evaluations.history],
        "target_accuracy": opts.target if opts.target_loss <= 0 else None,
        "target_loss": opts.target_loss if opts.target_loss > 0 else None,
        "stop_loss": stop_loss,
        # the evaluation that met the target (the stop rule), and when
        "stop_accuracy": stop_acc,
        "stop_version": stop_version,
        "time_to_target_s": reached,
        # the model after the workers stopped (pushes in flight applied), evaluated again
        "final_accuracy": final_acc,
        "final_loss": final_loss,
        "final_version": engine.store.version,
        "elapsed_s": elapsed,  # from the daemon being ready, like the two above
        "daemon_build_s": build_s,  # launch to ready: imports, data, model, resume
        "first_update_s": None if first_push is None else first_push - (t0 or launched),
        "updates_applied": engine.applier.updates_applied,
        "version": engine.store.version,
        "pushes": pushes,
        "pushes_per_s": pushes / max(1e-9, min(train_s, elapsed)),
        "workers": [
            {k: w[k] for k in ("worker", "name", "samples", "pushes", "clock", "idle_fraction")}
            for w in workers
        ],
        "curve": [[t, acc] for t, _, acc in engine.evaluations.evals],
        "loss_curve": [[t, loss] for t, loss, _ in engine.evaluations.evals],
        "samples": samples,
    }
    if opts.out:
        write_outputs(Path(opts.out), summary)
    return summary


def _task_value(status: dict[str, Any] | None) -> tuple[dict[str, Any], float | None] | None:
    """A task's target and its metric's last value (None: no task target)."""
    target = (status or {}).get("target")
    if not target:
        return None
    assert status is not None
    return target, (status.get("metrics") or {}).get(target["metric"])


def _progress(
    opts: DemoOptions, loss: float | None, acc: float, status: dict[str, Any] | None = None
) -> float:
    """The progress bar's fraction: accuracy, or how far the loss came from a uniform guess's;
    for a task, its metric against the target (a ratio: a guide, not a promise)."""
    if opts.task:
        found = _task_value(status)
        if found is None:
            return 0.0
        target, value = found
        if value is None:
            return 0.0
        if target["mode"] == "max":
            return min(1.0, max(0.0, value / target["value"])) if target["value"] > 0 else 0.0
        return min(1.0, max(0.0, target["value"] / value)) if value > 0 else 1.0
    if opts.target_loss <= 0:
        return acc
    if loss is None:
        return 0.0
    start = math.log(256)  # a byte-level model's loss before it learns anything
    return min(1.0, max(0.0, (start - loss) / max(1e-9, start - opts.target_loss)))


def _metric_text(
    opts: DemoOptions, loss: float | None, acc: float, status: dict[str, Any] | None = None
) -> str:
    if opts.task:
        found = _task_value(status)
        if found is None:
            return "no target"
        target, value = found
        sign = ">=" if target["mode"] == "max" else "<="
        shown = "-" if value is None else f"{value:.4g}"
        return f"{target['metric']} {shown} (target {sign} {target['value']:g})"
    if opts.target_loss <= 0:
        return f"acc {acc:.3f} (target {opts.target})"
    shown = "-" if loss is None else f"{loss:.3f}"
    return f"loss {shown} (target {opts.target_loss})"


def write_samples(opts: DemoOptions, params: dict[str, Any]) -> list[dict[str, Any]]:
    """Text the trained language model writes after ``opts.prompt``, once per temperature
    (none when the prompt is empty or the model is not a language model)."""
    if not opts.prompt or opts.model != "transformer":
        return []
    from hetd.zoo.lm import generate
    from hetd.zoo.models import get_model
    from hetd.zoo.text import VOCAB

    model = get_model(opts.model, VOCAB, **dict(opts.model_kwargs))
    context = int(params["pos"].shape[0])  # the position table is as long as the training windows
    prompt = opts.prompt.encode()
    return [
        {
            "temperature": temp,
            "prompt": opts.prompt,
            "text": generate(
                model.logits, params, prompt, context, opts.sample_bytes, temp, i
            ).decode("utf-8", errors="replace"),
        }
        for i, temp in enumerate(opts.temperatures)
    ]


def _task_result_text(summary: dict[str, Any]) -> str:
    target = summary["task_target"]
    metric = target["metric"] if target else "loss"
    metrics = summary["final_metrics"]
    final = (
        f"final model: {', '.join(f'{k} {v:.4g}' for k, v in metrics.items())} at version "
        f"{summary['final_version']} (evaluated after the workers stopped)"
    )
    if target is None:
        stop = f"task {summary['task']} has no target; ran {summary['elapsed_s']:.1f}s"
    elif summary["time_to_target_s"] is None:
        stop = f"target {metric} {target['value']:g} not reached in {summary['elapsed_s']:.1f}s"
    else:
        value = (summary["stop_metrics"] or {}).get(metric)
        stop = (
            f"target {metric} {'>=' if target['mode'] == 'max' else '<='} {target['value']:g} "
            f"reached at {summary['time_to_target_s']:.1f}s: {metric} {value:.4g} at version "
            f"{summary['stop_version']} (the evaluation that stopped the run)"
        )
    return f"{stop}\n{final}\n({summary['updates_applied']} updates, {summary['pushes_per_s']:.0f} pushes/s)"


def result_text(summary: dict[str, Any]) -> str:
    """What ``hetd demo`` prints at the end: the stop and the final evaluation, each labelled."""
    if summary.get("task"):
        return _task_result_text(summary)
    lm = summary.get("target_loss") is not None
    target = summary["target_loss"] if lm else summary["target_accuracy"]
    what = "test loss" if lm else "test accuracy"
    final_value = summary["final_loss"] if lm else summary["final_accuracy"]
    final = (
        f"final model: {what} {final_value:.4f} at version "
        f"{summary['final_version']} (evaluated after the workers stopped; pushes in flight "
        "were applied)"
    )
    if summary["time_to_target_s"] is None:
        stop = f"target {target} not reached in {summary['elapsed_s']:.1f}s"
    else:
        stop = (
            f"target {target} reached at {summary['time_to_target_s']:.1f}s: {what} "
            f"{summary['stop_loss' if lm else 'stop_accuracy']:.4f} at version {summary['stop_version']} (the evaluation "
            "that stopped the run)"
        )
    first = summary.get("first_update_s")
    rate = f"{summary['updates_applied']} updates, {summary['pushes_per_s']:.0f} pushes/s" + (
        f", first update at {first:.1f}s" if first is not None else ""
    )
    clock = (
        f"times count from the daemon being ready, {summary['daemon_build_s']:.1f}s after "
        "launch; the workers started meanwhile"
    )
    text = f"{stop}\n{final}\n({rate}; {clock})"
    for sample in summary.get("samples", []):
        how = "greedy" if sample["temperature"] == 0 else f"temperature {sample['temperature']:g}"
        text += f"\n--- the model writes after {sample['prompt']!r} ({how}):\n"
        text += sample["prompt"] + sample["text"]
    return text


def write_outputs(out: Path, summary: dict[str, Any]) -> None:
    """``summary.json`` and ``accuracy.png`` in ``out``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    fig, ax = plt.subplots(figsize=(6, 4))
    if summary.get("task"):
        target = summary["task_target"] or {"metric": "loss", "value": None}
        metric = target["metric"]
        points = [(t, m[metric]) for t, m in summary["metric_curve"] if metric in m]
        ax.plot([p[0] for p in points], [p[1] for p in points], label=summary["policy"]["name"])
        if target["value"] is not None:
            ax.axhline(target["value"], color="grey", ls="--", lw=0.8, label="target")
        ax.set_xlabel("time (s)")
        ax.set_ylabel(metric)
        ax.set_title(f"hetd demo: {summary['task']}, {len(summary['workers'])} workers")
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / "accuracy.png", dpi=100)
        plt.close(fig)
        return
    lm = summary.get("target_loss") is not None
    curve = summary["loss_curve" if lm else "curve"]
    ax.plot([c[0] for c in curve], [c[1] for c in curve], label=summary["policy"]["name"])
    target = summary["target_loss" if lm else "target_accuracy"]
    ax.axhline(target, color="grey", ls="--", lw=0.8, label="target")
    ax.set_xlabel("time (s)")
    ax.set_ylabel("test loss (nats per byte)" if lm else "test accuracy")
    ax.set_title(f"hetd demo: {summary['dataset']}, {len(summary['workers'])} workers")
    if not lm:
        ax.set_ylim(0, 1)
    ax.legend(loc="upper right" if lm else "lower right")
    fig.tight_layout()
    fig.savefig(out / "accuracy.png", dpi=100)
    plt.close(fig)


def replace(opts: DemoOptions, **changes: Any) -> DemoOptions:
    """A copy with some options changed."""
    return dataclasses.replace(opts, **changes)
