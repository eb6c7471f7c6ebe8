"""Joint data + model parallelism (pipeline replicas of memory-poor workers), pure parts.

* :mod:`policies.dpmp.costs`: the cost model of a replica (per-stage times, memory), the
  equal-finish split of a global batch across replicas in micro-batch units, a stage's 1F1B
  order;
* :mod:`policies.dpmp.search`: the cuts and stage order of a group;
* :mod:`policies.dpmp.groups`: which workers form which replicas, with hysteresis;
* :mod:`policies.dpmp.lyapunov`: the drift-plus-penalty controller over time-averaged costs;
* :mod:`policies.dpmp.assembler`: turning per-stage partial pushes into one whole update;
* :mod:`policies.dpmp.controller`: one round's plan (replica specs with generations) and its
  feedback, combining groups and the Lyapunov choice.

No jax, numpy, clock or I/O here (import-linter enforces it); the JAX stage execution is
:mod:`hetd.zoo.stages` (workloads as blocks: :mod:`hetd.zoo.blocks`), the event simulator
:mod:`hetd.sim.dpmp`.
"""
