"""One session per worker websocket: authenticate, decode frames into engine commands, and keep a
bounded outbox so that a slow worker never stalls the engine or the others.

Everything a worker sends is checked here before it reaches the engine: the frame (wire.decode),
then a hello or a push as the engine's typed input (:mod:`hetd.core.ingest`: the tensors' paths,
shapes and codecs and their finiteness). A bad frame gets an ``error`` reply and is forgotten;
nothing of it is applied. The session's :class:`Outbox` is the engine's peer: it encodes the
engine's typed replies into frames.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Protocol, cast

from aiohttp import WSCloseCode, WSMsgType, web

from hetd.codecs import registry as codecs
from hetd.config import is_loopback
from hetd.core import commands as cmd
from hetd.core.engine import Engine
from hetd.core.ingest import decode_header, decode_hello, decode_push
from hetd.protocol import shm, wire
from hetd.protocol.frames import (
    Act,
    Heartbeat,
    Hello,
    ProfileResult,
    Pull,
    ShmOffer,
    ShmReady,
    Typed,
    read,
)
from hetd.protocol.messages import Bye, PushIn, Reply
from hetd.protocol.text import clip
from hetd.server.auth import bearer_ok
from hetd.server.budget import DecodeBudget
from hetd.server.pserver_parts import PartsWait
from hetd.server.relay import NoRoute, Relay
from hetd.server.shm_hub import ShmHub, Uplink

log = logging.getLogger("hetd.server.sessions")

OFF_LOOP_BYTES = 256 * 1024  # frames larger than this are decoded in a worker thread
RELAY_SLACK = 256  # relayed frames a session may hold queued beyond its control frames
# The control messages a worker sends (a push and relayed frames take their own way); any other
# type is the daemon's own and is refused unread.
WORKER_SENDS = frozenset({"heartbeat", "pull", "bye", "shm_ready", "profile_result", "hello"})


authorized = bearer_ok  # the worker token: ``Authorization: Bearer <token>``


class PserverGate(Protocol):
    """What a session reads of the daemon's pservers' link
    (:class:`hetd.server.pserver_link.HeadLink`)."""

    @property
    def parts(self) -> PartsWait:
        """Pushes held until every pserver holds its part."""

    @property
    def ready(self) -> asyncio.Event:
        """Set once every pserver said where it takes parts."""


class Outbox:
    """Frames waiting for one worker: the engine's :class:`hetd.core.engine.Peer` for its session.
    A full ``params`` frame replaces the parameter frames queued before it; too many frames mean
    the worker is stuck.

    A parameter frame pins the snapshot it was packed from for as long as something holds it, so
    the outbox holds at most one: the one being written. A full frame handed over while another
    parameter frame is still being written (a slow reader) is not queued: the outbox notes that
    a full frame is owed, drops the parameter frames after it (they build on it), and once the
    write ends calls :attr:`resend`, for which the engine sends the newest parameters in full
    (:meth:`hetd.core.engine.Engine.resend`). A slow reader therefore never pins more than the
    snapshot it is reading (docs/benchmark.md, the memory bound)."""

    def __init__(
        self, ws: web.WebSocketResponse, limit: int, cap: int = wire.DEFAULT_MAX_FRAME
    ) -> None:
        """``cap``: the frame cap; a larger frame goes out as ``chunk`` messages."""
        self._ws = ws
        self._limit = limit
        self._cap = cap
        self._frames: deque[tuple[bytes | memoryview, bool]] = deque()
        self._wake = asyncio.Event()
        self.closing: str | None = None
        self._writing_params = False  # a parameter frame is being written
        self._owed = False  # a full frame was handed over while one was written: resend owed
        # called once the write ends when a full frame is owed (None: queue it as it came)
        self.resend: Callable[[], None] | None = None
        # same-host shared memory agreed with this worker: full params frames go as references
        self.shm: ShmHub | None = None

    def send(self, reply: Reply) -> None:
        """Queue a control reply, encoded now; never blocks."""
        self._put(reply.encode(), params=False, full=False)

    def send_params(self, frame: bytes | memoryview, *, full: bool) -> None:
        """Queue an encoded ``params`` frame; never blocks. A ``full`` one makes every parameter
        frame still queued before it useless, so they are dropped (deltas must all arrive, in
        order)."""
        if self.resend is not None and (self._owed or (full and self._writing_params)):
            if self.closing is None:  # the owed full frame replaces this one and all before it
                self._frames = deque(f for f in self._frames if not f[1])
                self._owed = True
            return
        if full and self.shm is not None:
            ref = self.shm.publish(frame, id(self))  # written once for every same-host worker
            if ref is not None:
                frame = ref
        self._put(frame, params=True, full=full)

    def send_frame(self, frame: bytes) -> None:
        """Queue a session's own control frame (already encoded); never blocks."""
        self._put(frame, params=False, full=False)

    def send_relayed(self, frame: bytes) -> None:
        """Queue an ``act``/``gact`` frame from another worker, as it came; a worker that lets
        :data:`RELAY_SLACK` more frames than its limit pile up is stuck and is closed."""
        if self.closing is not None:
            return
        self._frames.append((frame, False))
        if len(self._frames) > self._limit + RELAY_SLACK:
            self.close("outbox overflow: the worker does not read its relayed frames")
        self._wake.set()

    def send_error(self, code: str, message: str, id_: int = 0) -> None:
        """Queue an ``error`` reply to a frame the session refused."""
        self._put(wire.error_frame(code, message, id_), params=False, full=False)

    def _put(self, frame: bytes | memoryview, *, params: bool, full: bool) -> None:
        if self.closing is not None:
            return
        if full:
            self._frames = deque(f for f in self._frames if not f[1])
        self._frames.append((frame, params))
        if len(self._frames) > self._limit:
            self.close("outbox overflow: the worker does not read its replies")
        self._wake.set()

    def close(self, reason: str) -> None:
        """Close the socket after what is queued (from any task)."""
        if self.closing is None:
            self.closing = reason
        self._wake.set()

    async def run(self) -> None:
        """Send queued frames in order until closed."""
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._frames:
                frame, params = self._frames.popleft()
                self._writing_params = params
                try:
                    for piece in wire.chunks(frame, self._cap):  # the frame itself when it fits
                        # (a view of the shared-memory ring goes as it is: aiohttp takes any
                        # bytes-like object, though it is annotated bytes)
                        await self._ws.send_bytes(cast(bytes, piece))
                finally:
                    self._writing_params = False
                    # hold no frame (no snapshot) while idle
                    frame = piece = b""
                if self._owed and self.resend is not None and self.closing is None:
                    self._owed = False
                    self.resend()
            if self.closing is not None:
                await self._ws.close(
                    code=WSCloseCode.GOING_AWAY, message=self.closing.encode()[:120]
                )
                return


