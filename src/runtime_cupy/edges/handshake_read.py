"""Reading a handshake's messages off a socket within one bound for the whole handshake
(``HandshakeDeadline``), not one per read: a peer that trickles its bytes, one just
before each read's time would run out, gets no more time than one that sends none.

Every end that reads a handshake from a blocking socket reads it here: a slice's stage
and its server (``slices.protocol``), and a stage's supervisor opening its control
channel (``hosts.ray.control_link``). A server whose connections each have a thread of
their own waits for a HELLO without reading it (``await_message``), so that its door
can give the connection a last look (``peek_waiting``) before it turns it away."""

from __future__ import annotations

import select
import socket
import time
from collections.abc import Callable


class HandshakeTimeUp(TimeoutError):
    """The peer took more than the handshake's bound over it; the message names the
    bound and how much of the message it was sending had come."""


class HandshakeClosed(ConnectionError):
    """The peer closed the connection in the middle of the handshake."""


class HandshakeDeadline:
    """When a handshake of ``bound_s`` seconds, begun now, must be done."""

    def __init__(self, bound_s: float) -> None:
        self.bound_s = bound_s
        self.at = time.monotonic() + bound_s

    def left(self) -> float:
        return self.at - time.monotonic()

    def time_up(self, got: int, n: int) -> HandshakeTimeUp:
        return HandshakeTimeUp(
            f"the peer took more than {self.bound_s:g} s over its handshake "
            f"({got} of {n} bytes of a message came)"
        )


def read_message(
    sock: socket.socket,
    n: int,
    check: Callable[[bytes], None],
    deadline: HandshakeDeadline,
) -> bytes:
    """``n`` bytes from ``sock``, refused by ``check`` on the first bytes that prove them
    wrong (its first read takes one byte, so that garbage is refused at once);
    ``HandshakeTimeUp`` once ``deadline`` is past, however the bytes came until then,
    ``HandshakeClosed`` if the peer closes first. A ``TimeoutError`` of the kernel's
    (``ETIMEDOUT``: the connection's user timeout) and any other ``OSError`` go up as
    they are. ``sock``'s timeout is left at what was left of the bound."""
    data = b""
    while len(data) < n:
        left = deadline.left()
        if left <= 0:
            raise deadline.time_up(len(data), n)
        sock.settimeout(left)
        try:
            chunk = sock.recv(1 if not data else n - len(data))
        except TimeoutError as exc:
            if exc.errno is not None:  # the kernel's bound, not the socket's
                raise
            raise deadline.time_up(len(data), n) from None
        if not chunk:
            raise HandshakeClosed(
                f"the peer closed the connection after {len(data)} of {n} bytes of a "
                f"handshake message"
            )
        data += chunk
        check(data)
    return data


def await_message(
    sock: socket.socket,
    n: int,
    check: Callable[[bytes], None],
    deadline: HandshakeDeadline,
) -> bytes:
    """The first ``n`` bytes waiting on ``sock`` once all of them have come, left unread
    there (``read_message`` then takes them), so that a last look at the connection by
    another thread (``peek_waiting``) sees them too until they are taken; refused by
    ``check`` as they come, ``HandshakeTimeUp`` and ``HandshakeClosed`` as
    ``read_message``. Each wait is for one byte more than has come (``SO_RCVLOWAT``),
    so it never spins on bytes already there."""
    seen = b""
    try:
        while len(seen) < n:
            left = deadline.left()
            if left <= 0:
                raise deadline.time_up(len(seen), n)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, len(seen) + 1)
            sock.settimeout(left)
            try:
                waiting = sock.recv(n, socket.MSG_PEEK)
            except TimeoutError as exc:
                if exc.errno is not None:
                    raise
                raise deadline.time_up(len(seen), n) from None
            if len(waiting) <= len(seen):  # readable with nothing more: the peer closed
                raise HandshakeClosed(
                    f"the peer closed the connection after {len(waiting)} of {n} bytes of a "
                    f"handshake message"
                )
            seen = waiting
            check(seen)
    finally:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, 1)
    return seen


def peek_waiting(sock: socket.socket, n: int) -> bytes:
    """What of the first ``n`` bytes is waiting on ``sock`` now, left there; never waits
    (``b""`` for none, or for a connection that failed or is closed)."""
    poller = select.poll()
    try:
        poller.register(sock, select.POLLIN)
        if not poller.poll(0):
            return b""
        return sock.recv(n, socket.MSG_PEEK | socket.MSG_DONTWAIT)
    except (OSError, ValueError):
        return b""
