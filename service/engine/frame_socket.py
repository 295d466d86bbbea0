"""The engine's messages to a front end over a Unix stream socket of their own, one length-prefixed frame each.

ZeroMQ's PUSH/PULL hands every message through an I/O thread on either side, two wake-ups, before the front end's
event loop sees it. Over `ipc://` that hop took p50 89 / p99 146 µs on the H100 host (e2e-s98), and p50 121-164 / p99
269-928 µs on the 2-core VM. A token's gap to the next is a step plus the difference of two such hops, so the
inter-token tail was that jitter (issue 37). Here the engine's thread writes into the kernel's buffer itself, and the
front end's event loop reads when the socket turns readable: p50 33-45 / p99 87-178 µs on the same VM, in the same
runs (`python -m bench token-hop`, bench/results/token-hop-vm-s99.md). The front end's
messages to the engine stay on ZeroMQ (service/engine/ipc.py): they wake a thread that polls anyway.

The engine never blocks on a front end: the socket is non-blocking, and what the kernel's buffer cannot take now (a
front end that stopped reading) waits in a queue of its own, in order, sent before anything newer by the next send (the
heartbeat's at the latest), as ZeroMQ's unbounded queue did. A front end that is gone is dropped; it connects again by
saying Hello.
"""

from __future__ import annotations

import asyncio
import socket
import struct
import time
from collections import deque
from collections.abc import Callable

HEADER = struct.Struct("<I")  # a frame's length, before it
READ_BYTES = 1 << 16


def unix_address(address: str) -> str:
    """A socket name as ipc.Addresses writes it (`@name`: Linux's abstract namespace) as socket.bind takes it."""
    return "\0" + address[1:] if address.startswith("@") else address


class FrameSender:
    """The engine's end: a connected socket, written without blocking, what it could not take queued in order. Not
    thread-safe: the engine service sends under its lock."""

    def __init__(self, sock: socket.socket) -> None:
        sock.setblocking(False)
        self._sock = sock
        self._backlog: deque[memoryview] = deque()
        self.closed = False

    @classmethod
    def connect(cls, address: str) -> FrameSender:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(unix_address(address))
        except OSError:
            sock.close()
            raise
        return cls(sock)

    @property
    def waiting(self) -> int:
        """Frames (or what is left of one) the front end has not taken yet."""
        return len(self._backlog)

    def send(self, frame: bytes) -> None:
        if self.closed:
            return
        self._backlog.append(memoryview(HEADER.pack(len(frame)) + frame))
        self.flush()

    def flush(self) -> None:
        """As much of the queue as the socket takes now."""
        while self._backlog and not self.closed:
            head = self._backlog[0]
            try:
                sent = self._sock.send(head)
            except BlockingIOError:
                return
            except OSError:  # the front end is gone (EPIPE, ECONNRESET): nobody reads what is queued
                self.close()
                return
            if sent < len(head):
                self._backlog[0] = head[sent:]
                return
            self._backlog.popleft()

    def close(self) -> None:
        self.closed = True
        self._backlog.clear()
        self._sock.close()


class FrameReader:
    """The front end's end: a socket bound before it says Hello, which the engine connects to; every frame that
    arrives is handed to `on_frame` with when it was read, on the event loop, all that is there before the loop runs
    anything else. `on_frame` may be replaced (connect's wait for Ready, then the client's dispatch)."""

    def __init__(self, address: str, on_frame: Callable[[bytes, float], None]) -> None:
        self.on_frame = on_frame
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(unix_address(address))
        self._listener.listen(1)
        self._listener.setblocking(False)
        self._conn: socket.socket | None = None
        self._buffer = bytearray()
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(self._listener.fileno(), self._accept)

    def _accept(self) -> None:
        try:
            conn, _ = self._listener.accept()
        except BlockingIOError:
            return
        self._drop_connection()  # an engine connects again only after this front end said Hello again
        conn.setblocking(False)
        self._conn = conn
        self._loop.add_reader(conn.fileno(), self._readable)

    def _readable(self) -> None:
        conn = self._conn
        if conn is None:
            return
        closed = False
        while True:
            try:
                data = conn.recv(READ_BYTES)
            except BlockingIOError:
                break
            except OSError:
                data = b""
            if not data:  # the engine closed it (or exited: its watchdog says so)
                closed = True
                break
            self._buffer += data
            if len(data) < READ_BYTES:
                break
        self._deliver(time.perf_counter())
        if closed:
            self._drop_connection()

    def _deliver(self, received: float) -> None:
        buffer, at = self._buffer, 0
        while len(buffer) - at >= HEADER.size:
            (n,) = HEADER.unpack_from(buffer, at)
            if len(buffer) - at - HEADER.size < n:
                break
            frame = bytes(buffer[at + HEADER.size:at + HEADER.size + n])
            at += HEADER.size + n
            self.on_frame(frame, received)
        del buffer[:at]

    def _drop_connection(self) -> None:
        if self._conn is not None:
            self._loop.remove_reader(self._conn.fileno())
            self._conn.close()
            self._conn = None
        self._buffer.clear()

    def close(self) -> None:
        self._drop_connection()
        self._loop.remove_reader(self._listener.fileno())
        self._listener.close()

