"""The tests' own TCP servers (``FaultyLink``, the relays) leave no thread after
``close``: each left its accept thread blocked in ``accept`` for good (closing a
listening socket does not wake it), so a test that counted this process's threads
counted them too."""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from tests.support.edge_relay import Relay
from tests.support.faulty_link import FaultyLink
from tests.support.slice_relay import SliceRelay


@pytest.fixture
def upstream() -> Iterator[str]:
    """A server that takes connections and holds them open until closed."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        held: list[socket.socket] = []
        stop = threading.Event()

        def take() -> None:
            while not stop.is_set():
                try:
                    held.append(listener.accept()[0])
                except OSError:
                    return

        listener.settimeout(0.1)
        thread = threading.Thread(target=take)
        thread.start()
        try:
            yield f"127.0.0.1:{listener.getsockname()[1]}"
        finally:
            stop.set()
            thread.join(10)
            for sock in held:
                sock.close()


def _address(server: Any) -> tuple[str, int]:
    text = getattr(server, "address_text", server.address)
    if isinstance(text, tuple):
        return text[0], text[1]
    host, _, port = text.rpartition(":")
    return host, int(port)


MAKERS: dict[str, Callable[[str], Any]] = {
    "faulty link": FaultyLink,
    "relay": lambda up: Relay(lambda: (up.rpartition(":")[0], int(up.rpartition(":")[2]))),
    "slice relay": SliceRelay,
}


@pytest.mark.parametrize("name", sorted(MAKERS))
@pytest.mark.parametrize("connections", [0, 2])
def test_a_test_server_leaves_no_thread_after_close(
    upstream: str, name: str, connections: int
) -> None:
    before = set(threading.enumerate())
    server = MAKERS[name](upstream)
    clients = [socket.create_connection(_address(server), timeout=10) for _ in range(connections)]
    server.close()
    for client in clients:
        client.close()
    left = [t.name for t in set(threading.enumerate()) - before]
    assert left == [], left
