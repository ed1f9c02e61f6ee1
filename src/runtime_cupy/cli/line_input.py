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

A handler runs between any two bytecodes of the main thread, so one that raised while
``read_line`` set its watch up or took it down skipped the rest of that: its handler
stayed in place, dropping every later Ctrl-C, and its thread and pipe leaked. So the
handlers ``read_line`` puts in (a ``_Gate``'s) run the ones they replaced at once only
while ``input()`` waits; a signal that comes while the watch is set up is handled just
before the wait (which is then not begun when its handler raised), and one that comes
after the first handler raised, or after the line was read, once the watch is taken
down and the handlers are back (in the order they came). They go in first and come
back last, and act as the ones they replaced until all are in and once all are back:
a signal between two of them leaves one in place, which the next ``read_line`` takes
out. Blocking the signals in the main thread (``pthread_sigmask``) instead would not
do: a Ctrl-C sent to the process then goes to another of its threads, whose C handler
still has the main thread run the Python one at its next bytecode.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any

#: The signals that end a wait for a line (their handlers raise).
ENDING = (signal.SIGINT, signal.SIGTERM)
#: How often a signal not yet handled is sent again to the main thread.
RESEND_S = 0.1

Handler = Callable[[int, FrameType | None], Any]


class _Wrapped:
    """A ``_Gate``'s handler for one signal, over the handler it replaced."""

    def __init__(self, gate: _Gate, handler: Handler) -> None:
        self.gate = gate
        self.handler = handler

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        self.gate.handle(signum, frame, self.handler)


def _unwrapped(handler: Any) -> Any:
    """The handler a finished ``read_line``'s left behind wraps (else ``handler``)."""
    while isinstance(handler, _Wrapped) and handler.gate.passing:
        handler = handler.handler
    return handler


class _Gate:
    """When the ending signals' handlers run in one ``read_line``: as they are
    (``passing``: before its handlers are all in, after they are all back), now
    (``armed``: while ``input()`` waits) or later (``held``: while the watch is set up
    or taken down); and which signals were handled (``handled``), for the watcher."""

    def __init__(self) -> None:
        self.handlers: dict[int, Handler] = {
            s: h for s in ENDING if callable(h := _unwrapped(signal.getsignal(s)))
        }
        self.passing = True
        self.armed = False
        self.handled: set[int] = set()
        self.held: list[tuple[int, FrameType | None]] = []
        self.lock = threading.RLock()  # (the watcher's resending; a handler within one)

    def install(self) -> None:
        """Our handlers in place of the callable ones (a default or ignored signal is
        left as it is); from then on, signals are held."""
        for signum, handler in self.handlers.items():
            signal.signal(signum, _Wrapped(self, handler))
        self.passing = False

    def restore(self) -> None:
        """The handlers back; then those of the signals held, in the order they came
        (a later one's exception replaces an earlier one's)."""
        self.passing = True
        try:
            for signum, handler in self.handlers.items():
                signal.signal(signum, handler)
        finally:
            held, self.held = self.held, []
            error: BaseException | None = None
            for signum, frame in held:
                try:
                    self.handlers[signum](signum, frame)
                except BaseException as exc:  # (raised below, after the rest)
                    error = exc
            if error is not None:
                raise error

    def arm(self) -> None:
        """Handlers run now: first those of the signals held (their first exception
        is raised, and the wait is not begun)."""
        self.armed = True
        while self.held:
            self.armed = False
            signum, frame = self.held.pop(0)
            self.handlers[signum](signum, frame)
            self.armed = True

    def handle(self, signum: int, frame: FrameType | None, handler: Handler) -> None:
        """Signal ``signum`` came: ``handler`` (the one replaced) runs now, later or not
        at all (a copy sent again)."""
        if not self.passing:
            with self.lock:
                if signum in self.handled:
                    return  # a copy sent again: handled already
                self.handled.add(signum)
                if not self.armed:
                    self.held.append((signum, frame))
                    return
                self.armed = False  # what comes while it runs (or after it raised) is held
            handler(signum, frame)
            self.arm()  # it did not raise: the wait goes on
            return
        handler(signum, frame)


@contextlib.contextmanager
def _watching(gate: _Gate) -> Iterator[None]:
    """A thread that sends each ending signal again to the main thread, until handled."""
    main = threading.main_thread().ident or 0
    done = threading.Event()
    read_fd, write_fd = os.pipe()

    def resend(signum: int) -> None:
        while not done.wait(RESEND_S):
            with gate.lock:  # (not sent after its handler ran)
                if signum in gate.handled:
                    return
                signal.pthread_kill(main, signum)

    def watch() -> None:
        while data := os.read(read_fd, 64):
            for signum in data:
                if signum in ENDING:
                    resend(signum)

    try:
        os.set_blocking(write_fd, False)
        previous = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
        watcher = threading.Thread(target=watch, name="line-input-signals", daemon=True)
        try:
            watcher.start()
            yield
        finally:
            signal.set_wakeup_fd(previous)
            done.set()
            os.close(write_fd)  # the watcher's read ends
            write_fd = -1
            if watcher.ident is not None:
                watcher.join()  # no copy is sent from now on; one sent is handled by now
    finally:
        os.close(read_fd)
        if write_fd >= 0:
            os.close(write_fd)


def read_line(prompt: str) -> str:
    """``input(prompt)``, ended by Ctrl-C or SIGTERM as soon as it comes (in the main
    thread; elsewhere, ``input`` as it is)."""
    if threading.current_thread() is not threading.main_thread():
        return input(prompt)
    gate = _Gate()
    gate.install()  # (a signal before it is done: raised as before, nothing to undo)
    try:
        with _watching(gate):
            try:
                gate.arm()
                return input(prompt)
            finally:
                gate.armed = False  # the line is read: what comes now is held
    finally:
        gate.restore()
