"""A TCP link between a client and a server that misbehaves on purpose (a fault that
enters through the network, the port between a stage and the slice server): every byte
is forwarded both ways, except that what the server sends can be cut off after
``cut_after`` bytes (both connections closed, as a link that broke), have the byte at
``flip_at`` changed (damaged in flight), or be slowed to ``rate`` bytes per second.
``forwarded`` counts the bytes the server sent through it."""

from __future__ import annotations

import contextlib
import socket
import time

from tests.support.serving_threads import ServingThreads


class FaultyLink:
    __test__ = False

    def __init__(
        self,
        target: str,
        *,
        cut_after: int | None = None,
        flip_at: int | None = None,
        rate: float | None = None,
    ) -> None:
        host, _, port = target.rpartition(":")
        self.target = (host, int(port))
        self.cut_after = cut_after
        self.flip_at = flip_at
        self.rate = rate
        self.forwarded = 0
        self.connections = 0
        self._listener = socket.socket()
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(8)
        self.address = f"127.0.0.1:{self._listener.getsockname()[1]}"
        self._threads = ServingThreads(self._listener)
        self._threads.start(self._accept)

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            server = socket.create_connection(self.target)
            self._threads.keep(client, server)
            self.connections += 1
            self._threads.start(self._pump, client, server, False)
            self._threads.start(self._pump, server, client, True)

    def _pump(self, source: socket.socket, sink: socket.socket, from_server: bool) -> None:
        began = time.monotonic()
        try:
            while True:
                data = bytearray(source.recv(1 << 16))
                if not data:
                    break
                if from_server:
                    start = self.forwarded
                    if self.flip_at is not None and start <= self.flip_at < start + len(data):
                        data[self.flip_at - start] ^= 0xFF
                    if self.cut_after is not None and start + len(data) >= self.cut_after:
                        sink.sendall(data[: self.cut_after - start])
                        self.forwarded = self.cut_after
                        break
                    self.forwarded += len(data)
                    if self.rate is not None:
                        ahead = self.forwarded / self.rate - (time.monotonic() - began)
                        if ahead > 0:
                            time.sleep(ahead)
                sink.sendall(data)
        except OSError:
            pass
        for s in (source, sink):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            with contextlib.suppress(OSError):
                s.close()

    def close(self) -> None:
        """Stop listening, end every connection and join every thread of the link."""
        self._threads.close()
