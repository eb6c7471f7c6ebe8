"""The pservers' frames on a plain non-blocking socket, read and written with the event loop's
socket calls (``sock_recv_into``, ``sock_sendall``).

The bulk of the pservers' traffic is large frames: a push's part (16 MB at 32M int8 parameters and
two pservers) and a pulled slice (64 MB). Through asyncio's streams each such frame is copied
three or four times in user space on its way in (the kernel's bytes in 256 KB objects, appended to
the reader's buffer, cut out of it) and once on its way out (whatever the socket does not take at
once goes into the transport's buffer); measured on loopback, sender and receiver in one process,
about 220 ms of CPU per 64 MB frame against 30 ms here, where:

* a frame's body is read straight into one buffer (``recv_into``), kept by the socket and reused
  for the next large frame (fresh memory would cost its page faults, about as much as a copy);
* a write hands the caller's buffers to the kernel as they are, waiting for the socket to take
  them (no transport buffer in between).

The wire is the same (:mod:`hetd.protocol.pslink`: a 4-byte big-endian length and a msgpack map):
a peer that speaks it through streams talks to one that uses this module.

One reader and one writer at a time per socket (each pserver connection answers one request at a
time; each of a worker's connections sends one request at a time).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import sys
from collections.abc import Awaitable, Callable
from typing import Any

from hetd.protocol.pslink import MAX_FRAME, FrameError, pack, unpack

log = logging.getLogger("hetd.protocol.sockframes")

SCRATCH = 1 << 16  # a frame up to this size is read through a small buffer, with what follows it
JOIN = 1 << 16  # segments under this size are joined into one write
SKIM = 1 << 20  # a skimmed frame is read this much at a time
FIRST = 1 << 20  # a large frame's buffer starts this big and doubles as its bytes come


class FrameSocket:
    """Length-prefixed frames on one connected socket."""

    def __init__(self, sock: socket.socket) -> None:
        sock.setblocking(False)
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock = sock
        self._loop = asyncio.get_running_loop()
        self._scratch = bytearray(SCRATCH)
        self._lo = self._hi = 0  # bytes read ahead: scratch[lo:hi]
        self._big: bytearray | None = None  # the large frames' buffer
        self.allocated = 0  # large buffers taken (one, unless a caller keeps frames)
        self._skim: bytearray | None = None  # what skim reads through
        self._ops = 0  # reads and writes under way
        self.closed = False

    @classmethod
    async def connect(cls, host: str, port: int) -> FrameSocket:
        """A connection to ``host:port`` (the first address of it that answers)."""
        loop = asyncio.get_running_loop()
        infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        error: OSError = OSError(f"no address for {host}:{port}")
        for family, kind, proto, _, addr in infos:
            sock = socket.socket(family, kind, proto)
            sock.setblocking(False)
            try:
                await loop.sock_connect(sock, addr)
            except OSError as exc:
                sock.close()
                error = exc
                continue
            except BaseException:
                sock.close()
                raise
            return cls(sock)
        raise error

    # --- reading --------------------------------------------------------------------------------

    async def recv(self, max_bytes: int = MAX_FRAME) -> memoryview:
        """The next frame's body. A large one (over :data:`SCRATCH`) is a view of this socket's
        buffer, which a later call reads into again only once nothing refers to it any more:
        while that view, a slice of it or an array over it (``np.frombuffer``) lives, the
        buffer is its holder's and the next large frame gets a new one.
        :class:`FrameError` for a frame over ``max_bytes``; ``asyncio.IncompleteReadError``
        when the peer closes mid-frame or before one."""
        self._ops += 1
        try:
            n = await self._length(max_bytes)
            if n <= SCRATCH:
                await self._ahead(n)
                body = bytes(self._scratch[self._lo : self._lo + n])
                self._lo += n
                return memoryview(body)
            big = self._reusable(n)
            got = self._hi - self._lo  # (under SCRATCH < n: all of it is this frame's)
            if big is None:  # grown as the bytes come: a length alone reserves no memory
                big = bytearray(min(n, max(FIRST, 2 * got)))
                self.allocated += 1
            big[:got] = self._scratch[self._lo : self._hi]
            self._lo = self._hi = 0
            while got < n:
                if got == len(big):
                    grown = bytearray(min(n, 2 * len(big)))
                    grown[:got] = big  # (the first frame of a size only: the next reuses it)
                    big = grown
                k = await self._loop.sock_recv_into(self.sock, memoryview(big)[got:n])
                if k == 0:
                    raise asyncio.IncompleteReadError(b"", n - got)
                got += k
            self._big = big
            return memoryview(big)[:n]
        finally:
            self._done()

    async def skim(self, keep: int, max_bytes: int = MAX_FRAME) -> tuple[int, bytes]:
        """The next frame's size and its first ``keep`` bytes; the rest is read and let go
        through a buffer of :data:`SKIM` bytes (a large frame is never held whole)."""
        self._ops += 1
        try:
            n = await self._length(max_bytes)
            take = min(n, self._hi - self._lo)
            head = bytes(self._scratch[self._lo : self._lo + min(take, keep)])
            self._lo += take
            left = n - take
            if self._skim is None:
                self._skim = bytearray(SKIM)
            while left:
                into = memoryview(self._skim)[: min(left, SKIM)]
                k = await self._loop.sock_recv_into(self.sock, into)
                if k == 0:
                    raise asyncio.IncompleteReadError(b"", left)
                if len(head) < keep:
                    head += bytes(into[: min(k, keep - len(head))])
                left -= k
            return n, head
        finally:
            self._done()

    async def recv_msg(self, max_bytes: int = MAX_FRAME) -> dict[str, Any]:
        """The next frame as a message (:func:`hetd.protocol.pslink.unpack`)."""
        return unpack(await self.recv(max_bytes))

    async def _length(self, max_bytes: int) -> int:
        """The next frame's length prefix, read; :class:`FrameError` over ``max_bytes``."""
        await self._ahead(4)
        n = int.from_bytes(self._scratch[self._lo : self._lo + 4], "big")
        if n > max_bytes:
            raise FrameError(f"a frame of {n} bytes, over the limit of {max_bytes}")
        self._lo += 4
        return n

    async def _ahead(self, k: int) -> None:
        """At least ``k`` (at most :data:`SCRATCH`) unread bytes in the small buffer."""
        if self._hi - self._lo >= k:
            return
        if self._lo:
            left = self._hi - self._lo
            self._scratch[:left] = self._scratch[self._lo : self._hi]
            self._lo, self._hi = 0, left
        while self._hi < k:
            got = await self._loop.sock_recv_into(self.sock, memoryview(self._scratch)[self._hi :])
            if got == 0:
                raise asyncio.IncompleteReadError(bytes(self._scratch[: self._hi]), k)
            self._hi += got

    def _reusable(self, n: int) -> bytearray | None:
        """The large frames' buffer when it holds ``n`` bytes and nothing refers to it."""
        # A view of the buffer (and so anything over it: a numpy array's base is the view)
        # holds a reference to it: two references are this attribute's and the call's own.
        if self._big is None or len(self._big) < n or sys.getrefcount(self._big) > 2:
            return None
        return self._big

    # --- writing --------------------------------------------------------------------------------

    async def send(self, *segments: bytes | bytearray | memoryview) -> None:
        """Write ``segments`` in order, as one frame or several; returns once the kernel took
        them all. Large segments are not copied: they must not change until this returns."""
        self._ops += 1
        try:
            small = bytearray()
            for seg in segments:
                size = seg.nbytes if isinstance(seg, memoryview) else len(seg)
                if size < JOIN:
                    small += seg
                    continue
                if small:
                    await self._loop.sock_sendall(self.sock, small)
                    small = bytearray()
                await self._loop.sock_sendall(self.sock, seg)
            if small:
                await self._loop.sock_sendall(self.sock, small)
        finally:
            self._done()

    async def send_msg(self, kind: str, **fields: Any) -> None:
        """One message (:func:`hetd.protocol.pslink.pack`)."""
        await self.send(pack(kind, **fields))

    # --- closing --------------------------------------------------------------------------------

    def close(self) -> None:
        """Close the connection. A read or write under way ends (with an error) first: its
        socket is shut down now and closed when it has."""
        if self.closed:
            return
        self.closed = True
        if self._ops:
            with contextlib.suppress(OSError):
                self.sock.shutdown(socket.SHUT_RDWR)
        else:
            self.sock.close()

    def _done(self) -> None:
        self._ops -= 1
        if self.closed and not self._ops:
            self.sock.close()


