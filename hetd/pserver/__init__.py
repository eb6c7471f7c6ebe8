"""Parameter servers ("pservers"): the model cut into slices that S processes apply in one order.

The head decides (the engine and its policy); each pserver owns a slice of the parameters and of
the optimizer state and replays the head's decision log on it. What exists: the partition map
(:mod:`hetd.pserver.partition`), the head's decision log (:mod:`hetd.pserver.log`), which
optimizers can be cut (:mod:`hetd.pserver.separable`), a Task's own optimizer on a slice
(:mod:`hetd.pserver.task_tx`) and one slice replaying the log (:mod:`hetd.pserver.slice`). Processes, links and the daemon's wiring do not exist yet.
"""
