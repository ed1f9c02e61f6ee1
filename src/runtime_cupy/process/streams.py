"""Writing to a stream socket from a single-threaded event loop without blocking it.

``Outbox.write`` sends what the socket takes at once and keeps the rest; the loop then
waits for the socket to be writable (``wants_write``) and calls ``flush``. A peer that
stops reading for good shows as a backlog over ``limit`` bytes, which is reported as a
broken stream (``StreamBroken``) instead of a wait: nothing of a loop's time goes to a
peer that does not read. ``drain(timeout_s)`` is the one bounded blocking flush, for a
process about to exit.

``keep_alive(sock)`` makes the kernel notice a peer that went silent without a FIN (a
cut cable, a host gone): keepalive probes after ``KEEPALIVE_IDLE_S`` of silence, and a
connection whose data or probes stay unacknowledged for ``USER_TIMEOUT_MS`` is broken
(``ETIMEDOUT``, reported by ``poll`` as an error). So a silent peer is noticed within
``SILENT_PEER_S`` of its last sign of life.
"""

from __future__ import annotations

import contextlib
import select
import socket
import time

#: Bytes an outbox holds before the stream counts as broken (the peer does not read).
DEFAULT_LIMIT = 64 << 20
KEEPALIVE_IDLE_S = 1
KEEPALIVE_INTERVAL_S = 1
USER_TIMEOUT_MS = 5_000
#: A peer silent this long (no FIN, no acknowledgement) is noticed as gone.
SILENT_PEER_S = KEEPALIVE_IDLE_S + USER_TIMEOUT_MS / 1000.0 + 1.0


class StreamBroken(ConnectionError):
    """The peer is gone, or has not read for so long that the backlog outgrew its bound."""


def keep_alive(sock: socket.socket) -> None:
    """Keepalive probes and a bound on unacknowledged data (Linux; elsewhere what the
    platform offers), and no Nagle delay for the small frames of edges and control."""
    options = (
        (socket.SOL_SOCKET, "SO_KEEPALIVE", 1),
        (socket.IPPROTO_TCP, "TCP_KEEPIDLE", KEEPALIVE_IDLE_S),
        (socket.IPPROTO_TCP, "TCP_KEEPINTVL", KEEPALIVE_INTERVAL_S),
        (socket.IPPROTO_TCP, "TCP_KEEPCNT", 3),
        (socket.IPPROTO_TCP, "TCP_USER_TIMEOUT", USER_TIMEOUT_MS),
        (socket.IPPROTO_TCP, "TCP_NODELAY", 1),
    )
    for level, name, value in options:
        option = getattr(socket, name, None)
        if option is not None:
            sock.setsockopt(level, option, value)


class Outbox:
    """The bytes a non-blocking stream socket has not taken yet."""

    def __init__(self, sock: socket.socket, limit: int = DEFAULT_LIMIT) -> None:
        sock.setblocking(False)
        self.sock = sock
        self.limit = limit
        self._pending = bytearray()
        self.broken: str | None = None

    @property
    def wants_write(self) -> bool:
        return bool(self._pending)

    def write(self, data: bytes | bytearray | memoryview) -> None:
        """Send ``data`` after what is pending; ``StreamBroken`` if the peer is gone or
        the backlog would pass the limit."""
        if self._pending or self.broken is not None:
            self._write_after((data,))
            return
        try:
            sent = self.sock.send(data)
        except BlockingIOError:
            sent = 0
        except OSError as exc:
            self._break(f"send failed: {exc}")
        if sent != len(data):
            self._queue((data,), skip=sent)

    def write_parts(self, *parts: bytes | bytearray | memoryview) -> None:
        """``write`` of the parts joined (bytes, or views of bytes), in one system call
        and no copy."""
        if self._pending or self.broken is not None:
            self._write_after(parts)
            return
        try:
            sent = self.sock.sendmsg(parts)
        except BlockingIOError:
            sent = 0
        except OSError as exc:
            self._break(f"send failed: {exc}")
        if sent != sum(map(len, parts)):
            self._queue(parts, skip=sent)

    def _write_after(self, parts: tuple[bytes | bytearray | memoryview, ...]) -> None:
        if self.broken is not None:
            raise StreamBroken(self.broken)
        self._queue(parts)
        self.flush()

    def _queue(self, parts: tuple[bytes | bytearray | memoryview, ...], skip: int = 0) -> None:
        for part in parts:
            view = memoryview(part).cast("B")
            if skip >= len(view):
                skip -= len(view)
                continue
            self._pending += view[skip:]
            skip = 0
        if len(self._pending) > self.limit:
            self._break(f"the peer has not read {len(self._pending)} bytes")

    def _break(self, why: str) -> None:
        self.broken = why
        self._pending.clear()
        raise StreamBroken(why)

    def flush(self) -> None:
        """Send what the socket takes now (after the loop saw it writable)."""
        while self._pending:
            try:
                sent = self.sock.send(self._pending)
            except BlockingIOError:
                return
            except OSError as exc:
                self._break(f"send failed: {exc}")
            del self._pending[:sent]

    def drain(self, timeout_s: float) -> bool:
        """Block up to ``timeout_s`` to send everything pending; ``True`` if it went."""
        deadline = time.monotonic() + timeout_s
        poller = select.poll()
        with contextlib.suppress(OSError, ValueError):
            poller.register(self.sock.fileno(), select.POLLOUT)
        while self._pending:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            try:
                poller.poll(left * 1000.0)
                self.flush()
            except (StreamBroken, OSError, ValueError):
                return False
        return True