def message_cap(engine: Engine, cap: int) -> int:
    """The largest message a worker may send in ``chunk`` messages: a float32 update of the whole
    model with room for its envelope (never below the frame cap)."""
    shapes = engine.store.shapes
    return max(cap, 4 * engine.store.n_params + (1 << 20) + 1024 * len(shapes))


@dataclass(frozen=True, slots=True)
class Relayed:
    """An ``act``/``gact`` frame: its checked header and its bytes as they came."""

    msg: wire.Message
    frame: bytes


def _decode(
    engine: Engine,
    wid: int | None,
    data: bytes,
    cap: int,
    parts: wire.Reassembler,
    uplink: Uplink | None = None,
) -> wire.Message | PushIn | Relayed | None:
    """A frame as a message, as a validated push once the worker is known, or as a frame to
    relay; None for a chunk of a message not yet complete (``parts`` gathers them). A
    ``push_ref`` is read from the worker's shared memory (``uplink``) and checked as a push."""
    msg = wire.decode(data, cap)
    if msg.type == "push_ref":
        if uplink is None or wid is None:
            raise wire.ProtocolError(
                "unexpected", f"push_ref {msg.id}: no shared memory was agreed", msg.id
            )
        msg, size = uplink.read_push(msg, parts.max_bytes)
        if msg.get("stage") is not None:
            raise wire.ProtocolError("malformed", "a stage slice goes over the socket", msg.id)
        return _checked_push(engine, wid, msg, size)
    if msg.type == "chunk":
        whole = parts.feed(msg)
        if whole is None:
            return None
        data = whole
        msg = wire.decode(data, parts.max_bytes)
        if msg.type == "chunk":
            raise wire.ProtocolError("malformed", "a chunk may not carry another chunk")
    if wid is not None and (msg.type in ("act", "gact") or msg.get("stage") is not None):
        return Relayed(msg, data)  # relayed, or a stage's slice of a replica step (a push)
    if msg.type == "push" and wid is not None:
        return _checked_push(engine, wid, msg, len(data))
    return msg


def _checked_push(engine: Engine, wid: int, msg: wire.Message, size: int) -> PushIn:
    # The update's norm is only the guard's: with the guard off an int8 push is not scanned
    # for it (0.2-0.4 ms per 1M parameters here; its scale proves it finite).
    guarded = engine.config.guard_factor > 0
    try:
        if not engine.store.holds_params:  # the pservers take the tensors
            return decode_header(wid, msg, size)
        return decode_push(engine.store.shapes, wid, msg, size, fused=True, norm=guarded)
    except wire.ProtocolError as exc:
        raise wire.ProtocolError(exc.code, exc.message, msg.id) from None
    except Exception as exc:  # whatever else a hostile frame provokes: refused, not fatal
        raise wire.ProtocolError("malformed", f"push: {exc}", msg.id) from None


