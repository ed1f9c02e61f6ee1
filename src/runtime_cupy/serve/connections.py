"""The connections the server holds: bounded in number, bounded in how long a client
may take to send its request, and quiet in the log about both.

What uvicorn (0.54, h11) offers was looked at first: ``limit_concurrency`` answers 503
to a request past N connections or tasks, but only once the connection is accepted and
its request read, so idle connections still take every descriptor; ``backlog`` bounds
the kernel's queue, not what is accepted; ``timeout_keep_alive`` closes a connection
idle *between* requests, but one that never sends a request is held forever (a
slowloris); ``h11_max_incomplete_event_size`` bounds a request head's size, not its
time. So this module adds two things, through uvicorn's own ports (the listening
socket it is handed and the protocol class it is given: ``guarded_listener``,
``bounded_h11``):

- **Time**: a connection must send a whole request head within
  ``client_timeout_s`` of opening (or of its last answer, when kept alive); else it is
  closed. (The app bounds the body's time the same way.) And a client must read its
  answer: once the answer's bytes fill the connection's buffer (the transport pauses
  writing), the client has ``client_timeout_s`` to take enough of them for writing to
  go on (asyncio's low-water mark); else the connection is dropped (``abort``: what
  waits to go is discarded), which the app hears as the client gone (its runs are
  cancelled). A client that stops reading a long stream held its connection, and the
  answer's bytes in this process, for good: a few of them could take every connection.
- **Malformed requests**: bytes h11 cannot read as a request are answered with an
  OpenAI error object, as every other error, not uvicorn's ``text/plain`` 400 line: 400
  ``invalid_http_request``, 431 for a head too large, 501 for a transfer coding not
  served (``refused_requests``).
- **Closing**: a connection closed while its client still sends a request's body (an
  answer that did not wait for it: ``unread_body``), or the rest of a request h11
  refused (a head too large), lingers (``serve.lingering``): the answer sent and the
  write side shut, what still comes is thrown away for at most ``LINGER_S``, so that
  the client reads the answer, not a reset.
- **Number**: the listening socket (``GuardedListener``) admits a connection only while
  fewer than ``limits.max_connections`` are open (or being set up); past that, the new
  one closes the connection that has waited longest for a request to begin (an idle or
  trickling one: a client whose request runs is never dropped), up to
  ``EVICTION_SLACK`` closes at a time, or else is answered 503 (an OpenAI error
  object, ``too_many_connections``) and closed at once. So
  the connections never hold more than ``max_connections + EVICTION_SLACK + 1``
  descriptors (``cli.serve`` sizes that from ``RLIMIT_NOFILE``, beside the descriptors
  kept for the stages), ``accept`` never runs out of them, and strangers holding
  connections open cannot keep a client that sends its request out. (The check is in
  ``accept`` itself: asyncio accepts up to its backlog of connections at a time
  before any protocol hears of them.)

``QuietLog`` keeps the log to one line per kind of event and interval (what repeats
meanwhile is counted on the next line of its kind): the connection events above,
uvicorn's complaints about malformed requests and asyncio's (an ``accept`` that ran
out of descriptors, which Python 3.11 logs once per pending connection, in a loop).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import http
import json
import logging
import socket
import threading
import time
from collections.abc import Callable
from typing import Any, ClassVar, cast

import h11
from attrs import frozen
from h11._connection import DEFAULT_MAX_INCOMPLETE_EVENT_SIZE  # as uvicorn reads it
from uvicorn.protocols.http.h11_impl import H11Protocol

from runtime_cupy.serve.lingering import LingeringClose
from runtime_cupy.serve.refused_requests import RecordingConnection, refusal
from runtime_cupy.serve.request_errors import RequestError

log = logging.getLogger("runtime_cupy.serve.connections")

#: Loggers whose records ``QuietLog`` rate-limits.
NOISY_LOGGERS = ("asyncio", "uvicorn.error", log.name)


def _error_answer(error: RequestError) -> tuple[list[tuple[bytes, bytes]], bytes]:
    """The headers and body of an answer that is ``error``'s OpenAI error object and
    closes its connection."""
    body = json.dumps(error.body()).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (b"connection", b"close"),
    ]
    return headers, body


#: The answer of a connection past the most (``GuardedListener``).
_REFUSAL_HEADERS, _REFUSAL_BODY = _error_answer(
    RequestError(
        "the server holds as many connections as it may (--max-connections), each with "
        "a request: try again later",
        status=503,
        code="too_many_connections",
        type="server_error",
    )
)
_REFUSAL = (
    b"HTTP/1.1 503 Service Unavailable\r\n"
    + b"".join(name + b": " + value + b"\r\n" for name, value in _REFUSAL_HEADERS)
    + b"\r\n"
    + _REFUSAL_BODY
)
#: How many connections may be closing to make room at one time.
EVICTION_SLACK = 8
#: How long an accepted socket may wait for its protocol before it no longer counts
#: (asyncio sets one up within a turn or two of its loop; one it dropped never comes).
SETUP_S = 5.0


@frozen
class ConnectionLimits:
    max_connections: int
    client_timeout_s: float

    @property
    def descriptors(self) -> int:
        """The most descriptors the connections ever hold."""
        return self.max_connections + EVICTION_SLACK + 1


class ConnectionGuard:
    """The connections of one server: those open (their protocols) and those accepted
    whose protocol is not made yet. Used on the event loop's thread only."""

    def __init__(self, limits: ConnectionLimits, clock: Callable[[], float] = time.monotonic):
        if limits.max_connections < 1 or not limits.client_timeout_s > 0:
            raise ValueError(f"no connection is possible within {limits}")
        self.limits = limits
        self.open: set[BoundedH11Protocol] = set()
        self._setting_up: collections.deque[float] = collections.deque()
        self._clock = clock

    @property
    def live(self) -> int:
        return len(self.open) + len(self._setting_up)

    def admit(self) -> bool:
        """Whether a connection just accepted may stay (making room if need be)."""
        now = self._clock()
        while self._setting_up and now - self._setting_up[0] > SETUP_S:
            self._setting_up.popleft()
        limit = self.limits.max_connections
        if self.live >= limit:
            closing = sum(1 for c in self.open if c.evicted)
            waiting = [c for c in self.open if c.waiting_since is not None and not c.evicted]
            if closing >= EVICTION_SLACK or not waiting:
                log.warning(
                    "%d connections open (the most), each with a request or closing: "
                    "refused a new one (503)",
                    self.live,
                )
                return False
            oldest = min(waiting, key=lambda c: c.waiting_since or 0.0)
            log.warning(
                "%d connections open (the most): closed the one waiting longest for a request",
                self.live,
            )
            oldest.evict()
        self._setting_up.append(now)
        return True

    def made(self, protocol: BoundedH11Protocol) -> None:
        if self._setting_up:
            self._setting_up.popleft()
        self.open.add(protocol)

    def lost(self, protocol: BoundedH11Protocol) -> None:
        self.open.discard(protocol)


