"""Parameter servers ("pservers"): the model cut into slices that S processes apply in one order.

The head decides (the engine and its policy); each pserver owns a slice of the parameters and of
the optimizer state and replays the head's decision log on it. What exists: the partition map
(:mod:`hetd.pserver.partition`), the head's decision log (:mod:`hetd.pserver.log`), which
optimizers can be cut (:mod:`hetd.pserver.separable`), a Task's own optimizer on a slice
(:mod:`hetd.pserver.task_tx`), one slice replaying the log (:mod:`hetd.pserver.slice`), the link's
frames (:mod:`hetd.pserver.link`), a pserver's saved slices and parts file (:mod:`hetd.pserver.disk`)
and one pserver's state machine (:mod:`hetd.pserver.node`); the processes and the head's side of
the link are the server's (:mod:`hetd.server.pserver_proc`, :mod:`hetd.server.pserver_link`).
"""
