"""One engine from one description: the daemon (:mod:`hetd.server.build`), the simulator
(:mod:`hetd.sim.loop`) and the system bench each describe theirs as an :class:`EngineSpec`, and
:func:`assemble` turns it into the store with its optimizers, the policy, and the
:class:`~hetd.core.entries.EngineConfig` that carries the welcome and the outer optimizer's rule.
So the three pick the daemon's, the workers' and the outer optimizer by one rule
(:func:`hetd.config.optimizers`), and tell their workers what to build in one shape.

JAX and optax load when :func:`assemble` runs, not when this module is imported: the daemon
imports its builder before its sockets listen.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from hetd import config as config_mod
from hetd.core.entries import EngineConfig

if TYPE_CHECKING:  # the heavy modules (JAX, optax) load when the store is built
    import optax

    from hetd.core.decisions import DecisionSink
    from hetd.core.engine import Engine
    from hetd.core.evals import Evaluation
    from hetd.core.peers import Clock
    from hetd.core.store import Snapshot, Store
    from policies.types import Policy


@dataclass(frozen=True)
class Optimizers:
    """The optimizers as ``[train]`` names them (each spec ``name[:lr=..,...]``); ``workers``: the
    period an ``"auto"`` outer optimizer is given (delayed Nesterov's), in workers."""

    optimizer: str = "sgd"  # the daemon's, for gradients
    lr: float = 0.1  # its learning rate when the spec names none
    inner: str = ""  # the workers' for local steps ("": the daemon's family)
    worker_lr: float = 0.0  # the inner optimizer's learning rate when its spec names none (0: lr)
    outer: str = "auto"  # the daemon's for deltas ("auto": the policy's)
    workers: int = 1

    @classmethod
    def of(cls, train: config_mod.TrainConfig, workers: int = 1) -> Optimizers:
        """The optimizers a ``[train]`` section names."""
        return cls(
            train.optimizer,
            train.lr,
            train.inner_optimizer,
            train.worker_lr,
            train.outer_optimizer,
            workers,
        )

    def specs(self, policy: str = "", params: Mapping[str, Any] | None = None) -> tuple[str, ...]:
        """The daemon's, the workers' and the outer optimizer's specs in full, for ``policy``
        run with ``params`` (the outer one may depend on them)."""
        return config_mod.optimizers(
            self.optimizer,
            self.lr,
            self.inner,
            self.worker_lr,
            self.outer,
            policy,
            params,
            self.workers,
        )

    def outer_for(self, policy: str, params: Mapping[str, Any]) -> str:
        """The outer optimizer ``policy`` runs with: at the start, and after a swap to it."""
        return self.specs(policy, params)[2]


def worker_setup(
    model: str,
    dataset: str,
    seed: int,
    optimizers: Optimizers,
    micro_batch: int,
    model_kwargs: Mapping[str, Any] | None = None,
    dataset_kwargs: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """What every worker is told to build for a bundled model on a bundled data set: the
    ``model``, ``dataset`` and ``train`` parts of the welcome, as
    :func:`hetd.config.worker_setup` gives them for a config."""
    return {
        "model": {"spec": model, "kwargs": dict(model_kwargs or {})},
        "dataset": {"spec": dataset, "kwargs": dict(dataset_kwargs or {}), "seed": seed},
        "train": {
            "worker_lr": optimizers.worker_lr or optimizers.lr,
            "seed": seed,
            "inner_optimizer": optimizers.specs()[1],
            "micro_batch": micro_batch,
        },
    }


@dataclass(frozen=True)
class EngineSpec:
    """An engine described as data. ``settings`` is everything else the engine is told; its
    ``welcome`` and ``outer_for`` are replaced by this spec's."""

    params: Mapping[str, Any]  # the initial parameters, path -> float32 array
    policy: str
    policy_params: Mapping[str, Any] = field(default_factory=dict)
    optimizers: Optimizers = Optimizers()
    # A task's own optimizers (over the flat parameters), in place of ``optimizers``' specs. Its
    # own daemon optimizer takes one step per applied update, so its schedule counts updates; its
    # own outer optimizer stays across policy swaps.
    task_optimizer: optax.GradientTransformation | None = None
    task_outer: optax.GradientTransformation | None = None
    welcome: Mapping[str, Any] = field(default_factory=dict)  # model, dataset, train
    settings: EngineConfig = field(default_factory=EngineConfig)
    store_type: type[Store] | None = None  # None: Store (the simulator's notes what it applies)


@dataclass(frozen=True)
class Assembly:
    """What :func:`assemble` built: the parts an :class:`~hetd.core.engine.Engine` takes."""

    store: Store
    policy: Policy
    config: EngineConfig

    def engine(
        self,
        clock: Clock | None = None,
        evaluator: Callable[[Snapshot], Evaluation] | None = None,
        decisions: DecisionSink | None = None,
    ) -> Engine:
        """The engine over these parts (``clock``: None for wall time; ``evaluator``: None when
        evaluations are handed to it; ``decisions``: a decision log it writes, None for none)."""
        from hetd.core.engine import Engine

        return Engine(
            self.store,
            self.policy,
            self.config,
            clock=clock,
            evaluator=evaluator,
            decisions=decisions,
        )


def assemble(spec: EngineSpec) -> Assembly:
    """The store with its optimizers, the policy and the engine's settings ``spec`` describes.
    Raises what :func:`policies.make_policy` and the optimizer specs raise for a bad name."""
    from hetd.core.store import Store, make_optimizer, make_outer
    from policies import make_policy

    daemon_opt, _, _ = spec.optimizers.specs()
    tx = spec.task_optimizer if spec.task_optimizer is not None else make_optimizer(daemon_opt)
    store_type = spec.store_type or Store
    outer_for: Callable[[str, Mapping[str, Any]], str]
    if spec.task_outer is not None:
        store = store_type(spec.params, tx, outer=spec.task_outer)
        outer_for = _custom_outer
    else:
        outer_for = spec.optimizers.outer_for
        outer_opt = outer_for(spec.policy, spec.policy_params)
        store = store_type(spec.params, tx, outer=make_outer(outer_opt), outer_spec=outer_opt)
    store.step_each = spec.task_optimizer is not None
    policy = make_policy(spec.policy, spec.policy_params)
    config = dataclasses.replace(spec.settings, welcome=spec.welcome, outer_for=outer_for)
    return Assembly(store, policy, config)


def _custom_outer(name: str, params: Mapping[str, Any]) -> str:
    """A task's own outer optimizer, whatever the policy: a swap keeps it."""
    return "custom"
