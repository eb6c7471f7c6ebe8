"""``hetd calibrate``: measure, on this machine, each cost the simulator's cost profile charges.

Owns :class:`Target` (what is measured: a scenario's model, data, optimizers, batch and codec),
:func:`target_for`, :func:`calibrate` (the measurements, medians over repeats after a warm-up) and
:func:`describe` (a profile in lines for people). The ``hetd calibrate`` command is
:mod:`hetd.cli.calibrate`; the end-to-end terms that need real runs are
:mod:`hetd.bench.cluster_costs`, the two run in order by :mod:`hetd.bench.suites`. Every figure
comes from the code a real run executes: the daemon's engine as ``hetd serve`` builds it
(:func:`hetd.server.build.build_engine`) driven by its own command loop, its Store, Downlink,
round buffer and evaluator, the sessions' push decoding (:func:`hetd.core.ingest.decode_push`), the
worker's codecs with error feedback, :func:`hetd.protocol.params.apply_params` and its fixed-shape
compute (:class:`hetd.zoo.task_steps.TaskSteps`). The fields, their units and meaning are
:data:`hetd.sim.costs.FIELDS` (docs/benchmark.md, "The cost profile").

The numbers are timings on a shared machine: re-measure before trusting them elsewhere, and read
them as the costs of the model measured (per-parameter figures carry over to a model of another
size only roughly).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import datetime
import os
import platform
import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import jax
import numpy as np

from hetd import config as config_mod
from hetd.codecs import registry as codecs
from hetd.codecs.feedback import ErrorFeedback, encode_with_feedback
from hetd.core import commands as cmd
from hetd.core.downlink import Downlink
from hetd.core.engine import Engine
from hetd.core.ingest import decode_hello, decode_push
from hetd.core.store import Aggregator, Snapshot
from hetd.protocol import wire
from hetd.protocol.frames import as_params
from hetd.protocol.messages import Reply
from hetd.protocol.params import apply_params
from hetd.protocol.plan import Plan, codec_for
from hetd.server.build import build_engine
from hetd.server.sessions import OFF_LOOP_BYTES
from hetd.sim.costs import CostProfile
from hetd.sim.scenario import Scenario
from hetd.zoo.bundled import ZooTask
from hetd.zoo.data import load_dataset
from hetd.zoo.models import get_model
from hetd.zoo.optim import parse_optimizer
from hetd.zoo.task import Bound, Shard
from hetd.zoo.task_steps import BatchStream, TaskSteps

REPEATS = 15  # timed runs per figure (after WARM untimed ones); the figure is their median
WARM = 2
PAD_S = 0.005  # the emulated sleep a worker-step overhead is measured around


@dataclass(frozen=True)
class Target:
    """What to measure: the model and data, the optimizers, the batch and the codec of a run."""

    model: str = "mlp"
    dataset: str = "mnist5k"
    model_kwargs: Mapping[str, Any] = field(default_factory=dict)
    dataset_kwargs: Mapping[str, Any] = field(default_factory=dict)
    optimizer: str = "sgd"
    lr: float = 0.1
    inner_optimizer: str = ""
    worker_lr: float = 0.0
    outer_optimizer: str = "auto"
    batch_size: int = 32  # a worker's batch, and the profile request's
    micro_batch: int = 0  # 0: batch_size
    codec: str = "none"  # the run's codec (its profile exchange encodes with it)
    profile_steps: int = 3
    scenario: str = ""  # the scenario's name, if it came from one


def target_for(sc: Scenario) -> Target:
    """The :class:`Target` of a scenario (its model, data, optimizers, per-worker batch, codec)."""
    return Target(
        model=sc.model,
        dataset=sc.dataset,
        model_kwargs=dict(sc.model_kwargs),
        dataset_kwargs=dict(sc.dataset_kwargs),
        optimizer=sc.optimizer,
        lr=sc.lr,
        inner_optimizer=sc.inner_optimizer,
        worker_lr=sc.worker_lr,
        outer_optimizer=sc.outer_optimizer,
        batch_size=sc.batch_per_worker,
        micro_batch=sc.micro_batch,
        codec=sc.codec,
        profile_steps=config_mod.TrainConfig().profile_steps,
        scenario=sc.name,
    )


def _median(run: Callable[[], object], repeats: int) -> float:
    """Median seconds of ``run()`` over ``repeats`` calls after :data:`WARM` untimed ones."""
    times = []
    for i in range(WARM + repeats):
        started = time.perf_counter()
        run()
        took = time.perf_counter() - started
        if i >= WARM:
            times.append(took)
    return statistics.median(times)


def _config(t: Target) -> config_mod.Config:
    """The daemon's configuration for ``t``: ASP (every push applied and answered with
    parameters), no evaluations while it is timed."""
    cfg = config_mod.replace(
        config_mod.Config(),
        "train",
        model=t.model,
        model_kwargs=dict(t.model_kwargs),
        dataset=t.dataset,
        dataset_kwargs=dict(t.dataset_kwargs),
        optimizer=t.optimizer,
        lr=t.lr,
        inner_optimizer=t.inner_optimizer,
        worker_lr=t.worker_lr,
        outer_optimizer=t.outer_optimizer,
        micro_batch=t.micro_batch,
        batch_size=t.batch_size,
        codec=t.codec,
        eval_interval_s=3600.0,
        profile_steps=t.profile_steps,
    )
    return config_mod.replace(cfg, "policy", name="asp", params={})


def _push_frame(tensors: Mapping[str, Any], kind: str = "grad") -> bytes:
    """A worker's push frame around encoded ``tensors``."""
    return wire.encode(
        "push",
        1,
        base=0,
        kind=kind,
        tensors=dict(tensors),
        samples=32,
        steps=1,
        compute_s=0.01,
        loss=1.0,
        free_mem=1 << 30,
        sent_at=time.time(),
        idle_s=0.0,
    )


