"""A line read at a terminal prompt that Ctrl-C or SIGTERM ends at once.

CPython runs a signal's handler during ``input()`` only when the wait for a key is
interrupted (readline's ``select``, or stdio's ``read``). A signal that comes while
``input()`` does something else (readline writing the prompt, or echoing a key to a
terminal whose output is held) interrupts that instead, and is then not handled until
a line is entered: the chat waited for the Enter key after a SIGTERM, its stages kept.
``read_line`` reads the line while a watcher thread hears of each such signal (the
wakeup descriptor its C handler writes to, ``signal.set_wakeup_fd``) and sends it
again to the main thread every ``RESEND_S`` until its handler has run: the wait for a
key is interrupted and the handler runs there. Within ``read_line`` each handler runs
once (the copies sent again are dropped once it has).
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any

#: The signals that end a wait for a line (their handlers raise).
ENDING = (signal.SIGINT, signal.SIGTERM)
#: How often a signal not yet handled is sent again to the main thread.
RESEND_S = 0.1


class _Watch:
    """The signals of one ``read_line``: which came, which were handled, and the
    thread that sends the unhandled ones again."""

    def __init__(self) -> None:
        self.handled: set[int] = set()
        self.done = threading.Event()
        self.lock = threading.RLock()  # (a handler run within a handler)
        self.main = threading.main_thread().ident or 0
        self.read_fd, self.write_fd = os.pipe()
        os.set_blocking(self.write_fd, False)

    def once(self, handler: Any) -> Callable[[int, FrameType | None], None]:
        def handle(signum: int, frame: FrameType | None) -> None:
            with self.lock:
                if signum in self.handled:
                    return  # a copy sent again: handled already
                self.handled.add(signum)
            if callable(handler):
                handler(signum, frame)

        return handle

    def watch(self) -> None:
        while data := os.read(self.read_fd, 64):
            for signum in data:
                if signum in ENDING:
                    self._resend(signum)

    def _resend(self, signum: int) -> None:
        while not self.done.wait(RESEND_S):
            with self.lock:
                if signum in self.handled:
                    return
                signal.pthread_kill(self.main, signum)

    def close(self) -> None:
        self.done.set()
        os.close(self.write_fd)  # the watcher's read ends


def read_line(prompt: str) -> str:
    """``input(prompt)``, ended by Ctrl-C or SIGTERM as soon as it comes (in the main
    thread; elsewhere, ``input`` as it is)."""
    if threading.current_thread() is not threading.main_thread():
        return input(prompt)
    watch = _Watch()
    handlers = {s: signal.getsignal(s) for s in ENDING}
    for signum, handler in handlers.items():
        if callable(handler):  # (a default or ignored signal is left as it is)
            signal.signal(signum, watch.once(handler))
    previous = signal.set_wakeup_fd(watch.write_fd, warn_on_full_buffer=False)
    watcher = threading.Thread(target=watch.watch, name="line-input-signals", daemon=True)
    watcher.start()
    try:
        return input(prompt)
    finally:
        signal.set_wakeup_fd(previous)
        watch.close()
        watcher.join()  # no copy is sent from now on; one sent is handled by now
        os.close(watch.read_fd)
        for signum, handler in handlers.items():
            with contextlib.suppress(TypeError):  # (None: set outside Python)
                signal.signal(signum, handler)
