"""The server's stop as the request handlers' event loop hears it: ``Stopping`` is set
once, from any thread (``Engine.close``, which a signal's handler starts), and wakes
every handler waiting on it on the loop (``call_soon_threadsafe``), so that a request
still reading its body is answered 503 at once rather than held through uvicorn's
graceful wait and then cut (a bare 500 and an ASGI traceback)."""

from __future__ import annotations

import asyncio
import contextlib


class Stopping:
    """A flag set once from any thread, awaited on one event loop."""

    def __init__(self) -> None:
        self._set = False
        self._event: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def set(self) -> None:
        """Set it (any thread); the loop that waits on it wakes."""
        self._set = True  # before the loop is read: a wait that starts now sees it
        loop, event = self._loop, self._event
        if loop is not None and event is not None:
            with contextlib.suppress(RuntimeError):  # a loop closed meanwhile
                loop.call_soon_threadsafe(event.set)

    async def wait(self) -> None:
        """Return once it is set (on the server's loop; a server started again on the
        same engine waits on its own)."""
        loop, event = asyncio.get_running_loop(), self._event
        if self._loop is not loop or event is None:
            # the event before the loop: set() reads them the other way round
            event = self._event = asyncio.Event()
            self._loop = loop
        if self._set:  # read after the loop is known: a set from now on wakes it
            return
        await event.wait()
