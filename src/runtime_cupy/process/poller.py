"""The one wait of an event loop: ``poll(2)`` over what each part of the process hands
it (control channels, edge ends, a wake-up pipe), each a file descriptor with the
events it waits for.

A run's steps wait on nearly the same set again and again, so ``Watch`` keeps one poll
object and registers, modifies or unregisters only what changed since the last wait
(building a poll object per wait is a cost per hop). A descriptor listed with no events
still reports errors and hang-ups (``POLLERR``, ``POLLHUP``), which is how a loop
hears of a broken connection it is not reading from.
"""

from __future__ import annotations

import contextlib
import select
from collections.abc import Iterable

IN = select.POLLIN
OUT = select.POLLOUT
#: What poll reports on a descriptor whatever it was asked for.
TROUBLE = select.POLLERR | select.POLLHUP | select.POLLNVAL

#: One descriptor and the events a loop waits for on it.
Entry = tuple[int, int]


class Watch:
    """A poll object over a changing set of ``(fd, events)`` entries (``fd < 0``: none;
    an fd listed twice waits for the union of its events)."""

    def __init__(self) -> None:
        self._poller = select.poll()
        self._masks: dict[int, int] = {}
        self._last: tuple[Entry, ...] | None = None

    def poll(self, entries: tuple[Entry, ...], timeout_ms: float) -> list[tuple[int, int]]:
        """Wait up to ``timeout_ms`` for any entry; the ``(fd, revents)`` that are ready."""
        if entries != self._last:
            self._last = entries
            self._update(entries)
        return self._poller.poll(max(0.0, timeout_ms))

    def _update(self, entries: Iterable[Entry]) -> None:
        wanted: dict[int, int] = {}
        for fd, events in entries:
            if fd >= 0:
                wanted[fd] = wanted.get(fd, 0) | events
        poller, masks = self._poller, self._masks
        for fd in [fd for fd in masks if fd not in wanted]:
            del masks[fd]
            with contextlib.suppress(KeyError, ValueError, OSError):  # closed: gone already
                poller.unregister(fd)
        for fd, events in wanted.items():
            old = masks.get(fd)
            if old == events:
                continue
            if old is None:
                poller.register(fd, events)
            else:
                poller.modify(fd, events)
            masks[fd] = events

    def forget(self) -> None:
        """Drop every registration (before descriptors are closed and reused)."""
        self._poller = select.poll()
        self._masks.clear()
        self._last = None
