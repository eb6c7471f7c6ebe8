"""The head holds a push until every pserver holds its part (:class:`PartsWait`).

With pservers a worker sends its push's parts straight to them and the head its push as before;
the head hands a push to the engine (which decides it) only once each of the S pservers has
reported holding its part (``have``, over the pservers' link), so that whatever the engine
decides, every slice can carry it out: an update is applied everywhere or nowhere. A push whose
parts do not all come within ``timeout_s`` is handed over as *lost*: the engine answers it
``dropped`` and logs a drop, and each pserver frees the part it may hold.

Pushes leave in the order they came, per worker (the log names a worker's pushes in id order):
a push waits behind an earlier one of its worker. Reports may come before the push they name
(the parts travel beside it); they are kept until it comes, and forgotten once the worker's
pushes have passed them, or past :data:`MAX_EARLY` (a worker that left for good).

With ``headers`` (a head that takes push headers only, ``[pservers] headers``) each report
also carries the part's squared norm and its bytes: a push goes on with the update's norm
(the square root of their sum; NaN when one is not finite, which the engine refuses), its
bytes the header's and the parts', and its transfer time up to its last part's report.

One writer: everything here runs on the daemon's event loop; time is read from ``clock``.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field

from hetd.protocol.messages import PushIn

log = logging.getLogger("hetd.server.pserver_link")

MAX_EARLY = 65536  # reports kept for pushes the head has not seen (the oldest go first)


@dataclass(slots=True)
class _Held:
    push: PushIn
    since: float


@dataclass(slots=True)
class _Reports:
    """One push's reports: pserver -> (its part's squared norm, its bytes) (None: not said)."""

    by: dict[int, tuple[float | None, int | None]] = field(default_factory=dict)


class PartsWait:
    """Pushes waiting for their parts' reports; ``submit`` gets each once its parts are all in,
    ``lose`` each whose parts did not come in time (both on the event loop)."""

    def __init__(
        self,
        servers: int,
        submit: Callable[[PushIn], None],
        lose: Callable[[PushIn], None],
        timeout_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
        headers: bool = False,
    ) -> None:
        """``headers``: the pushes are headers, their norms and bytes the reports' sums."""
        if servers < 1:
            raise ValueError(f"PartsWait needs at least one pserver, got {servers}")
        self.servers = servers
        self.submit = submit
        self.lose = lose
        self.timeout_s = timeout_s
        self.clock = clock
        self.headers = headers
        self._haves: OrderedDict[tuple[int, int], _Reports] = OrderedDict()
        self._queues: dict[int, deque[_Held]] = {}
        self._passed: dict[int, int] = {}  # worker -> the last push id handed on
        self.decided = 0  # pushes handed to the engine with every part in
        self.lost = 0  # pushes handed on as lost

    def describe(self) -> dict[str, int]:
        """For ``/v1/status``: pushes decided with every part in, dropped without, waiting now."""
        return {"decided": self.decided, "dropped": self.lost, "waiting": self.waiting()}

    def waiting(self) -> int:
        """Pushes held now."""
        return sum(len(q) for q in self._queues.values())

    def hold(self, push: PushIn) -> None:
        """A push from a worker's session: on to the engine once every pserver holds its part
        (at once when its id was passed: sent again, the engine answers it a duplicate)."""
        if push.id <= self._passed.get(push.worker, -1):
            self.submit(push)
            return
        self._queues.setdefault(push.worker, deque()).append(_Held(push, self.clock()))
        self._release(push.worker)

    def have(
        self,
        server: int,
        worker: int,
        pid: int,
        sq: float | None = None,
        nbytes: int | None = None,
    ) -> None:
        """Pserver ``server`` holds push ``pid``'s part (``sq``: its squared norm, ``nbytes``:
        its bytes, when the pserver says)."""
        if not 0 <= server < self.servers or pid <= self._passed.get(worker, -1):
            return
        key = (worker, pid)
        reports = self._haves.get(key)
        if reports is None:
            reports = self._haves[key] = _Reports()
        reports.by[server] = (sq, nbytes)
        if len(self._haves) > MAX_EARLY:
            self._haves.popitem(last=False)
        self._release(worker)

    def expire(self) -> None:
        """Hand on as lost every push that has waited past ``timeout_s`` (and what then follows
        it); the daemon calls this periodically."""
        now = self.clock()
        for worker in list(self._queues):
            self._release(worker)  # (what is complete goes on, however long it waited)
            queue = self._queues.get(worker)
            while queue and now - queue[0].since >= self.timeout_s:
                held = queue.popleft()
                gone = self._haves.pop((worker, held.push.id), None)
                have = len(gone.by) if gone is not None else 0
                self._pass(worker, held.push.id)
                self.lost += 1
                log.warning(
                    "worker %d: push %d dropped: %d of %d pservers reported its part within %g s",
                    worker,
                    held.push.id,
                    have,
                    self.servers,
                    self.timeout_s,
                )
                self.lose(held.push)
                self._release(worker)
                queue = self._queues.get(worker)

    def _release(self, worker: int) -> None:
        queue = self._queues.get(worker)
        while queue:
            pid = queue[0].push.id
            reports = self._haves.get((worker, pid))
            if reports is None or len(reports.by) < self.servers:
                return
            held = queue.popleft()
            del self._haves[(worker, pid)]
            self._pass(worker, pid)
            self.decided += 1
            self.submit(self._filled(held, reports) if self.headers else held.push)
        if queue is not None and not queue:
            del self._queues[worker]

    def _pass(self, worker: int, pid: int) -> None:
        self._passed[worker] = max(self._passed.get(worker, -1), pid)
        for key in [k for k in self._haves if k[0] == worker and k[1] <= pid]:
            del self._haves[key]

    def _filled(self, held: _Held, reports: _Reports) -> PushIn:
        """A header's push with what its parts' reports say: the update's norm (NaN when a
        part's is not finite, or a pserver did not say), its bytes, its transfer time."""
        sq = 0.0
        nbytes = held.push.nbytes
        for part_sq, part_bytes in reports.by.values():
            sq += part_sq if part_sq is not None else math.nan
            nbytes += part_bytes or 0
        p = held.push
        waited = max(0.0, self.clock() - held.since)
        return dataclasses.replace(
            p,
            norm=math.sqrt(sq) if math.isfinite(sq) else math.nan,
            nbytes=nbytes,
            transfer_s=None if p.transfer_s is None else p.transfer_s + waited,
        )
