"""The ports strangers may knock on queue ``LISTEN_BACKLOG`` connections for their
``accept``, one shared figure: the slice server and the Ray control port queued 16 (a
TCP edge's door 128), so a burst of strangers past 16, while the port's thread was
busy, had the kernel drop the next SYNs, and a stage among them waited out TCP's
retries (1 s, then 3 s, 7 s: one saw 7.2 s of its 10 s connect bound)."""

from __future__ import annotations

import select
import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from runplan import GgufSource
from runtime_cupy.edges.strangers import LISTEN_BACKLOG
from runtime_cupy.hosts.ray import control_link
from runtime_cupy.slices import server as server_module
from runtime_cupy.slices.digests import DigestStore
from runtime_cupy.slices.server import SliceServer
from tests.fixtures.gguf_models import ModelShape, write_model

#: Connections at once before the port takes any: past the old backlog, within the new.
BURST = 100


def _address(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host.strip("[]"), int(port)


def _burst(address: tuple[str, int]) -> Iterator[socket.socket]:
    """``BURST`` connections to ``address``, each made (a dropped SYN: ``TimeoutError``
    after 5 s, no port taking it from the queue)."""
    for _ in range(BURST):
        yield socket.create_connection(address, timeout=5)


def test_the_control_port_queues_a_burst_before_it_accepts() -> None:
    assert BURST < LISTEN_BACKLOG
    listener = control_link.ControlListener("127.0.0.1")  # no accept until asked
    socks: list[socket.socket] = []
    try:
        socks.extend(_burst(_address(listener.address)))
        assert len(socks) == BURST
    finally:
        for sock in socks:
            sock.close()
        listener.close()


class _HeldPoll:
    """``select.poll`` whose ``poll`` finds nothing until ``go`` is set."""

    go = threading.Event()

    def __init__(self) -> None:
        self._poll = select.poll()

    def register(self, *args: Any) -> None:
        self._poll.register(*args)

    def poll(self, timeout_ms: float) -> list[tuple[int, int]]:
        if not self.go.wait(timeout_ms / 1000):
            return []
        return self._poll.poll(timeout_ms)


class _HeldSelect:
    POLLIN = select.POLLIN
    poll = _HeldPoll


@pytest.fixture
def held_server(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[SliceServer]:
    """A slice server whose thread takes no connection until ``_HeldPoll.go``."""
    _HeldPoll.go.clear()
    monkeypatch.setattr(server_module, "select", _HeldSelect)
    path = write_model(tmp_path / "m.gguf", ModelShape(n_layers=4, hidden=64, ffn=128))
    server = SliceServer("127.0.0.1", DigestStore(tmp_path / "digests"))
    server.offer(GgufSource((str(path),)))
    try:
        yield server
    finally:
        _HeldPoll.go.set()
        server.close()


def test_the_slice_server_queues_a_burst_while_its_thread_is_busy(
    held_server: SliceServer,
) -> None:
    socks: list[socket.socket] = []
    try:
        socks.extend(_burst(_address(held_server.address)))
        assert len(socks) == BURST
        _HeldPoll.go.set()  # its thread takes them now: past MAX_STRANGERS, the oldest go
        socks[0].settimeout(10)
        assert socks[0].recv(1) == b""
    finally:
        for sock in socks:
            sock.close()
