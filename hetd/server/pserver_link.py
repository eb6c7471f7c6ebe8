"""The head's side of the pservers' link: the decision log served to S pserver processes.

A pserver connects (TCP, loopback), says which slice it holds and the log position it stands at
(``hello``), gets the ``welcome`` (the partition map, the optimizer specs, the store's modes, this
head's life and where its log began, and the slice's initial tensors when it has none saved and
the log still starts at position 0), then every record after its position, in order, as the
engine writes them (:attr:`DecisionLog.on_append` wakes the sender; the engine may write from the
thread a publish runs in, so the wake-up goes through the loop). It reports each position it saved
its slice at (``durable``); :meth:`HeadLink.floor`, the lowest of those over the S pservers, is how
far the log may forget (the daemon's checkpointer asks it).

**The data path.** Each hello names the address the pserver takes push parts on; once all S
have said hello, :attr:`HeadLink.ready` is set and the workers' welcome carries the map and the
addresses (``pservers``: the engine's welcome setup gains that key): a worker sends each part to
its pserver and its push to the head as before, and pulls its full releases from the pservers
(:mod:`hetd.server.pserver_pulls`). A pserver reports each part it holds (``have``);
the head hands a push to the engine only once every pserver holds its part
(:class:`~hetd.server.pserver_parts.PartsWait`), and drops one whose parts do not all come in
time. :func:`serving` finds the link of an engine (the workers' sessions ask it).

One connection per slice: a second hello for a slice replaces the first. Whatever a pserver
sends that is malformed closes its connection only, with an ``error`` frame saying why. Frames
are :mod:`hetd.pserver.link`'s.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import Awaitable, Mapping, MutableMapping
from dataclasses import dataclass
from typing import Any, cast

from hetd.core import commands as cmd
from hetd.core.engine import Engine
from hetd.core.store import Snapshot
from hetd.protocol.messages import PushIn
from hetd.protocol.pulls import ReleasePuller
from hetd.pserver import link
from hetd.pserver.log import DecisionLog, to_dict
from hetd.pserver.partition import PartitionMap, split
from hetd.server.pserver_parts import PartsWait
from hetd.server.pserver_pulls import Pointers

log = logging.getLogger("hetd.server.pserver_link")

BATCH = 256  # records per frame at most
PART_TIMEOUT_S = 30.0  # s a push waits for its parts' reports before it is dropped
EXPIRE_EVERY_S = 0.5  # s between checks for pushes waited on too long
WELCOME_KEY = "pservers"  # the welcome's field: {"map": ..., "addrs": [[host, port], ...]}


@dataclass(frozen=True, slots=True)
class LinkSetup:
    """What the head tells every pserver."""

    pmap: PartitionMap
    optimizer: str  # the daemon's optimizer spec
    base: Mapping[str, Any] | None  # the parameters at position 0 (None: the log began later)
    part_timeout_s: float = PART_TIMEOUT_S  # a push whose parts take longer is dropped


class HeadLink:
    """Serves the engine's decision log to ``pmap.servers`` pservers."""

    def __init__(self, engine: Engine, setup: LinkSetup) -> None:
        decisions = engine.store.decisions
        if not isinstance(decisions, DecisionLog):
            raise ValueError("the engine keeps no decision log: set [pservers] log = true")
        self.engine = engine
        self.log = decisions
        self.setup = setup
        self.epoch = secrets.token_hex(8)  # this head's life
        self.began = decisions.position  # where the log began in this life
        self.durable = [0] * setup.pmap.servers  # each slice's newest saved position
        self.connected: dict[int, asyncio.Task[None]] = {}  # slice -> its connection's task
        self._base = split(setup.pmap, setup.base) if setup.base is not None else None
        self._wake: list[asyncio.Event] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: asyncio.Server | None = None
        self.port = 0
        self.addrs: list[tuple[str, int] | None] = [None] * setup.pmap.servers  # parts' addresses
        self.ready = asyncio.Event()  # every pserver said where it takes parts
        # a head that holds no parameters takes headers: the pservers report each part's norm
        self.headers = not engine.store.holds_params
        self.parts = PartsWait(
            setup.pmap.servers,
            self._decide,
            self._lose,
            setup.part_timeout_s,
            headers=self.headers,
        )
        self._expiry: asyncio.Task[None] | None = None
        self._puller: ReleasePuller | None = None  # (a head of headers: its own pulls)

    async def start(self, host: str, port: int) -> int:
        """Listen on ``host:port``; the bound port."""
        self._loop = asyncio.get_running_loop()
        self.log.on_append = self._appended
        self._server = await asyncio.start_server(self._serve, host, port)
        self.port = int(self._server.sockets[0].getsockname()[1])
        self._expiry = asyncio.create_task(self._expire())
        log.info("pservers' link on %s:%d (%d slices)", host, self.port, self.setup.pmap.servers)
        return self.port

    def _decide(self, push: PushIn) -> None:
        self.engine.queue.submit(cmd.Push(push))

    def _lose(self, push: PushIn) -> None:
        self.engine.intake.partless.add((push.worker, push.id))
        self.engine.queue.submit(cmd.Push(push))

    async def _expire(self) -> None:
        while True:
            await asyncio.sleep(EXPIRE_EVERY_S)
            self.parts.expire()

    def _advertise(self, server: int, addr: tuple[str, int]) -> None:
        """Pserver ``server`` takes parts at ``addr``: once all are known, the welcome says so."""
        self.addrs[server] = addr
        known = [a for a in self.addrs if a is not None]
        if len(known) < len(self.addrs):
            return
        welcome = cast(MutableMapping[str, Any], self.engine.config.welcome)
        welcome[WELCOME_KEY] = {
            "map": self.setup.pmap.to_dict(),
            "addrs": [[h, p] for h, p in known],
            **({"headers": True} if self.headers else {}),
        }
        if self.headers:  # the head's own pulls (evaluations, exports) go where the workers' do
            if self._puller is None:
                self._puller = ReleasePuller(welcome[WELCOME_KEY])
                self.engine.evaluations.source = self.pulled_now
            else:
                self._puller.update(welcome[WELCOME_KEY])
        if not self.ready.is_set():
            log.info("every pserver takes parts: workers are welcomed with the map")
            # full releases name a log position from now on: the workers pull them from here
            pointers = Pointers(self.setup.pmap, self.log, hashes=not self.headers)
            self.engine.publisher.pointer = pointers
        self.ready.set()

    def here(self) -> tuple[int, int]:
        """The store's version and the log position it stands at (its queued steps logged
        first). On the engine's task."""
        store = self.engine.store
        store.flush()
        return store.version, self.log.position

    def pulled_now(self) -> Awaitable[Snapshot | None]:
        """The parameters now, pulled from the pservers (a head that holds none): the place is
        taken at the call (on the engine's task), the pull awaited later."""
        return self.pull(*self.here())

    async def pull(self, version: int, position: int) -> Snapshot | None:
        """Version ``version``, in force at log ``position``, pulled from the pservers and
        joined; None when they no longer keep it, or do not answer in time. Each slice is
        checked against the hash its pserver sends."""
        puller = self._puller
        if puller is None:
            return None
        got = await puller.fetch(version, position, (), None)
        return None if got is None else Snapshot(version, got[0])

    async def saved_by_all(self, position: int, timeout_s: float) -> bool:
        """Whether every pserver saves its slice at ``position`` (or later) within
        ``timeout_s``: a checkpoint of a head that holds no parameters is theirs."""
        deadline = time.monotonic() + timeout_s
        while self.floor() < position:
            if time.monotonic() >= deadline:
                log.warning(
                    "pservers saved positions %s, not all %d, within %.0f s",
                    self.durable,
                    position,
                    timeout_s,
                )
                return False
            await asyncio.sleep(0.05)
        return True

    def floor(self) -> int:
        """The lowest position every slice has saved (the log keeps the records after it)."""
        return min(self.durable)

    def _appended(self) -> None:
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        for event in list(self._wake):
            loop.call_soon_threadsafe(event.set)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        server = -1
        try:
            hello = await asyncio.wait_for(link.recv(reader, 1 << 16), 30)
            server, position = self._check_hello(hello)
            if hello.get("parts") is not None:  # (a reader of the log alone names none)
                self._advertise(server, _parts_address(hello))
            old = self.connected.get(server)
            if old is not None and old is not task:
                old.cancel()  # a pserver that came back: the old connection is dead
            assert task is not None
            self.connected[server] = task
            await link.send(writer, "welcome", **self._welcome(server, position))
            await self._follow(reader, writer, server, position)
        except (link.LinkError, ValueError) as exc:
            log.warning("pserver link: %s", exc)
            with contextlib.suppress(Exception):
                await link.send(writer, "error", message=str(exc))
        except (asyncio.IncompleteReadError, ConnectionError, TimeoutError):
            pass
        except asyncio.CancelledError:  # replaced by the slice's new connection, or closing:
            pass  # this handler ends here (asyncio logs a cancelled handler as an error)
        finally:
            if server >= 0 and self.connected.get(server) is task:
                del self.connected[server]
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    def _check_hello(self, hello: Mapping[str, Any]) -> tuple[int, int]:
        if hello.get("t") != "hello":
            raise link.LinkError("the first frame must be a hello")
        server = link.field(hello, "server", int)
        position = link.field(hello, "position", int)
        epoch = link.field(hello, "epoch", str)
        if not 0 <= server < self.setup.pmap.servers:
            raise link.LinkError(f"slice {server} of {self.setup.pmap.servers}")
        if position < 0 or (epoch == self.epoch and position > self.log.position):
            raise link.LinkError(f"position {position} is not in the log (0..{self.log.position})")
        if epoch != self.epoch and position > 0:  # another head life's: it goes back to start
            position = self.began
        return server, position

    def _welcome(self, server: int, position: int) -> dict[str, Any]:
        base = None
        if position == 0 and self._base is not None and self.log.first == 1 and self.began == 0:
            base = link.encode_tensors(self._base[server])
        store = self.engine.store
        return {
            "map": self.setup.pmap.to_dict(),
            "optimizer": self.setup.optimizer,
            "outer": store.outer_spec,
            "combine": store.combine,
            "step_each": store.step_each,
            "epoch": self.epoch,
            "start": self.began,
            "base": base,
            **({"headers": True} if self.headers else {}),
        }

    async def _follow(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        server: int,
        position: int,
    ) -> None:
        """Send the records after the pserver's place as they come; take its reports."""
        wake = asyncio.Event()
        self._wake.append(wake)
        reports = asyncio.create_task(self._reports(reader, server))
        try:
            sent = position
            while not reports.done():
                if sent < self.log.first - 1:
                    raise link.LinkError(
                        f"the log holds positions from {self.log.first}; slice {server} stands "
                        f"at {sent}: it needs a saved slice at or after {self.log.first - 1}"
                    )
                wake.clear()
                records = self.log.since(sent)
                for i in range(0, len(records), BATCH):
                    batch = records[i : i + BATCH]
                    await link.send(writer, "records", items=[to_dict(r) for r in batch])
                    sent = batch[-1].position
                if not records:
                    waiter = asyncio.create_task(wake.wait())
                    await asyncio.wait({waiter, reports}, return_when=asyncio.FIRST_COMPLETED)
                    waiter.cancel()
            reports.result()  # raises what ended it
        finally:
            self._wake.remove(wake)
            reports.cancel()

    async def _reports(self, reader: asyncio.StreamReader, server: int) -> None:
        while True:
            msg = await link.recv(reader, 1 << 16)
            if msg["t"] == "have":
                sq, nbytes = msg.get("sq"), msg.get("bytes")
                self.parts.have(
                    server,
                    link.field(msg, "worker", int),
                    link.field(msg, "pid", int),
                    float(sq) if isinstance(sq, int | float) and not isinstance(sq, bool) else None,
                    nbytes if isinstance(nbytes, int) and not isinstance(nbytes, bool) else None,
                )
                continue
            if msg["t"] != "durable":
                raise link.LinkError(f"unexpected frame {msg['t']!r} from slice {server}")
            self.durable[server] = max(self.durable[server], link.field(msg, "position", int))
            if min(self.durable) > 0:  # every slice saved: no pserver starts from position 0
                self._base = None

    async def close(self) -> None:
        """Stop listening and close every connection."""
        self.log.on_append = None
        if self._puller is not None:
            self._puller.close()
        if self._expiry is not None:
            self._expiry.cancel()
        if self._server is not None:
            self._server.close()
        for task in list(self.connected.values()):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        if self._server is not None:
            with contextlib.suppress(Exception):
                await self._server.wait_closed()


def _parts_address(hello: Mapping[str, Any]) -> tuple[str, int]:
    addr = link.field(hello, "parts", list)
    if (
        len(addr) != 2
        or not isinstance(addr[0], str)
        or not isinstance(addr[1], int)
        or isinstance(addr[1], bool)
        or not 0 < addr[1] <= 65535
    ):
        raise link.LinkError(f"hello: parts must be [host, port], got {addr!r}")
    return addr[0], addr[1]
