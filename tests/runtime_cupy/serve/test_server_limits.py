"""``python -m runtime_cupy serve`` as a user starts it, with 100 file descriptors
(``RLIMIT_NOFILE``, soft and hard) and a client timeout of 1 s, against strangers that
open connections and send nothing, half a request head, or half a body:

- with 100 idle connections open, ``GET /health`` and a request are answered (the
  connections that waited longest for a request make room), a stage killed meanwhile is
  started again (the descriptors kept for it are there) and the next request is
  answered;
- every idle or half-sent connection is closed (503, or after the client timeout), a
  body that does not come in time is a 408;
- the log says so in a few lines: no traceback, no "Too many open files".
"""

from __future__ import annotations

import os
import signal
import socket
from pathlib import Path

import httpx2
import pytest

from tests.support.hygiene import wait_gone
from tests.support.servers import ServerProcess

pytestmark = pytest.mark.process

NOFILE = 100
STRANGERS = 100
BODY = {"model": "tiny-chat", "prompt": "Hello", "max_tokens": 3, "temperature": 0}


def _strangers(address: tuple[str, int], n: int) -> list[socket.socket]:
    return [socket.create_connection(address, timeout=30) for _ in range(n)]


def _closed_by_the_server(conn: socket.socket) -> bool:
    """Read to the end (a 503, or nothing); whether the server closed it (in 30 s)."""
    try:
        while conn.recv(4096):
            pass
    except TimeoutError:
        return False
    except OSError:  # reset: closed too
        pass
    return True


def _answered(server: ServerProcess) -> int:
    url = f"{server.base_url}/v1/completions"
    return httpx2.post(url, json=BODY, timeout=60).status_code


def test_idle_connections_past_the_descriptor_limit_leave_clients_and_restarts_working(
    tiny_chat: str, tmp_path: Path
) -> None:
    args = ["--model", tiny_chat, "--stages", "2", "--port", "0", "--context", "128",
            "--client-timeout", "1"]  # fmt: skip
    server = ServerProcess(args, tmp_path / "server.log", nofile=NOFILE)
    held: list[socket.socket] = []
    try:
        server.wait_listening()
        server.wait_ready()
        held += _strangers(server.address, STRANGERS)
        half = socket.create_connection(server.address, timeout=30)
        half.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\n")  # and no more
        held.append(half)
        assert server.health() == 200
        assert _answered(server) == 200

        pids = server.stage_pids()
        os.kill(pids[1], signal.SIGKILL)
        assert not wait_gone([pids[1]], 10.0)
        held += _strangers(server.address, STRANGERS)
        assert _answered(server) == 200  # on stage 1 started again
        assert server.stage_pids()[1] != pids[1]

        slow = socket.create_connection(server.address, timeout=30)
        slow.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\n"
            b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{"
        )
        assert slow.recv(4096).startswith(b"HTTP/1.1 408 "), "a late body is a 408"
        slow.close()
        assert all(_closed_by_the_server(conn) for conn in held)
        assert server.health() == 200
    finally:
        for conn in held:
            conn.close()
        code = server.stop()
    log = server.log()
    assert code == 143, log  # stopped by SIGTERM, as a run is (128 + 15)
    assert "Traceback" not in log and "Too many open files" not in log, log
    assert len(log.splitlines()) < 40, log
    assert "closed a connection that sent no whole request within 1 s" in log
