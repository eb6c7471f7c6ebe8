"""One session per worker websocket: authenticate, decode frames into engine commands, and keep a
bounded outbox so that a slow worker never stalls the engine or the others.

Everything a worker sends is checked here before it reaches the engine: the frame (wire.decode),
the tensors' paths, shapes and codecs (codecs.decode_tree) and their finiteness. A bad frame gets an
``error`` reply and is forgotten; nothing of it is applied.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import time
from collections import deque
from collections.abc import Mapping
from functools import partial
from typing import Any

import numpy as np
from aiohttp import WSCloseCode, WSMsgType, web

from hetd.codecs import registry as codecs
from hetd.codecs.tensor import (
    check_fields,
    read_bytes,
    read_choice,
    read_scales,
    read_shape,
    size_of,
)
from hetd.config import is_loopback
from hetd.core.engine import Engine, PushIn
from hetd.core.store import Int8, Update
from hetd.protocol import wire

log = logging.getLogger("hetd.server.sessions")

OFF_LOOP_BYTES = 256 * 1024  # frames larger than this are decoded in a worker thread
MAX_INT8_SCALE = float(np.finfo(np.float32).max) / 128  # above it, q * scale may overflow


def authorized(request: web.Request, token: str) -> bool:
    """``Authorization: Bearer <token>`` matches (an empty configured token admits everyone)."""
    if not token:
        return True
    got = request.headers.get("Authorization", "")
    return hmac.compare_digest(got.encode(), f"Bearer {token}".encode())


class Outbox:
    """Frames waiting for one worker. A full ``params`` frame replaces the parameter frames queued
    before it; too many frames mean the worker is stuck."""

    def __init__(self, ws: web.WebSocketResponse, limit: int) -> None:
        self._ws = ws
        self._limit = limit
        self._frames: deque[tuple[bytes, bool]] = deque()
        self._wake = asyncio.Event()
        self.closing: str | None = None

    def send(self, frame: bytes, *, params: bool = False, full: bool = False) -> None:
        """Queue a frame; never blocks. A ``full`` parameter frame makes every parameter frame
        still queued before it useless, so they are dropped (deltas must all arrive, in order)."""
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
                frame, _ = self._frames.popleft()
                await self._ws.send_bytes(frame)
            if self.closing is not None:
                await self._ws.close(
                    code=WSCloseCode.GOING_AWAY, message=self.closing.encode()[:120]
                )
                return


def decode_push(
    engine: Engine, wid: int, msg: wire.Message, nbytes: int, *, fused: bool = False
) -> PushIn:
    """Validate a push's tensors against the model; raises ProtocolError saying what is wrong.

    ``fused`` (the daemon's sessions): an ``int8`` tensor with one scale is checked as strictly
    as :func:`hetd.codecs.registry.decode_tensor` would, but kept as :class:`hetd.core.store.Int8` (a view of
    the frame) for the jitted step to dequantize: no float32 copy is written or scanned.
    """
    wire_tensors = msg["tensors"]
    shapes = engine.store.shapes
    tensors: dict[str, Update] = {}
    try:
        if fused and isinstance(wire_tensors, dict) and set(wire_tensors) == set(shapes):
            for path, t in wire_tensors.items():
                view = int8_view(t, path, shapes[path])
                if view is not None:
                    tensors[path] = view
        rest = {p: t for p, t in wire_tensors.items() if p not in tensors}
        decoded = codecs.decode_tree(rest, {p: shapes[p] for p in shapes if p not in tensors})
    except codecs.CodecError as exc:
        raise wire.ProtocolError("bad_tensor", str(exc)) from None
    for path, t in decoded.items():
        if not np.isfinite(t).all():
            raise wire.ProtocolError("not_finite", f"tensor {path!r} holds NaN or Inf; not applied")
    tensors.update(decoded)
    return PushIn(
        worker=wid,
        id=msg.id,
        base=msg["base"],
        kind=msg["kind"],
        tensors=tensors,
        samples=msg["samples"],
        steps=msg["steps"],
        compute_s=float(msg["compute_s"]),
        loss=None if msg.get("loss") is None else float(msg["loss"]),
        free_mem=msg.get("free_mem"),
        nbytes=nbytes,
        transfer_s=_transfer_s(msg.get("sent_at")),
        idle_s=None if msg.get("idle_s") is None else float(msg["idle_s"]),
    )


def int8_view(t: Any, path: str, shape: tuple[int, ...]) -> Int8 | None:
    """``t`` as :class:`Int8` when it is an ``int8`` tensor with one scale (``block`` 0), checked
    field by field like the ``int8`` decoder; None for any other codec or block (decoded as
    usual). A scale that would make ``127 * scale`` overflow is refused as non-finite."""
    if not isinstance(t, Mapping) or t.get("codec") != "int8" or type(t.get("block")) is not int:
        return None
    if t["block"] != 0:
        return None
    try:
        check_fields(t, "int8", ("bits", "block", "scales", "data"))
        if t.get("dtype") != "float32":
            raise codecs.CodecError(f"dtype {t.get('dtype')!r} is not 'float32'")
        got = read_shape(t)
        if got != tuple(shape):
            raise codecs.CodecError(f"shape {list(got)} does not match the expected {list(shape)}")
        read_choice(t, "bits", "int8", (8,))
        scale = read_scales(t, "int8", 1)[0]
        data = read_bytes(t, "data", "int8", size_of(got))
    except codecs.CodecError as exc:
        raise codecs.CodecError(f"tensor {path!r}: {exc}") from None
    if not scale <= MAX_INT8_SCALE:
        raise wire.ProtocolError("not_finite", f"tensor {path!r} holds NaN or Inf; not applied")
    return Int8(np.frombuffer(data, dtype=np.int8).reshape(got), np.float32(scale))


def _transfer_s(sent_at: float | None) -> float | None:
    """Send-to-receipt seconds from the worker's wall-clock stamp; None when the clocks disagree
    too much to trust it (workers on other hosts without synchronised clocks)."""
    if sent_at is None:
        return None
    dt = time.time() - sent_at
    return dt if 0.0 < dt < 60.0 else None


def _decode(engine: Engine, wid: int | None, data: bytes, cap: int) -> wire.Message | PushIn:
    """A frame as a message, or as a validated push once the worker is known."""
    msg = wire.decode(data, cap)
    if msg.type == "push" and wid is not None:
        try:
            return decode_push(engine, wid, msg, len(data), fused=True)
        except wire.ProtocolError as exc:
            raise wire.ProtocolError(exc.code, exc.message, msg.id) from None
        except Exception as exc:  # whatever else a hostile frame provokes: refused, not fatal
            raise wire.ProtocolError("malformed", f"push: {exc}", msg.id) from None
    return msg


async def handle(
    request: web.Request, engine: Engine, token: str, cap: int, limit: int
) -> web.StreamResponse:
    """The websocket endpoint ``/v1/ws``."""
    if not authorized(request, token):
        return web.Response(
            status=401, text="missing or wrong worker token (Authorization: Bearer)"
        )
    ws = web.WebSocketResponse(max_msg_size=cap, compress=False)
    await ws.prepare(request)
    outbox = Outbox(ws, limit)
    writer = asyncio.create_task(outbox.run())
    wid: int | None = None
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
                outbox.send(wire.error_frame("malformed", "send binary msgpack frames only"))
                continue
            data: bytes = frame.data
            try:
                if len(data) > OFF_LOOP_BYTES:
                    item = await asyncio.to_thread(_decode, engine, wid, data, cap)
                else:
                    item = _decode(engine, wid, data, cap)
            except wire.ProtocolError as exc:
                log.info("worker %s: %s: %s", wid, exc.code, exc.message)
                outbox.send(wire.error_frame(exc.code, exc.message, exc.id))
                continue
            if isinstance(item, PushIn):
                engine.submit(partial(engine.push, item))
                continue
            msg = item
            if wid is None:
                if msg.type != "hello":
                    outbox.send(wire.error_frame("no_hello", "send hello first", msg.id))
                    continue
                try:
                    wid = await engine.call(
                        partial(engine.join, msg, outbox, is_loopback(request.remote))
                    )
                except codecs.CodecError as exc:
                    outbox.send(wire.error_frame("no_codec", str(exc), msg.id))
                    reason = "no usable codec"
                    break
                continue
            if msg.type == "heartbeat":
                engine.submit(partial(engine.heartbeat, wid))
            elif msg.type == "pull":
                engine.submit(partial(engine.pull, wid, msg.get("have")))
            elif msg.type == "bye":
                reason = msg.get("reason") or "bye"
                break
            elif msg.type == "profile_result":
                engine.submit(partial(engine.profile_result, wid, msg["result"]))
            elif msg.type == "hello":
                outbox.send(wire.error_frame("malformed", "hello was already received", msg.id))
            else:
                outbox.send(
                    wire.error_frame(
                        "unexpected", f"{msg.type} is a daemon-to-worker message", msg.id
                    )
                )
    finally:
        reason = outbox.closing or reason  # the daemon's own reason, when it closed first
        if wid is not None:
            engine.submit(partial(engine.leave, wid, reason))
        outbox.close(reason)
        with contextlib.suppress(asyncio.TimeoutError, Exception):
            await asyncio.wait_for(writer, 2.0)
        writer.cancel()
        await ws.close()
    return ws
