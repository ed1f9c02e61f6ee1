"""A connection closed while its client still sends a request's body lingers.

An answer that goes out before the request's body came whole (a 413 for a body over
the bound, a 408: ``unread_body``), or before the rest of a request h11 refused (a 431
for a head too large: ``refused_requests``), closes its connection. Closed at once, the socket
still holds what the client sent and the server never read, so the kernel answers the
client with a reset, and a client that sends its whole body before it reads (curl, a
raw socket) gets "connection reset" where the answer was. As HTTP servers do (RFC 9112
§9.6, nginx's ``lingering_close``), ``LingeringClose`` writes the answer, shuts the
write side (the client reads the answer, then the end), and reads and throws away what
still comes until the client closes its side or ``LINGER_S`` passed; then it closes.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

#: How long a connection closed while its client still sends keeps reading, at most.
LINGER_S = 2.0


class LingeringClose:
    """``transport`` as its protocol writes to it, with a ``close`` that lingers while
    ``sending()`` says the client is still sending its request's body (and the
    transport can shut its write side); everything else is the transport's own.
    ``lingering``: the answer is sent and what comes is to be thrown away."""

    def __init__(
        self,
        transport: asyncio.Transport,
        sending: Callable[[], bool],
        loop: asyncio.AbstractEventLoop,
        linger_s: float = LINGER_S,
    ) -> None:
        self._transport = transport
        self._sending = sending
        self._loop = loop
        self._linger_s = linger_s
        self._timer: asyncio.TimerHandle | None = None
        self.lingering = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)

    def is_closing(self) -> bool:
        return self.lingering or self._transport.is_closing()

    def close(self) -> None:
        if self.is_closing():
            return
        if not (self._sending() and self._transport.can_write_eof()):
            self._transport.close()
            return
        self.lingering = True
        self._transport.write_eof()  # after the answer: the client reads it, then the end
        self._transport.resume_reading()  # (uvicorn may have paused it for the body)
        self._timer = self._loop.call_later(self._linger_s, self._transport.close)

    def abort(self) -> None:
        self.ended()
        self._transport.abort()

    def ended(self) -> None:
        """The connection is gone: no close is due any more."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