class _Peer:
    """A session's outbox as the engine sees it: replies encoded as the real one does; a
    ``params`` frame (or a close) sets :attr:`got`."""

    def __init__(self) -> None:
        self.got = asyncio.Event()

    def send(self, reply: Reply) -> None:
        reply.encode()

    def send_params(self, frame: bytes | memoryview, *, full: bool) -> None:
        self.got.set()

    def close(self, reason: str) -> None:
        self.got.set()


async def _message_s(engine: Engine, frame: bytes, repeats: int) -> float:
    """The engine's median time per push command under its own loop (:meth:`Engine.run`): the
    daemon's per-event latency, its publish (optimizer step, snapshot, frames) not included."""
    task = asyncio.create_task(engine.run())
    try:
        peer = _Peer()
        hello = wire.decode(
            wire.encode(
                "hello",
                1,
                name="calibrate",
                device={},
                codecs=codecs.names(),
                features=list(wire.WORKER_FEATURES),  # as a real worker: frames with the hash
            )
        )
        wid = await engine.queue.call(lambda: engine.join(decode_hello(hello), peer))
        push = decode_push(engine.store.shapes, wid, wire.decode(frame), len(frame), fused=True)
        for i in range(WARM + repeats):
            if i == WARM:
                engine.meters.latency.reset()
            peer.got.clear()
            # a new request id (the engine answers each once), from the version it holds
            current = dataclasses.replace(push, id=i + 1, base=engine.store.version)

            engine.queue.submit(cmd.Push(current))
            await asyncio.wait_for(peer.got.wait(), 60.0)
        p50 = engine.meters.latency.summary()["p50_ms"]
        assert p50 is not None  # repeats >= 1 pushes were timed
        return float(p50) / 1e3
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def _worker_step_s(repeats: int) -> float:
    """A worker's fixed time per step besides compute and codecs: the thread hop of its step,
    the emulated sleep's overshoot and the thread hop that applies its next parameters."""

    def nothing() -> None:
        return None

    times = []
    for i in range(WARM + repeats):
        started = time.perf_counter()
        await asyncio.to_thread(nothing)
        await asyncio.sleep(PAD_S)
        await asyncio.to_thread(nothing)
        if i >= WARM:
            times.append(time.perf_counter() - started - PAD_S)
    return max(0.0, statistics.median(times))