Handler = Callable[[FrameSocket], Awaitable[None]]


class FrameServer:
    """A listening socket whose connections are each handed to ``handler`` (in a task of its
    own; the handler closes its socket)."""

    def __init__(self, sock: socket.socket, handler: Handler) -> None:
        sock.setblocking(False)
        self.sock = sock
        self.handler = handler
        self.port = int(sock.getsockname()[1])
        self._conns: set[asyncio.Task[None]] = set()
        self._accepting = asyncio.get_running_loop().create_task(self._accept())
        # (closed once the accept under way has let go of it: see FrameSocket.close)
        self._accepting.add_done_callback(lambda _: sock.close())

    @classmethod
    async def start(cls, handler: Handler, host: str, port: int) -> FrameServer:
        """Listen on ``host:port`` (its first address; port 0: one the kernel picks); OSError
        when it cannot."""
        loop = asyncio.get_running_loop()
        infos = await loop.getaddrinfo(
            host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
        family, _, _, _, addr = infos[0]
        sock = socket.create_server(addr, family=family, backlog=128)
        return cls(sock, handler)

    async def _accept(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                conn, _ = await loop.sock_accept(self.sock)
            except OSError as exc:  # out of file descriptors, say: not the end of listening
                log.warning("accepting a connection: %s", exc)
                await asyncio.sleep(0.1)
                continue
            task = loop.create_task(self._serve(conn))
            self._conns.add(task)
            task.add_done_callback(self._conns.discard)

    async def _serve(self, conn: socket.socket) -> None:
        fs = FrameSocket(conn)
        try:
            await self.handler(fs)
        finally:
            fs.close()

    def close(self) -> None:
        """Stop listening and end every connection (the port is free once
        :meth:`wait_closed` returns)."""
        self._accepting.cancel()
        for task in list(self._conns):
            task.cancel()

    async def wait_closed(self) -> None:
        """Return once the listening socket and every connection are closed."""
        await asyncio.gather(self._accepting, *self._conns, return_exceptions=True)
