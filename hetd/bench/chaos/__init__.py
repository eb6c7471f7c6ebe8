"""``hetd bench --suite chaos``: a real daemon and real workers under a seeded fault schedule.

For each policy, two runs of the same length on loopback (or, with ``--links netns``, over
unshaped links in network namespaces):

* **chaos**: ``hetd serve`` as a subprocess and N ``hetd-worker`` processes (:mod:`.cluster`), one
  fault every ``fault_every`` s drawn with the seed: a worker killed, stalled or cut off, and
  exactly one SIGKILL of the daemon mid-run, restarted at once on the same ports and state
  directory (:mod:`.faults`); with ``--pservers S``, a daemon with S local pserver processes and
  pserver kills among the faults (:mod:`.pservers`), and with ``--pserver-heads headers`` a
  daemon that takes each push's header only and holds no parameters;
* **baseline**: the same with no faults, in two halves, one just before the chaos run and one just
  after.

Each policy is scored on goodput against the baseline, duplicate or partial applies, parameter
hash mismatches, versions lost at the daemon kill and each fault's recovery, and with pservers
their restarts, the update rate back after a kill and their slices against the head's parameters
(a head of headers: against its checkpoint's place in the log, :mod:`.slices`) (:mod:`.score`); the runs and the report are :mod:`.suite`'s.
"""

from hetd.bench.chaos.cluster import ChaosOptions
from hetd.bench.chaos.suite import run_chaos

__all__ = ["ChaosOptions", "run_chaos"]