def calibrate(
    target: Target, repeats: int = REPEATS, progress: Callable[[str], None] | None = None
) -> CostProfile:
    """Measure every cost of :data:`hetd.sim.costs.FIELDS` for ``target`` on this machine."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    say = progress or (lambda _: None)
    started = time.monotonic()
    say(f"building the daemon's engine for {target.model} on {target.dataset}")
    engine = build_engine(_config(target))
    store = engine.store
    store.warm(int8=True)
    shapes = dict(store.shapes)
    n = store.n_params
    rng = np.random.default_rng(0)
    params = {k: np.array(v) for k, v in store.snapshot().tensors.items()}
    grad = {k: (rng.standard_normal(s) * 0.01).astype(np.float32) for k, s in shapes.items()}
    names = codecs.names()

    say(f"pushes: decode on the daemon, encode on the worker ({len(names)} codecs)")
    push_decode: dict[str, float] = {}
    worker_encode: dict[str, float] = {}
    frames: dict[str, bytes] = {}
    for name in names:
        codec = codecs.get_codec(name)
        frames[name] = frame = _push_frame(codecs.encode_tree(grad, codec, rng))

        def decode(frame: bytes = frame) -> object:
            return decode_push(shapes, 1, wire.decode(frame), len(frame), fused=True)

        push_decode[name] = _median(decode, repeats) / n
        feedback = ErrorFeedback()

        def encode(codec: codecs.Codec = codec, feedback: ErrorFeedback = feedback) -> object:
            return _push_frame(encode_with_feedback(feedback, grad, codec, rng))

        worker_encode[name] = _median(encode, repeats) / n

    say("the daemon's optimizer steps and round buffer")
    int8 = decode_push(shapes, 1, wire.decode(frames["int8"]), len(frames["int8"]), fused=True)
    small = {k: v * np.float32(1e-6) for k, v in grad.items()}
    apply_s: dict[str, float] = {}
    for key, kind, tensors in (
        ("grad", "grad", grad),
        ("delta", "delta", small),
        ("grad:int8", "grad", int8.tensors),
        ("delta:int8", "delta", int8.tensors),
    ):

        def step(kind: str = kind, tensors: Mapping[str, Any] = tensors) -> object:
            store.apply(kind, tensors, 1e-6)
            return store.snapshot()  # runs the queued step and takes the version, as a publish

        apply_s[key] = _median(step, repeats)

    def buffer_four() -> object:
        agg = Aggregator()
        for _ in range(4):
            agg.add("grad", grad, 0.25)
        return agg

    buffer = _median(buffer_four, repeats) / 4 / n

    say("parameter frames: encoded on the daemon, decoded on the worker")
    publish: dict[str, float] = {}
    worker_decode: dict[str, float] = {}
    variants: list[Mapping[str, np.ndarray]] = []
    for j in range(3):
        v = {
            k: (p + np.float32(1e-3 * (j + 1)) * grad[k]).astype(np.float32)
            for k, p in params.items()
        }
        for arr in v.values():
            arr.flags.writeable = False
        variants.append(v)
    for name in names:
        publish[name], worker_decode[name] = _params_frames(name, variants, repeats)
        publish[name] /= n
        worker_decode[name] /= n

    say("an evaluation of the global model")
    evaluator = engine.evaluations.evaluator
    assert evaluator is not None  # build_engine sets one
    snap = store.snapshot()
    eval_s = _median(lambda: evaluator(snap), repeats)

    say(f"a joining worker's profile exchange ({target.profile_steps} steps)")
    profile_s = _profile_s(target, params, repeats)

    say("the engine's time per push under its own loop")
    message_s = asyncio.run(_message_s(engine, frames["none"], repeats))
    worker_step_s = asyncio.run(_worker_step_s(repeats))

    about = {
        "scenario": target.scenario or None,
        "model": target.model,
        "model_kwargs": dict(target.model_kwargs),
        "dataset": target.dataset,
        "dataset_kwargs": dict(target.dataset_kwargs),
        "n_params": n,
        "optimizer": target.optimizer,
        "outer_optimizer": target.outer_optimizer,
        "batch_size": target.batch_size,
        "codec": target.codec,
        "profile_steps": target.profile_steps,
        "repeats": repeats,
        "statistic": f"median of {repeats} after {WARM} untimed",
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "load_1m": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        "python": platform.python_version(),
        "jax": jax.__version__,
        "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "took_s": round(time.monotonic() - started, 1),
    }
    return CostProfile(
        message_s=message_s,
        push_decode_s_per_param=push_decode,
        apply_s=apply_s,
        buffer_s_per_param=buffer,
        publish_s_per_param=publish,
        worker_encode_s_per_param=worker_encode,
        worker_decode_s_per_param=worker_decode,
        worker_step_s=worker_step_s,
        eval_s=eval_s,
        profile_s=profile_s,
        off_loop_bytes=OFF_LOOP_BYTES,
        about=about,
    )


def _params_frames(
    name: str, variants: list[Mapping[str, np.ndarray]], repeats: int
) -> tuple[float, float]:
    """Seconds to encode one parameter frame in codec ``name`` on the daemon (the Downlink: a full
    frame for a lossless codec, else a delta against the worker's reference, each release from
    the version the last one brought) and to decode and apply it on a worker."""
    codec = codecs.get_codec(name)
    downlink = Downlink()
    first = downlink.frames(name, None, Snapshot(0, variants[0]))
    held = apply_params(None, as_params(wire.decode(first.frames[0])))
    assert held is not None  # a full frame
    version, ref = 0, first.ref
    sample: list[bytes] = []

    def encode() -> object:
        nonlocal version, ref
        version += 1
        snap = Snapshot(version, variants[version % len(variants)])
        out = downlink.frames(name, version - 1, snap, ref, None)
        ref = out.ref
        if not sample:
            sample.append(bytes(out.frames[0]))
        return out

    encode_s = _median(encode, repeats)
    # a full frame replaces what the worker holds; a delta (the first encoded) adds to the full
    # frame it holds
    start = None if codec.lossless else held

    def decode() -> object:
        return apply_params(start, as_params(wire.decode(sample[0])))

    return encode_s, _median(decode, repeats)


def _profile_s(target: Target, params: Mapping[str, np.ndarray], repeats: int) -> float:
    """What a joining worker's profile exchange takes (``workers.profiling.profile``): the
    requested steps really computed (a real worker reports them emulated but never sleeps
    them) and one encode of the update, with the worker's fixed-shape kernels warmed first."""
    if target.profile_steps <= 0:
        return 0.0
    data = load_dataset(target.dataset, seed=0, **dict(target.dataset_kwargs))
    model = get_model(target.model, data.num_classes, **dict(target.model_kwargs))
    _, inner, _ = config_mod.optimizers(
        target.optimizer,
        target.lr,
        target.inner_optimizer,
        target.worker_lr,
        target.outer_optimizer,
    )
    micro = target.micro_batch or target.batch_size
    # the worker's own kernels: the bundled model as a task (workers.loop.Core)
    bound = Bound(ZooTask(model, data, 0))
    steps = TaskSteps(bound, micro, parse_optimizer(inner).build(), jax.devices()[0])
    stream = BatchStream(bound, Shard(0, 1, 0, micro))
    key = jax.random.PRNGKey(0)
    steps.warm(dict(params), stream, key)
    codec = codec_for(Plan(codec=target.codec))

    def exchange() -> object:
        result = None
        for _ in range(target.profile_steps):
            result = steps.gradient(params, stream, target.batch_size, key)
        assert result is not None  # profile_steps >= 1
        return codecs.encode_tree(result.tensors, codec)

    return _median(exchange, repeats)


