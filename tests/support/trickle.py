"""A peer that sends its bytes one at a time, a pause before each: a handshake dribbled
just inside each read's bound, to show a bound that holds the whole handshake."""

from __future__ import annotations

import socket
import threading


def trickle(sock: socket.socket, data: bytes, pause_s: float, stop: threading.Event) -> int:
    """``data`` sent on ``sock`` a byte at a time, ``pause_s`` before each, until
    ``stop`` is set or the peer is gone; how many bytes were sent."""
    for sent, byte in enumerate(data):
        if stop.wait(pause_s):
            return sent
        try:
            sock.send(bytes([byte]))
        except OSError:
            return sent
    return len(data)