async def handle(
    request: web.Request,
    engine: Engine,
    token: str,
    cap: int,
    limit: int,
    relay: Relay | None = None,
    hub: ShmHub | None = None,
    budget: DecodeBudget | None = None,
    pservers: PserverGate | None = None,
) -> web.StreamResponse:
    """The websocket endpoint ``/v1/ws``; ``relay`` forwards pipeline stages' ``act``/``gact``
    frames (None: they are refused); ``hub``: shared memory for same-host workers that ask for
    it (None: sockets only); ``budget``: the daemon's bound on decodes at once (None: none);
    ``pservers``: the daemon's pservers' link, where pushes wait for their parts (None: it runs
    none)."""
    if not authorized(request, token):
        return web.Response(
            status=401, text="missing or wrong worker token (Authorization: Bearer)"
        )
    ws = web.WebSocketResponse(max_msg_size=cap, compress=False)
    await ws.prepare(request)
    outbox = Outbox(ws, limit, cap)
    writer = asyncio.create_task(outbox.run())
    parts = wire.Reassembler(message_cap(engine, cap))
    wid: int | None = None
    uplink: Uplink | None = None
    reason = "connection closed"
    try:
        async for frame in ws:
            if frame.type == WSMsgType.ERROR:
                exc = ws.exception()
                too_big = getattr(exc, "code", None) == WSCloseCode.MESSAGE_TOO_BIG
                reason = (
                    f"frame over the {cap}-byte cap (1009)" if too_big else f"socket error: {exc}"
                )
                break
            if frame.type != WSMsgType.BINARY:
                outbox.send_error("malformed", "send binary msgpack frames only")
                continue
            data: bytes = frame.data
            try:
                if len(data) + parts.pending > OFF_LOOP_BYTES or (
                    uplink is not None and len(data) < 256
                ):  # (a small frame from a shared-memory worker may name a big push)
                    held = len(data) + parts.pending
                    async with budget.hold(held) if budget else contextlib.nullcontext():
                        item = await asyncio.to_thread(
                            _decode, engine, wid, data, cap, parts, uplink
                        )
                else:
                    item = _decode(engine, wid, data, cap, parts)
            except wire.ProtocolError as exc:
                log.info("worker %s: %s: %s", wid, exc.code, exc.message)
                outbox.send_error(exc.code, exc.message, exc.id)
                continue
            if item is None:  # a chunk: the rest of its message is still to come
                continue
            if isinstance(item, PushIn):
                if pservers is not None:  # decided once every pserver holds its part
                    pservers.parts.hold(item)
                else:
                    engine.queue.submit(cmd.Push(item))
                continue
            if isinstance(item, Relayed) and item.msg.type == "push":
                if relay is None or relay.on_part is None or wid is None:
                    outbox.send_error(
                        "unexpected",
                        "push: this daemon takes no pipeline stage slices",
                        item.msg.id,
                    )
                else:
                    try:
                        relay.on_part(wid, item.msg)
                    except Exception as exc:  # a bug there must not end the session
                        log.exception("worker %s: stage slice not taken", wid)
                        outbox.send_error("internal", f"stage slice not taken: {exc}", item.msg.id)
                continue
            if isinstance(item, Relayed):
                try:
                    if relay is None or wid is None:  # (_decode relays only for a known worker)
                        raise NoRoute("no_route", "this daemon relays no pipeline frames")
                    relayed = read(item.msg)  # (act or gact: _decode relays nothing else)
                    if not isinstance(relayed, Act):
                        raise NoRoute("no_route", f"{relayed.type} is not relayed")
                    relay.forward(wid, relayed, item.frame)
                except NoRoute as exc:
                    log.info("worker %s: %s: %s", wid, exc.code, exc.message)
                    outbox.send_error(exc.code, exc.message, item.msg.id)
                continue
            msg = item
            if wid is None:
                if msg.type != "hello":
                    outbox.send_error("no_hello", "send hello first", msg.id)
                    continue
                try:
                    hello = decode_hello(msg, same_host=is_loopback(request.remote))
                    if pservers is not None:
                        if PSERVERS_FEATURE not in hello.features:
                            outbox.send_error("unsupported", NO_PARTS, msg.id)
                            reason = "a worker that sends no parts to the pservers"
                            break
                        if not engine.store.holds_params and not HEADERS.issubset(hello.features):
                            outbox.send_error("unsupported", NO_HEADERS, msg.id)
                            reason = "a worker that sends whole pushes to a head of headers"
                            break
                        await _pservers_ready(pservers)
                    # The relay routes to the worker before the policy hears of its join: a
                    # policy that puts it in a replica at once reaches it (the stage frames
                    # queue behind its welcome).
                    route = None if relay is None else partial(relay.attach, sink=outbox)
                    wid = await engine.queue.call(
                        partial(engine.handle, cmd.Join(hello, outbox, route))
                    )
                    outbox.resend = partial(engine.queue.submit, cmd.Resend(wid, outbox))
                    if hub is not None and hello.same_host and offers_shm(read(msg)):
                        size = shm_slot_bytes(engine)  # (the ring takes its memory: a thread)
                        ring = await asyncio.to_thread(hub.offer, size)
                        if ring is not None:
                            outbox.send_frame(ShmOffer(ring.name).encode())
                except codecs.CodecError as exc:
                    outbox.send_error("no_codec", str(exc), msg.id)
                    reason = "no usable codec"
                    break
                continue
            if msg.type not in WORKER_SENDS:  # (never read: nothing of it is the daemon's)
                outbox.send_error("unexpected", f"{msg.type} is a daemon-to-worker message", msg.id)
                continue
            try:
                typed = read(msg)  # (a push or a relayed frame took another way above)
            except wire.ProtocolError as exc:
                outbox.send_error(exc.code, clip(exc.message), msg.id)
                continue
            if isinstance(typed, Heartbeat):
                engine.queue.submit(cmd.Heartbeat(wid))
            elif isinstance(typed, Pull):
                engine.queue.submit(cmd.Pull(wid, typed.have))
            elif isinstance(typed, Bye):  # (cut: the log, the engine's departures, the dashboard)
                reason = clip(typed.reason or "bye")
                break
            elif isinstance(typed, ShmReady) and hub is not None and uplink is None:
                try:
                    uplink = Uplink(hub, typed.nonce, typed.segment)
                except shm.ShmError as exc:
                    log.info("worker %s: no shared memory: %s", wid, clip(exc.message))
                    outbox.send_error(exc.code, clip(exc.message), msg.id)
                    continue
                outbox.shm = hub
                if wid is not None:  # snapshots are packed into the ring from then on
                    engine.queue.submit(cmd.Transport(wid, outbox, "shm", sink=hub))
                log.info(
                    "worker %s: shared memory on (rings %s, %s)",
                    wid,
                    hub.ring and hub.ring.name,
                    typed.segment,
                )
            elif isinstance(typed, ProfileResult):
                engine.queue.submit(cmd.ProfileResult(wid, dict(typed.result)))
            elif isinstance(typed, Hello):
                outbox.send_error("malformed", "hello was already received", msg.id)
            else:
                outbox.send_error("unexpected", f"{msg.type} is a daemon-to-worker message", msg.id)
    finally:
        reason = outbox.closing or reason  # the daemon's own reason, when it closed first
        if outbox.shm is not None:
            outbox.shm.release(id(outbox))
            outbox.shm = None
        if uplink is not None:
            uplink.close()
        if wid is not None:
            if relay is not None:
                relay.detach(wid, outbox)
            engine.queue.submit(cmd.Leave(wid, reason, outbox))
        outbox.close(reason)
        with contextlib.suppress(asyncio.TimeoutError, Exception):
            await asyncio.wait_for(writer, 2.0)
        writer.cancel()
        await ws.close()
    return ws


