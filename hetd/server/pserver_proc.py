"""A pserver process (``hetd pserver``): one slice following the head's decision log.

It reads where its newest saved slice stands (position, head life) from its state directory,
connects to the head's link and says so (``hello``), and from the ``welcome`` builds its
:class:`~hetd.pserver.node.Node` (the saved slice and the parts file read back, or the initial
tensors the head sent). Then two streams run on one event loop, so the node has one writer:

* the head's ``records``, offered to the node and carried out as far as the parts allow; each
  position saved at a checkpoint entry is reported back (``durable``);
* pushers' connections on its own port (written to ``<dir>/port`` once it listens, and taken
  again when it restarts on that directory, so that its address stays the one workers were
  given): ``part`` frames, answered ``held`` once the part is written and fsynced to the parts
  file (both in a thread; the parts that arrive while one batch is written share the next
  fsync), and reported
  to the head (``have``: the head decides a push only once every pserver holds its part),
  ``fetch`` frames, answered with the slice's tensors once it stands at the position asked, and
  ``pull`` frames (a worker fetching a release the head named by its position), answered with
  the release in force at that position once the slice has carried the log out that far
  (``slice``, written from the tensors the slice keeps, without a copy), or ``gone`` when that
  release is no longer kept (the slice keeps its newest few) or the version differs (another
  head life): the worker then asks the head for the newest parameters.

Its hello names that address (``parts``), which the head hands its workers in their welcome; on
each new connection to the head it reports every part it holds for entries still to come.

**A head that sees only the pushes' headers** (its welcome says ``headers: true``; absent, false)
holds no tensors, so the pserver measures for it what it measured from a whole push: each
``have`` also carries the part's sum of squares (``sq``: the update guard's norm, squared, summed
over the pservers by the head; NaN or inf when a value is not finite: such a part is held all the
same, and the head refuses the push and logs a drop, which frees it) and its tensors' value bytes
(``bytes``). Each held part is measured once, in a thread, while its fsync is awaited (a part read
back from the parts file at a restart, the first time it is reported). And each ``slice``
answering a ``pull`` carries ``hash``, the slice's :func:`~hetd.protocol.params.param_hash`
(computed once per kept release, in a thread), which the puller checks it against since that head
names none (:mod:`hetd.protocol.pulls`). Without ``headers`` none of this is computed or sent.

If the head goes away the process reconnects, from its current position; a head that came back
as a new life (restarted from its checkpoint) makes the node start again from its directory.
A record the slice disagrees with (:class:`~hetd.pserver.slice.LogMismatch`), or a start it cannot
make, ends the process with status 3 and the reason: a pserver never serves another model.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
from pathlib import Path
from typing import Any

from hetd.protocol import pslink
from hetd.protocol.sockframes import FrameServer, FrameSocket
from hetd.pserver import disk, link
from hetd.pserver.log import from_dict
from hetd.pserver.node import Measure, Node, NodeError, Setup
from hetd.pserver.partition import PartitionMap
from hetd.pserver.slice import LogMismatch

log = logging.getLogger("hetd.pserver")

EXIT_BROKEN = 3  # the slice cannot go on (a disagreement with the log, nothing to start from)
PORT_FILE = "port"
PR_SET_PDEATHSIG = 1  # prctl(2)


class Pserver:
    """The process's state: the node and the connection to the head."""

    def __init__(
        self,
        head: tuple[str, int],
        server: int,
        directory: Path,
        sync: bool = True,
        parts: tuple[str, int] = ("127.0.0.1", 0),
    ):
        """``parts``: the address pushers reach this pserver at (its hello names it)."""
        self.head = head
        self.parts = parts
        self.server = server
        self.directory = directory
        self.sync = sync
        self.node: Node | None = None
        self.advanced = asyncio.Event()  # set after each advance (fetches wait on it)
        self.broken = asyncio.Event()  # set when the node cannot go on (see :attr:`failed`)
        self.failed: BaseException | None = None
        self._head_writer: asyncio.StreamWriter | None = None

    # --- the head -------------------------------------------------------------------------------

    def _place(self) -> tuple[int, str]:
        """The position and head life to say hello with."""
        if self.node is not None:
            return self.node.position, self.node.setup.epoch
        for path in disk.listing(self.directory):
            with contextlib.suppress(disk.DiskError):
                saved = disk.load(path)
                return saved.slice.position, saved.epoch
        return 0, ""

    async def follow(self) -> None:
        """Connect to the head (again after each loss) and carry out its records."""
        delay = 0.1
        while True:
            try:
                reader, writer = await asyncio.open_connection(*self.head)
            except OSError:
                await asyncio.sleep(delay)
                delay = min(2.0, delay * 2)
                continue
            delay = 0.1
            try:
                await self._session(reader, writer)
            except (asyncio.IncompleteReadError, ConnectionError):
                log.warning("pserver %d: the head's link closed; reconnecting", self.server)
            finally:
                self._head_writer = None
                writer.close()
                with contextlib.suppress(Exception):
                    await writer.wait_closed()
            await asyncio.sleep(delay)

    async def _session(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        position, epoch = self._place()
        await link.send(
            writer,
            "hello",
            server=self.server,
            position=position,
            epoch=epoch,
            parts=list(self.parts),
        )
        welcome = await link.recv(reader)
        if welcome["t"] == "error":
            raise NodeError(f"the head refused pserver {self.server}: {welcome.get('message')}")
        if welcome["t"] != "welcome":
            raise link.LinkError(f"expected a welcome, got {welcome['t']!r}")
        setup = _setup(welcome)
        if self.node is None or self.node.setup.epoch != setup.epoch:
            if self.node is not None:
                self.node.close()
            raw = welcome.get("base")
            base = None
            if raw is not None:
                base = link.decode_tensors(raw, setup.pmap.slice_shapes(self.server))
            self.node = Node(self.directory, self.server, setup, base, sync=self.sync)
        node = self.node
        holding = node.slice.holding()  # this head may not know of them yet
        # headers mode: their measures, started now (each once: a part read back from the
        # parts file is measured here, the first time it is reported)
        measures = [node.measuring(w, p) if node.setup.headers else None for w, p in holding]
        self._head_writer = writer  # (a part taken from now on is reported by its sender's turn)
        await node.parts_durable()  # a part still waiting for its fsync is not reported before it
        for (worker, pid), measuring in zip(holding, measures, strict=True):
            await link.send(writer, "have", **await _have_fields(worker, pid, measuring))
        await self._report(self.node.advance())
        self.advanced.set()
        while True:
            msg = await link.recv(reader)
            if msg["t"] == "error":
                raise NodeError(f"the head: {msg.get('message')}")
            if msg["t"] != "records":
                raise link.LinkError(f"unexpected frame {msg['t']!r} from the head")
            items = link.field(msg, "items", list)
            self.node.offer(from_dict(d) for d in items)
            await self._report(self.node.advance())
            self.advanced.set()

    async def _have(self, worker: int, pid: int, measuring: asyncio.Future[Measure] | None) -> None:
        """Tell the head this slice holds push ``pid``'s part (when connected: a new connection
        reports every part held), with its measure in headers mode."""
        fields = await _have_fields(worker, pid, measuring)
        writer = self._head_writer
        if writer is not None:
            with contextlib.suppress(ConnectionError):
                await link.send(writer, "have", **fields)

    async def _report(self, durable: list[int]) -> None:
        writer = self._head_writer
        for position in durable:
            if writer is not None:
                with contextlib.suppress(ConnectionError):
                    await link.send(writer, "durable", position=position)

    # --- pushers --------------------------------------------------------------------------------

    async def serve_pushers(self, conn: FrameSocket) -> None:
        """One pusher's connection: parts and fetches, answered in order (on a plain socket,
        :mod:`hetd.protocol.sockframes`: a part read into one buffer, a slice written uncopied)."""
        try:
            while True:
                msg = await conn.recv_msg()
                try:
                    await self._answer(msg, conn)
                except link.LinkError as exc:
                    await conn.send_msg("error", message=str(exc))
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        except link.LinkError as exc:  # an unreadable frame: this connection ends
            with contextlib.suppress(Exception):
                await conn.send_msg("error", message=str(exc))
        except (LogMismatch, NodeError, disk.DiskError, OSError) as exc:  # the node cannot go on
            self.failed = exc
            self.broken.set()
        finally:
            conn.close()

    async def _answer(self, msg: dict[str, Any], conn: FrameSocket) -> None:
        while self.node is None:  # the head's welcome comes first
            self.advanced.clear()
            await self.advanced.wait()
        node = self.node
        if msg["t"] == "part":
            worker = link.field(msg, "worker", int)
            pid = link.field(msg, "pid", int)
            new = node.receive(worker, pid, msg.get("tensors"), fsync=False)
            # headers mode: the part measured in a thread while its fsync is awaited
            measuring = node.measuring(worker, pid) if node.setup.headers else None
            await node.parts_durable()  # one fsync for the parts that came meanwhile, off the loop
            await conn.send_msg("held", worker=worker, pid=pid, new=new)
            if node.slice.holds(worker, pid):  # (not when the log already consumed it)
                await self._have(worker, pid, measuring)
            if new:
                await self._report(node.advance())
                self.advanced.set()
        elif msg["t"] == "pull":
            await self._pull(msg, conn)
        elif msg["t"] == "fetch":
            want = link.field(msg, "position", int)
            while self.node is node and node.position < want:
                self.advanced.clear()
                await self.advanced.wait()
            try:
                tensors = link.encode_tensors(node.params())
            except LogMismatch as exc:  # steps queued here: not a place a release reads
                raise link.LinkError(str(exc)) from None
            version = node.slice.store.version
            await conn.send_msg("slice", position=node.position, version=version, tensors=tensors)
        else:
            raise link.LinkError(f"unknown frame {msg['t']!r}")

    async def _pull(self, msg: dict[str, Any], conn: FrameSocket) -> None:
        """A release at the position asked (waiting until the slice gets there), or ``gone``."""
        want = link.field(msg, "position", int)
        version = link.field(msg, "version", int)
        node = self.node
        assert node is not None
        while self.node is node and node.position < want:
            self.advanced.clear()
            await self.advanced.wait()
        found = node.slice.release_at(want) if self.node is node else None
        if found is None or found[0] != version:
            await conn.send_msg("gone", position=node.position)
            return
        named = None
        if node.setup.headers:  # the head names no slice hashes: the answer carries its own
            named = await node.release_hash(found[1])
            if self.node is not node or not node.keeps(found[1]):  # (its memory may be reused)
                await conn.send_msg("gone", position=node.position)
                return
        frame = pslink.slice_frame(want, version, found[1], named)  # the kept tensors, uncopied
        await conn.send(*frame)


async def _listen(ps: Pserver, directory: Path, listen: tuple[str, int]) -> FrameServer:
    """Listen for pushers on ``listen``; port 0 takes the port this directory's pserver had
    (``<dir>/port``) when it is free, so a restarted pserver keeps the address workers hold."""
    host, port = listen
    if port == 0:
        with contextlib.suppress(OSError, ValueError):
            old = int((directory / PORT_FILE).read_text().strip())
            return await FrameServer.start(ps.serve_pushers, host, old)
    return await FrameServer.start(ps.serve_pushers, host, port)


def _setup(welcome: dict[str, Any]) -> Setup:
    try:
        pmap = PartitionMap.from_dict(link.field(welcome, "map", dict))
    except ValueError as exc:
        raise link.LinkError(str(exc)) from None
    return Setup(
        pmap,
        link.field(welcome, "optimizer", str),
        link.field(welcome, "outer", str),
        link.field(welcome, "combine", bool),
        link.field(welcome, "step_each", bool),
        link.field(welcome, "epoch", str),
        link.field(welcome, "start", int),
        link.field(welcome, "headers", bool) if welcome.get("headers") is not None else False,
    )


async def _have_fields(
    worker: int, pid: int, measuring: asyncio.Future[Measure] | None
) -> dict[str, Any]:
    """A ``have`` frame's fields: the push, and in headers mode (``measuring`` given) the part's
    sum of squares and value bytes, which that head reads instead of measuring a whole push."""
    if measuring is None:
        return {"worker": worker, "pid": pid}
    m = await measuring
    return {"worker": worker, "pid": pid, "sq": m.sq, "bytes": m.nbytes}


def exit_with_parent(parent: int) -> None:
    """Have the kernel send this process SIGTERM when the process that started it ends (Linux's
    parent-death signal; elsewhere nothing), and exit now if ``parent`` is already gone: a pserver
    a daemon supervises never outlives it to share its directory with the next one's."""
    if sys.platform.startswith("linux"):
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
    if os.getppid() != parent:
        raise SystemExit(0)


async def run(
    head: tuple[str, int],
    server: int,
    directory: Path,
    listen: tuple[str, int] = ("127.0.0.1", 0),
    sync: bool = True,
) -> int:
    """Run a pserver until it fails (its exit status) or is cancelled."""
    directory.mkdir(parents=True, exist_ok=True)
    ps = Pserver(head, server, directory, sync)
    site = await _listen(ps, directory, listen)
    port = site.port
    ps.parts = (listen[0], port)
    tmp = directory / f".{PORT_FILE}.tmp"
    tmp.write_text(f"{port}\n")
    os.replace(tmp, directory / PORT_FILE)
    log.warning("pserver %d: parts on %s:%d, head at %s:%d", server, listen[0], port, *head)
    following = asyncio.create_task(ps.follow())
    broken = asyncio.create_task(ps.broken.wait())
    stop = asyncio.Event()  # SIGTERM or SIGINT: what it saved and its parts file stay as they are
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    stopping = asyncio.create_task(stop.wait())
    try:
        await asyncio.wait({following, broken, stopping}, return_when=asyncio.FIRST_COMPLETED)
        if stop.is_set():
            node = ps.node
            written, syncs = (node.parts.written, node.commit.syncs) if node else (0, 0)
            log.warning(
                "pserver %d stopping (signal); %d parts written in %d fsyncs since its start",
                server,
                written,
                syncs,
            )
            return 0
        if following.done():
            following.result()
        raise ps.failed or NodeError("stopped")
    except (LogMismatch, NodeError, ValueError, disk.DiskError, OSError) as exc:
        log.error("pserver %d stops: %s", server, exc)  # (a LinkError is a ValueError)
        return EXIT_BROKEN
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
        for task in (following, broken, stopping):
            task.cancel()
        site.close()
        if ps.node is not None:
            ps.node.close()
    return 0