# --- for people ---------------------------------------------------------------------------------


def describe(profile: CostProfile) -> list[str]:
    """The profile in a few lines for people (per-parameter figures in ns)."""

    def ns(table: Mapping[str, float]) -> str:
        return ", ".join(f"{k} {v * 1e9:.2f}" for k, v in table.items())

    def ms(x: float | None) -> str:
        return "emulated" if x is None else f"{x * 1e3:.3f} ms"

    p = profile
    apply = ", ".join(f"{k} {v * 1e3:.3f}" for k, v in p.apply_s.items())
    return [
        f"message_s                  {ms(p.message_s)}",
        f"push_decode_s_per_param    ns: {ns(p.push_decode_s_per_param)}",
        f"apply_s                    ms: {apply}",
        f"buffer_s_per_param         {p.buffer_s_per_param * 1e9:.2f} ns",
        f"publish_s_per_param        ns: {ns(p.publish_s_per_param)}",
        f"worker_encode_s_per_param  ns: {ns(p.worker_encode_s_per_param)}",
        f"worker_decode_s_per_param  ns: {ns(p.worker_decode_s_per_param)}",
        f"worker_step_s              {ms(p.worker_step_s)}",
        f"eval_s                     {ms(p.eval_s)}",
        f"profile_s                  {ms(p.profile_s)}",
        f"exchange_s                 {ms(p.exchange_s)}",
        f"release_stagger_s          {ms(p.release_stagger_s)}",
        f"off_loop_bytes             {p.off_loop_bytes}",
    ]
