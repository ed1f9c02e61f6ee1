"""The parts of ``serve.connections`` on their own (the server under a flood of idle
connections is ``test_server_limits.py``):

- ``ConnectionGuard`` admits a connection while fewer than the most are open; past it,
  it closes the one waiting longest for a request (never one whose request runs), at
  most ``EVICTION_SLACK`` at a time, and otherwise refuses the newcomer;
- ``QuietLog`` passes one record per kind and interval, and the next one says how
  many were held back;
- a client that reads nothing of its answer is dropped after the client timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import select
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import uvicorn

from runtime_cupy.cli.serve import _listen
from runtime_cupy.serve.connections import (
    EVICTION_SLACK,
    ConnectionGuard,
    ConnectionLimits,
    QuietLog,
    bounded_h11,
    guarded_listener,
)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Conn:
    """What the guard reads of a protocol."""

    def __init__(self, waiting_since: float | None) -> None:
        self.waiting_since = waiting_since
        self.evicted = False

    def evict(self) -> None:
        self.evicted = True


def _guard(limit: int) -> ConnectionGuard:
    return ConnectionGuard(ConnectionLimits(limit, 1.0), clock=Clock())


def _open(guard: ConnectionGuard, *conns: Any) -> None:
    for c in conns:
        assert guard.admit()
        guard.made(c)


def test_past_the_most_the_longest_waiting_makes_room_and_a_busy_one_never_does() -> None:
    guard = _guard(3)
    idle_old, busy, idle_new = Conn(1.0), Conn(None), Conn(2.0)
    _open(guard, idle_old, busy, idle_new)
    assert guard.admit()  # the fourth: the longest waiting goes
    assert idle_old.evicted and not busy.evicted and not idle_new.evicted
    guard.lost(idle_old)
    guard.made(Conn(None))
    assert guard.admit() and idle_new.evicted
    guard.lost(idle_new)
    guard.made(Conn(None))
    assert not guard.admit()  # every one has a request: the newcomer is refused
    assert guard.live == 3


def test_at_most_the_slack_closes_at_a_time() -> None:
    guard = _guard(1)
    waiting = [Conn(float(i)) for i in range(EVICTION_SLACK + 2)]
    _open(guard, waiting[0])
    for conn in waiting[1:]:  # each newcomer closes one, none of them gone yet
        admitted = guard.admit()
        if admitted:
            guard.made(conn)
    assert sum(c.evicted for c in waiting) == EVICTION_SLACK
    assert guard.live == EVICTION_SLACK + 1 <= ConnectionLimits(1, 1.0).descriptors


def test_the_log_passes_one_record_per_kind_and_interval_and_counts_the_rest() -> None:
    clock = Clock()
    quiet = QuietLog(interval_s=10.0, clock=clock)
    logger = logging.getLogger("tests.quiet")

    def record(msg: str, *args: object) -> logging.LogRecord:
        return logger.makeRecord(logger.name, logging.WARNING, __file__, 1, msg, args, None)

    assert quiet.filter(record("closed %d", 1))
    assert not any(quiet.filter(record("closed %d", n)) for n in range(2, 500))
    assert quiet.filter(record("another kind"))  # its own kind
    clock.now = 10.0
    passed = record("closed %d", 500)
    assert quiet.filter(passed)
    assert passed.getMessage() == "closed 500 (498 more like this in the 10 s before, not logged)"


def test_a_client_that_reads_nothing_of_its_answer_is_dropped() -> None:
    """An answer streamed to a client that never reads: once the connection's buffers
    are full (writing paused), the client has the client timeout to take some of it;
    then the connection is dropped, the app hears the client gone (a stream's runs are
    then cancelled), and the guard frees its room. (It was held for good, the answer's
    bytes waiting in the server.)"""
    guard = ConnectionGuard(ConnectionLimits(4, 0.5))
    gone = threading.Event()

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        await receive()  # the request
        await send({"type": "http.response.start", "status": 200, "headers": []})

        async def pump() -> None:
            while True:
                await send({"type": "http.response.body", "body": b"x" * 65536, "more_body": True})

        task = asyncio.ensure_future(pump())
        while (await receive())["type"] != "http.disconnect":
            pass
        task.cancel()
        gone.set()

    sock = guarded_listener(_listen("127.0.0.1", 0), guard)
    config = uvicorn.Config(app, http=bounded_h11(guard), lifespan="off", log_level="error")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    client = socket.socket()
    try:
        deadline = time.monotonic() + 30
        while not server.started and time.monotonic() < deadline:
            time.sleep(0.01)
        client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        client.connect(sock.getsockname())
        client.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")  # and never reads
        assert gone.wait(30), "the connection of a client that reads nothing was held"
        deadline = time.monotonic() + 10
        while guard.open and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not guard.open
    finally:
        client.close()
        server.should_exit = True
        thread.join(10)


@contextlib.contextmanager
def _echoing_server() -> Iterator[tuple[str, int]]:
    """uvicorn with the bounded protocol over an app that reads a request and answers
    200 ``ok``; its address."""
    guard = ConnectionGuard(ConnectionLimits(4, 5.0))

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        while (await receive()).get("more_body"):
            pass
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    sock = guarded_listener(_listen("127.0.0.1", 0), guard)
    config = uvicorn.Config(app, http=bounded_h11(guard), lifespan="off", log_level="error")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not server.started and time.monotonic() < deadline:
            time.sleep(0.01)
        yield sock.getsockname()
    finally:
        server.should_exit = True
        thread.join(10)


def _refused(address: tuple[str, int], data: bytes, status: int) -> dict[str, Any]:
    """The error object of the answer to ``data``, which must be ``status``, say
    ``Connection: close`` and be JSON; the server then closes the connection."""
    with socket.create_connection(address, timeout=10) as client:
        client.sendall(data)
        answer = b""
        while chunk := client.recv(65536):  # until the server closes
            answer += chunk
    start = answer.find(b"HTTP/1.1 %d " % status)  # (after a good request's answer)
    assert start >= 0, (data[:200], answer)
    head, _, body = answer[start:].partition(b"\r\n\r\n")
    headers = head.decode().lower()
    assert "content-type: application/json" in headers, (data[:200], answer)
    assert "connection: close" in headers, (data[:200], answer)
    error: dict[str, Any] = json.loads(body)["error"]
    return error


def test_bytes_that_are_no_http_request_get_an_openai_error_object() -> None:
    """What h11 cannot read as a request (no ``Host``, a ``Content-Length`` that is no
    length, a malformed request line or chunk) is answered 400 with an OpenAI error
    object, as every other error of the server, and the connection closed. (It was
    uvicorn's ``text/plain`` 'Invalid HTTP request received.'.)"""
    malformed = [
        b"GET / HTTP/1.1\r\n\r\n",  # no Host
        b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n",
        b"NOT HTTP\r\n\r\n",
        b"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n\r\n",
        b"GET / HTTP/1.1\r\nHost: x\r\n\r\nGARBAGE\r\n\r\n",  # after a good request
    ]
    with _echoing_server() as address:
        for data in malformed:
            error = _refused(address, data, 400)
            assert error["type"] == "invalid_request_error", (data, error)
            assert error["code"] == "invalid_http_request", (data, error)
            assert error["param"] is None and "HTTP/1.1" in error["message"], (data, error)


def test_a_head_too_large_gets_431_and_a_transfer_coding_not_served_501() -> None:
    """A request whose head does not end within the bytes h11 holds of an incomplete
    one (16 KiB) is answered 431 (RFC 6585), naming that bound; a ``Transfer-Encoding``
    other than chunked 501 (RFC 9112 §6.1), naming it: each an OpenAI error object, the
    connection closed. (Both were a 400 saying the request was no valid HTTP/1.1.)"""
    big = b"GET / HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 40_000  # no end: h11 waits
    gzip = b"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: gzip\r\n\r\n"
    with _echoing_server() as address:
        error = _refused(address, big, 431)
        assert error["code"] == "request_header_fields_too_large", error
        assert "16384 bytes" in error["message"] and "head" in error["message"], error
        error = _refused(address, gzip, 501)
        assert error["code"] == "not_implemented", error
        assert "Transfer-Encoding" in error["message"], error
        _refused(address, b"GET / HTTP/1.1\r\n\r\n", 400)  # the rest: as before


def test_a_client_that_sends_a_head_too_large_whole_reads_the_431_not_a_reset() -> None:
    """The client sends its whole head (8 MiB, more than the kernel's buffers hold)
    before it reads: the refusal came after the first 16 KiB, and the connection closed
    at once was reset under the client's send; it lingers, so the client reads the
    431, then the end of the connection."""
    piece = b"a" * (1 << 20)
    with _echoing_server() as address, socket.create_connection(address, timeout=30) as client:
        client.sendall(b"GET / HTTP/1.1\r\nHost: x\r\nX-Big: ")
        for _ in range(8):
            client.sendall(piece)
        answer = b""
        while chunk := client.recv(65536):  # a reset fails the test
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 431 "), answer[:200]
    assert b"request_header_fields_too_large" in answer, answer


def test_a_connection_past_the_most_gets_a_503_with_an_openai_error_object() -> None:
    """A connection the guard cannot admit (every open one has a request) is answered
    503 with an OpenAI error object and closed. (It was a 503 with no body.)"""
    guard = ConnectionGuard(ConnectionLimits(1, 5.0))
    assert guard.admit()  # the one place, taken (a connection being set up)
    listener = guarded_listener(_listen("127.0.0.1", 0), guard)
    listener.setblocking(False)
    try:
        with socket.create_connection(listener.getsockname(), timeout=10) as client:
            deadline = time.monotonic() + 10
            while not select.select([client], [], [], 0.01)[0]:  # until it is answered
                with pytest.raises(BlockingIOError):  # refused (or not yet come)
                    listener.accept()
                assert time.monotonic() < deadline, "the connection was never answered"
            answer = b""
            while chunk := client.recv(65536):
                answer += chunk
                if b"\r\n\r\n" in answer:
                    head, _, body = answer.partition(b"\r\n\r\n")
                    length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
                    if len(body) >= length:
                        break
    finally:
        listener.close()
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 503 "), answer
    assert b"content-type: application/json" in head.lower(), answer
    error = json.loads(body)["error"]
    assert error["code"] == "too_many_connections" and error["type"] == "server_error", error
    assert "--max-connections" in error["message"], error
