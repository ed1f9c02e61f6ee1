"""A request refused before its body was read (413: over ``MAX_BODY_BYTES``) on a
keep-alive connection: the answer says ``Connection: close`` and the server closes the
connection once it is sent, lingering while the client still sends (``unread_body``,
``lingering``). The connection was kept: the server went on reading the body it had
refused, a raw client waited for the keep-alive timeout (or, with a chunked body, for
ever), and closed at once the client that sent its whole body got a reset, not the 413.

The application on uvicorn in this process with the protocol ``serve`` runs it on
(``connections.bounded_h11``), over a warm chain that is never started: what is tested
happens before any run.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import httpx2
import pytest
import uvicorn

from runtime_cupy.cli.serve import _listen
from runtime_cupy.serve.app import MAX_BODY_BYTES, build_app
from runtime_cupy.serve.chain import WarmChain
from runtime_cupy.serve.connections import (
    ConnectionGuard,
    ConnectionLimits,
    bounded_h11,
    guarded_listener,
)
from runtime_cupy.serve.engine import Engine
from runtime_cupy.serve.lingering import LINGER_S
from tests.support.servers import wait_for

#: uvicorn's keep-alive timeout here: far longer than a close that comes at once.
KEEP_ALIVE_S = 30
HEAD = b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"


@pytest.fixture(scope="module")
def address(tiny_chat: str) -> Iterator[tuple[str, int]]:
    engine = Engine(WarmChain(tiny_chat, stages=1, context=64))  # never started
    guard = ConnectionGuard(ConnectionLimits(16, 10.0))
    sock = guarded_listener(_listen("127.0.0.1", 0), guard)
    config = uvicorn.Config(
        build_app(engine), http=bounded_h11(guard), timeout_keep_alive=KEEP_ALIVE_S,
        lifespan="off", log_level="warning",
    )  # fmt: skip
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        wait_for(lambda: server.started, 30.0, "uvicorn to start")
        yield sock.getsockname()[:2]
    finally:
        server.should_exit = True
        thread.join(30)
        engine.close()


def _answer_and_end(conn: socket.socket, within_s: float) -> tuple[bytes, float]:
    """Everything the server sends until it closes (a reset fails the test), and how
    long that took; ``socket.timeout`` if it is still open after ``within_s``."""
    conn.settimeout(within_s)
    began, data = time.monotonic(), b""
    while chunk := conn.recv(65536):
        data += chunk
    return data, time.monotonic() - began


def _head_of(data: bytes) -> list[bytes]:
    return data.split(b"\r\n\r\n", 1)[0].lower().split(b"\r\n")


def _closed_413(data: bytes, took: float) -> None:
    """``data`` is a 413 that says ``Connection: close``, and the connection ended
    within the linger after it (``took`` s)."""
    head = _head_of(data)
    assert head[0].startswith(b"http/1.1 413"), data[:200]
    assert b"connection: close" in head, data[:400]
    assert took < LINGER_S + 1, took


def test_a_body_announced_too_large_is_413_and_its_connection_closed(
    address: tuple[str, int],
) -> None:
    with socket.create_connection(address, timeout=10) as conn:
        conn.sendall(HEAD + f"Content-Length: {MAX_BODY_BYTES + 1}\r\n\r\n".encode() + b"{" * 1000)
        data, took = _answer_and_end(conn, KEEP_ALIVE_S / 2)
    _closed_413(data, took)


def test_a_chunked_body_sent_whole_past_the_bound_reads_the_413_not_a_reset(
    address: tuple[str, int],
) -> None:
    """The client sends its whole body (9 MiB in chunks) before it reads: the refusal
    came after the first 8 MiB; the client reads it, then the end of the connection."""
    with socket.create_connection(address, timeout=10) as conn:
        conn.sendall(HEAD + b"Transfer-Encoding: chunked\r\n\r\n")
        chunk = b"x" * (1 << 20)
        for _ in range(9):
            conn.sendall(f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n")
        data, took = _answer_and_end(conn, KEEP_ALIVE_S / 2)
    _closed_413(data, took)


def test_httpx_gets_the_413_with_connection_close_and_its_next_request_is_answered(
    address: tuple[str, int],
) -> None:
    base = f"http://{address[0]}:{address[1]}"
    json_type = {"Content-Type": "application/json"}

    def chunks() -> Iterator[bytes]:
        for _ in range(9):
            yield b"{" * (1 << 20)

    with httpx2.Client(base_url=base, timeout=10) as client:
        for body in (b"{" * (MAX_BODY_BYTES + 1), chunks()):
            response = client.post("/v1/completions", content=body, headers=json_type)
            assert response.status_code == 413, response.text
            assert response.headers["connection"] == "close"
            assert "over 8388608 bytes" in response.json()["error"]["message"]
            assert client.get("/v1/models").status_code == 200


def test_a_refusal_after_the_whole_body_keeps_the_connection(address: tuple[str, int]) -> None:
    """A body read whole and refused (400: not JSON) says nothing of the connection,
    which serves the next request."""
    with socket.create_connection(address, timeout=10) as conn:
        reader = conn.makefile("rb")
        for _ in range(2):
            conn.sendall(HEAD + b"Content-Length: 3\r\n\r\nnot")
            head = [line.rstrip(b"\r\n").lower() for line in iter(reader.readline, b"\r\n")]
            assert head[0].startswith(b"http/1.1 400"), head
            assert not any(line.startswith(b"connection:") for line in head), head
            length = next(int(line.split(b":")[1]) for line in head if b"content-length" in line)
            assert b"invalid_json" in reader.read(length)