class GuardedListener(socket.socket):
    """A listening socket whose ``accept`` (which asyncio calls) keeps only the
    connections ``guard`` admits; a refused one gets a 503 and is closed at once."""

    guard: ConnectionGuard

    def accept(self) -> tuple[socket.socket, Any]:
        while True:
            conn, address = super().accept()  # BlockingIOError: none waits (asyncio's cue)
            if self.guard.admit():
                return conn, address
            with contextlib.suppress(OSError):
                conn.setblocking(False)
                conn.send(_REFUSAL)
            conn.close()


def guarded_listener(sock: socket.socket, guard: ConnectionGuard) -> GuardedListener:
    """``sock`` (listening) as a ``GuardedListener`` of ``guard`` (``sock`` is detached)."""
    listener = GuardedListener(sock.family, sock.type, sock.proto, fileno=sock.detach())
    listener.guard = guard
    return listener


class BoundedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol under a ``ConnectionGuard`` (``guard``, set on the
    subclass ``bounded_h11`` makes), with a time limit on each request's head.
    ``waiting_since``: when (loop time) the connection began to wait for a request
    head; ``None`` while a request runs."""

    guard: ClassVar[ConnectionGuard]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # uvicorn's connection, as it makes it, keeping the error it refuses bytes with
        size = self.config.h11_max_incomplete_event_size
        self.conn = RecordingConnection(DEFAULT_MAX_INCOMPLETE_EVENT_SIZE if size is None else size)
        self.waiting_since: float | None = None
        self.evicted = False
        self._deadline: asyncio.TimerHandle | None = None
        self._cycle_waited: object = None
        self._unread: asyncio.TimerHandle | None = None  # writing paused: the client's bound

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        # A close while the client still sends lingers (``serve.lingering``).
        self._closing = LingeringClose(transport, self._client_sending, self.loop)
        self.transport = cast(asyncio.Transport, self._closing)
        self.guard.made(self)
        self._await_request()

    def _client_sending(self) -> bool:
        """Whether the client may still be sending its request: its body (uvicorn's
        cycle has not seen its end), or anything of one h11 refused (a head too large
        comes on: a client that sends it whole before it reads got a reset, not the
        431)."""
        assert isinstance(self.conn, RecordingConnection)
        if self.conn.refused is not None:
            return True
        return self.cycle is not None and self.cycle.more_body

    def data_received(self, data: bytes) -> None:
        if self._closing.lingering:
            return  # the rest of a body answered already: thrown away
        super().data_received(data)
        if self.waiting_since is not None and self.cycle is not self._cycle_waited:
            self._stop_waiting()  # a request head came whole: its cycle runs

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._await_request()

    def connection_lost(self, exc: Exception | None) -> None:
        self._closing.ended()
        self._stop_waiting()
        self._reading()
        self.guard.lost(self)
        super().connection_lost(exc)

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._unread is None:
            timeout = self.guard.limits.client_timeout_s
            self._unread = self.loop.call_later(timeout, self._not_reading)

    def resume_writing(self) -> None:
        self._reading()
        super().resume_writing()

    def _reading(self) -> None:
        if self._unread is not None:
            self._unread.cancel()
            self._unread = None

    def _not_reading(self) -> None:
        self._unread = None
        if not self.transport.is_closing() or self.transport.get_write_buffer_size():
            log.warning(
                "dropped a connection whose client did not take its answer (its buffers "
                "full for %g s)",
                self.guard.limits.client_timeout_s,
            )
            self.transport.abort()  # close() would wait for the client to read it all

    def send_400_response(self, msg: str) -> None:
        """uvicorn's answer to bytes that are no HTTP/1.1 request (h11 refused them), as
        every other error of this server: an OpenAI error object, with the status h11's
        reason calls for (``refused_requests``: 400, 431, 501), and the connection
        closed. (uvicorn's own was ``text/plain``, 'Invalid HTTP request received.',
        which no OpenAI client reads as an error object, and a 400 whatever the
        reason.)"""
        assert isinstance(self.conn, RecordingConnection)
        error = refusal(self.conn)
        headers, body = _error_answer(error)
        reason = http.HTTPStatus(error.status).phrase.encode()
        events = (h11.Response(status_code=error.status, headers=headers, reason=reason),
                  h11.Data(data=body), h11.EndOfMessage())  # fmt: skip
        for event in events:
            self.transport.write(self.conn.send(event) or b"")
        self.transport.close()

    def evict(self) -> None:
        """Close now: a newer connection needs the room."""
        self.evicted = True
        self._stop_waiting()
        self.transport.close()

    # -- time ------------------------------------------------------------------------
    def _await_request(self) -> None:
        self._stop_waiting()
        if self.cycle is not None and not self.cycle.response_complete:
            return  # a pipelined request runs already
        self.waiting_since = self.loop.time()
        self._cycle_waited = self.cycle
        timeout = self.guard.limits.client_timeout_s
        self._deadline = self.loop.call_later(timeout, self._timed_out)

    def _stop_waiting(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None
        self.waiting_since = None

    def _timed_out(self) -> None:
        self._deadline = None
        self.waiting_since = None
        if not self.transport.is_closing():
            log.warning(
                "closed a connection that sent no whole request within %g s",
                self.guard.limits.client_timeout_s,
            )
            self.transport.close()


def bounded_h11(guard: ConnectionGuard) -> type[BoundedH11Protocol]:
    """The protocol class to give uvicorn (``Config(http=...)``) for ``guard``."""
    return type("BoundedH11Protocol", (BoundedH11Protocol,), {"guard": guard})


class QuietLog(logging.Filter):
    """Passes one record per kind (logger, level, message template) and ``interval_s``;
    the next one of its kind says how many were held back."""

    MAX_KINDS = 1024

    def __init__(self, interval_s: float = 10.0, clock: Callable[[], float] = time.monotonic):
        super().__init__()
        self.interval_s = interval_s
        self._clock = clock
        self._last: dict[tuple[str, int, str], float] = {}
        self._held: dict[tuple[str, int, str], int] = {}
        self._lock = threading.Lock()

    def filter(self, record: logging.LogRecord) -> bool:
        template = record.msg if record.args else str(record.msg).split("\n", 1)[0]
        key = (record.name, record.levelno, str(template))
        now = self._clock()
        with self._lock:
            last = self._last.get(key)
            if last is not None and now - last < self.interval_s:
                self._held[key] = self._held.get(key, 0) + 1
                return False
            if len(self._last) >= self.MAX_KINDS:
                self._last.clear()
            self._last[key] = now
            held = self._held.pop(key, 0)
        if held:
            note = f" ({held} more like this in the {self.interval_s:g} s before, not logged)"
            record.msg = str(record.msg) + note
        return True

    def install(self) -> QuietLog:
        """Filter the records of ``NOISY_LOGGERS``."""
        for name in NOISY_LOGGERS:
            logging.getLogger(name).addFilter(self)
        return self