PSERVERS_FEATURE = "pservers"  # a worker that sends its pushes' parts to the pservers
NO_PARTS = (
    "this daemon runs pservers: its workers send each push's parts to them, which this "
    "hetd-worker does not do; run a hetd-worker of the daemon's release"
)
# a head that takes push headers only: its workers send those and pull every release
HEADERS = frozenset({"headers", "pulls"})
NO_HEADERS = (
    "this daemon's pservers hold the parameters ([pservers] headers = true): its workers send "
    "the daemon each push's header only and pull their parameters from the pservers, which "
    "this hetd-worker does not do; run a hetd-worker of the daemon's release"
)
PSERVERS_WAIT_LOG_S = 10.0  # s a hello waits for the pservers before the daemon says so


async def _pservers_ready(link: PserverGate) -> None:
    """Wait until every pserver said where it takes parts (the welcome names them)."""
    while True:
        try:
            await asyncio.wait_for(link.ready.wait(), PSERVERS_WAIT_LOG_S)
            return
        except TimeoutError:
            log.warning("a worker's hello waits for the pservers to connect to the link")


def shm_slot_bytes(engine: Engine) -> int:
    """A shared-memory slot: one full float32 frame of the model (codec ``none``, with its
    hash), with room for the envelope and each tensor's header."""
    shapes = engine.store.shapes
    return 4 * engine.store.n_params + 4096 + sum(len(p) + 256 for p in shapes)


def offers_shm(hello: Typed) -> bool:
    """Whether a hello names shared memory among its features."""
    return isinstance(hello, Hello) and shm.FEATURE in hello.features
