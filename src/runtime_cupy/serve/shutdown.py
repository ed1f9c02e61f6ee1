"""How the server stops (Ctrl-C, SIGTERM): what runs ends first, then the connections.

uvicorn, told to exit, stops listening and then waits up to its graceful timeout for
the open connections to finish their answers, then cancels their tasks (an ASGI
traceback in the log, a cut stream or a bare 500 for the client). A request whose run
goes on for thousands of tokens would be cut that way. ``StoppingServer`` starts
``Engine.close`` the moment it is told to exit (on a thread of its own: a signal's
handler must not wait on the engine's locks): each waiting request is answered 503 and
each running one's run cancelled, its client told (503 "the server is shutting down",
or an error event on its stream), and a request still reading its body is answered 503
too (``Engine.stopping``, which the close sets), so the connections end at once and the
graceful wait has nothing left to wait for.

A signal the server was started with ignored stays ignored (a non-interactive shell
starts its background jobs with SIGINT ignored, so that a Ctrl-C meant for the script
in the foreground leaves them running); uvicorn would take it while it serves.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from types import FrameType

import uvicorn
from uvicorn.server import HANDLED_SIGNALS

from runtime_cupy.serve.engine import Engine


class StoppingServer(uvicorn.Server):
    """uvicorn's server over ``engine``, ending its runs as soon as it is told to exit."""

    def __init__(self, config: uvicorn.Config, engine: Engine) -> None:
        super().__init__(config)
        self.engine = engine
        #: the first signal that told it to exit (uvicorn raises those it caught again
        #: once it stops, the last first)
        self.first_signal: int | None = None

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        """uvicorn's, leaving the signals ignored at the start ignored."""
        main = threading.current_thread() is threading.main_thread()
        ignored = [s for s in HANDLED_SIGNALS if main and signal.getsignal(s) == signal.SIG_IGN]
        with super().capture_signals():
            for s in ignored:
                signal.signal(s, signal.SIG_IGN)
            yield

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.first_signal is None:
            self.first_signal = sig
        super().handle_exit(sig, frame)
        self.engine.close(timeout_s=0)  # starts the close; the server's loop goes on
