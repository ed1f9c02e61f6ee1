"""Waiting until another thread or process has reached a state, by watching for that
state rather than sleeping and hoping: a ring's owner blocked on a signal
(``WatchedSignal``, ``watch_space``), another process blocked in a poll of its
descriptors (``blocked_in_poll``)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

from runtime_core.ring import Ring, Signal, ThreadSignal

#: x86-64 system call numbers of the waits a ring's loop makes: poll, select, pselect6,
#: ppoll (``/proc/<pid>/syscall`` names the call a blocked process is in).
WAIT_SYSCALLS = frozenset({"7", "23", "270", "271"})


class WatchedSignal:
    """A ring's ``Signal`` that says when its owner blocks on it: ``waiting`` is set as
    each wait begins (the ring's owner found no slot, or no record)."""

    def __init__(self, inner: Signal | None = None) -> None:
        self.inner: Signal = inner if inner is not None else ThreadSignal()
        self.waiting = threading.Event()

    def notify(self) -> None:
        self.inner.notify()

    def wait(self, timeout_s: float) -> None:
        self.waiting.set()
        self.inner.wait(timeout_s)


def watch_space(ring: Ring) -> threading.Event:
    """An event set when ``ring``'s producer next blocks waiting for a free slot (for a
    ring a medium made, whose signals a test cannot pass in)."""
    watched = WatchedSignal(ring._space)
    ring._space = watched
    return watched.waiting


def blocked_in_poll(pid: int, timeout_s: float) -> bool:
    """Whether process ``pid`` is blocked in a poll (or select) within ``timeout_s``,
    read from ``/proc/<pid>/syscall`` as it happens."""
    path = Path(f"/proc/{pid}/syscall")
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            call = path.read_text().split()[0]
        except (OSError, IndexError):
            return False
        if call in WAIT_SYSCALLS:
            return True
        time.sleep(0.001)  # the process is still computing: look again
    return False
