"""A Task's functions from flax modules: :func:`nnx_parts` for ``flax.nnx``, :func:`linen_parts` for
``flax.linen``; :meth:`Task.from_nnx <hetd.zoo.task.Task.from_nnx>` and
:meth:`Task.from_linen <hetd.zoo.task.Task.from_linen>` build the Task from them.

Both give the Task the module's trainable parameters as a plain nested dict (``nnx.Param``
variables, linen's ``params`` collection), so the wire, checkpoints and ``hetd export`` carry the
module's own structure: ``nnx.replace_by_pure_dict(state, params)`` (or
``flax.serialization.from_state_dict``) puts an export back into an ``nnx.State``, and linen takes
it as ``{"params": params}``.

Non-trainable state that changes while training (batch statistics: ``nnx.BatchStat``, linen's
``batch_stats`` collection) is refused with a message: workers would each update their own copy
and the daemon has no rule to merge them that keeps an update's meaning. Use a normalisation
without running statistics (LayerNorm, GroupNorm, RMSNorm). Other non-trainable state (an
``nnx.Rngs`` inside the module, constants) is kept as the module was built, the same for every
call: pass ``key`` on to dropout (``loss_fn(model, batch, key)``, ``nnx.Rngs(dropout=key)``) for
fresh masks.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from hetd.zoo.errors import TaskError

_NORMS = "use a normalisation without running statistics (LayerNorm, GroupNorm, RMSNorm)"


def _takes_key(fn: Callable[..., Any]) -> bool:
    """Whether ``loss_fn`` takes a third argument (the PRNG key)."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return False
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return len(positional) >= 3 or any(p.kind is p.VAR_POSITIONAL for p in params)


def nnx_parts(
    model: Any, loss_fn: Callable[..., Any]
) -> tuple[Callable[..., Any], Callable[..., Any], Callable[..., Any]]:
    """``(init, loss, eval_loss)`` of a Task that trains an ``nnx.Module``'s ``nnx.Param``
    variables.

    ``model``: a module instance (its current parameters are the initial ones; ``init``'s key is
    not used) or a function ``rngs -> module`` (called with ``nnx.Rngs(key)``; built once at
    once for its structure). ``loss_fn(model, batch)`` or ``loss_fn(model, batch, key)`` returns
    the loss or ``(loss, metrics)``; the model is in ``train()`` mode for training and ``eval()``
    mode (dropout off) for the daemon's evaluations (``eval_loss``).
    """
    import jax
    from flax import nnx

    factory: Callable[..., Any] | None = None
    if isinstance(model, nnx.Module):
        instance = model
    elif callable(model):
        factory = model
        try:  # built once, eagerly: the structure and the non-trainable state every call shares
            instance = model(nnx.Rngs(0))
        except Exception as exc:
            raise TaskError(f"from_nnx: building the module failed: {exc}") from exc
        if not isinstance(instance, nnx.Module):
            raise TaskError(
                f"from_nnx: the factory returned {type(instance).__name__}, not an nnx.Module"
            )
    else:
        raise TaskError(
            f"from_nnx takes an nnx.Module or rngs -> Module, got {type(model).__name__}"
        )
    stats = nnx.state(instance, nnx.BatchStat)
    if jax.tree.leaves(stats):
        paths = ", ".join(
            "/".join(str(getattr(k, "key", k)) for k in path)
            for path, _ in jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(stats))[0][:3]
        )
        raise TaskError(
            f"from_nnx: the module keeps batch statistics ({paths}), which workers cannot "
            f"share; {_NORMS}"
        )
    split: Any = nnx.split
    graphdef, template, constant = split(instance, nnx.Param, ...)
    initial = nnx.to_pure_dict(nnx.state(instance, nnx.Param))
    with_key = _takes_key(loss_fn)

    def init(key: jax.Array) -> Any:
        if factory is None:
            return jax.tree.map(lambda x: x, initial)
        return nnx.to_pure_dict(nnx.state(factory(nnx.Rngs(key)), nnx.Param))

    def live(params: Any, training: bool) -> Any:
        state = jax.tree.map(lambda x: x, template)
        nnx.replace_by_pure_dict(state, params)
        module = nnx.merge(graphdef, state, constant)
        # dropout and the like: on while training, off for the daemon's evaluations
        if training:
            module.train()
        else:
            module.eval()
        return module

    def loss(params: Any, batch: Any, key: jax.Array) -> Any:
        m = live(params, True)
        return loss_fn(m, batch, key) if with_key else loss_fn(m, batch)

    def eval_loss(params: Any, batch: Any, key: jax.Array) -> Any:
        m = live(params, False)
        return loss_fn(m, batch, key) if with_key else loss_fn(m, batch)

    return init, loss, eval_loss


def linen_parts(
    module: Any, loss_fn: Callable[..., Any], sample: Any
) -> tuple[Callable[..., Any], Callable[..., Any]]:
    """``(init, loss)`` of a Task that trains a ``flax.linen`` module's ``params`` collection.

    ``sample``: an input like one batch's (what ``module.init(key, sample)`` takes).
    ``loss_fn(apply, batch)`` or ``loss_fn(apply, batch, key)``, where ``apply(*args, **kw)`` is
    ``module.apply({"params": params}, *args, **kw)``, returns the loss or ``(loss, metrics)``.
    """
    import jax

    try:
        shapes = jax.eval_shape(module.init, jax.random.PRNGKey(0), sample)
    except Exception as exc:
        raise TaskError(
            f"from_linen: {type(module).__name__}.init on the sample failed: {exc}"
        ) from exc
    extra = sorted(set(shapes) - {"params"})
    if "batch_stats" in extra:
        raise TaskError(
            f"from_linen: {type(module).__name__} keeps batch statistics (collection "
            f"'batch_stats'), which workers cannot share; {_NORMS}"
        )
    if extra:
        raise TaskError(
            f"from_linen: {type(module).__name__} has variable collections {extra} besides "
            "'params'; hetd trains 'params' only"
        )
    with_key = _takes_key(loss_fn)

    def init(key: jax.Array) -> Any:
        return module.init(key, sample)["params"]

    def loss(params: Any, batch: Any, key: jax.Array) -> Any:
        def apply(*args: Any, **kw: Any) -> Any:
            return module.apply({"params": params}, *args, **kw)

        return loss_fn(apply, batch, key) if with_key else loss_fn(apply, batch)

    return init, loss
