"""The threads a test's own TCP server (a relay, a faulty link) runs, and their end:
``close`` wakes its accept thread (closing a listening socket alone does not: a thread
blocked in ``accept`` stays blocked on Linux), ends its connections, and joins every
thread it started, so that a test that counts this process's threads counts true."""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Callable
from typing import Any

#: How long ``close`` waits for each thread (they end once their sockets are shut down).
JOIN_S = 10.0


class ServingThreads:
    """The listener ``listener``, the connections kept (``keep``) and the threads
    started (``start``) of one test server."""

    def __init__(self, listener: socket.socket) -> None:
        self.listener = listener
        self._socks: list[socket.socket] = []
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()

    def start(self, target: Callable[..., Any], *args: Any) -> None:
        thread = threading.Thread(target=target, args=args, daemon=True)
        with self._lock:
            self._threads.append(thread)
        thread.start()

    def keep(self, *socks: socket.socket) -> None:
        with self._lock:
            self._socks.extend(socks)

    def close(self) -> None:
        """Stop listening, end every connection kept, and join every thread started
        (a thread that outlives ``JOIN_S`` raises ``RuntimeError``, naming it)."""
        _end(self.listener)
        current = threading.current_thread()
        joined: set[threading.Thread] = {current}
        while True:  # the accept thread, joined first, may have kept and started more
            with self._lock:
                socks = list(self._socks)
                threads = [t for t in self._threads if t not in joined]
            for sock in socks:
                _end(sock)
            if not threads:
                return
            for thread in threads:
                thread.join(JOIN_S)
                if thread.is_alive():
                    raise RuntimeError(f"{thread.name} still runs {JOIN_S} s after close")
                joined.add(thread)


def _end(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)  # wakes a thread blocked on it
    with contextlib.suppress(OSError):
        sock.close()
