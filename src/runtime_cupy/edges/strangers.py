"""What every port strangers may knock on shares (a TCP edge's door, the slice server,
the Ray host's control port): how many connections the kernel queues for its
``accept``, how many it keeps mid-handshake at once, how long it rests after an
``accept`` that failed, and its refusals logged so that a flood
cannot fill a log (``StrangerLog``).

An ``accept`` that fails with anything but ``BlockingIOError`` or ``InterruptedError``
(``EMFILE``, ``ENFILE``, ``ENOMEM``, ``ENOBUFS``, ``ECONNABORTED``, ...) is passing: the
connection stays queued, the port readable. Each owner then turns its oldest stranger
away (its descriptor free for the next try) and leaves the port unwatched for
``ACCEPT_PAUSE_S`` (watched at once, a loop would spin on it and log each turn).

A connection is turned away only after a last look at what it sent
(``turn_away_oldest``): one whose HELLO came in while the port was crowded, not read
yet, is proven then and stays, and the next oldest goes instead."""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections.abc import Callable, Iterable
from typing import TypeVar

#: Connections the kernel queues for a port's ``accept`` (``listen``'s backlog). Past
#: them a connection's SYN is dropped and its client waits out TCP's retries (1, 3, 7,
#: 15 s after its first try): a burst of strangers past a backlog of 16 held a stage's
#: connect for 1 s, under a flood for 7 s of its 10 s bound.
LISTEN_BACKLOG = 128
#: Connections not proven yet that a port keeps open at once; past them the oldest goes.
MAX_STRANGERS = 64
#: Connections whose HELLO proved the key, waiting for their CONFIRM, kept at once (of
#: each stage on the slice server; copies of a HELLO, replayed, push out the oldest of
#: them; never a stranger).
MAX_PROVEN = 4
#: Seconds a port goes unwatched after an ``accept`` that failed (EMFILE, ...).
ACCEPT_PAUSE_S = 0.05
#: Refusals a port logs one by one (WARNING); past them, a flood is summed up in one
#: WARNING every ``REFUSAL_SUMMARY_S`` (each refusal still at DEBUG).
LOGGED_REFUSALS = 16
REFUSAL_SUMMARY_S = 10.0
#: Reasons a summary counts one by one (a reason may name what a stranger sent, so a
#: flood could make them many); the rest are counted together.
SUMMED_REASONS = 8

_Conn = TypeVar("_Conn")


class Look(enum.Enum):
    """What a last look at a connection found."""

    SAME = "same"  # still what it was: it is turned away
    GONE = "gone"  # the look ended it (refused for what it sent, or let in): room made
    MOVED = "moved"  # what it sent proved it: no longer one of those to turn away


def turn_away_oldest(
    oldest_first: Iterable[_Conn],
    look: Callable[[_Conn], Look],
    turn_away: Callable[[_Conn], None],
    enough: Callable[[], bool] = lambda: False,
) -> None:
    """Turn away the oldest of ``oldest_first`` after a last ``look`` at each: the first
    that it finds ``SAME`` goes (``turn_away``); one it found ``GONE`` made the room;
    one it found ``MOVED`` (proven meanwhile) stays, and the next is looked at, unless
    that is ``enough`` (one fewer of them was what was wanted)."""
    for conn in oldest_first:
        seen = look(conn)
        if seen is Look.SAME:
            turn_away(conn)
            return
        if seen is Look.GONE or enough():
            return


class StrangerLog:
    """What one port logs of its strangers, each line beginning with ``what`` (``edge
    3``, ``slice server``, ...): the first ``LOGGED_REFUSALS`` refusals one by one, the
    rest summed up (``sum_up`` when the port closes), and its failed accepts (the first
    a WARNING, the rest at DEBUG). Safe from any thread."""

    def __init__(self, log: logging.Logger, what: str) -> None:
        self._log = log
        self._what = what
        self._lock = threading.Lock()
        self.refusals = 0  # connections turned away so far
        self.accept_failures = 0  # accepts that failed so far
        self._unsummed: dict[str, int] = {}  # refusals not yet in a summary, by reason
        self._summed_since = 0.0  # time.monotonic() of the first refusal not summed up

    def refused(self, peer: object, why: str) -> None:
        """Log the refusal of a connection from ``peer``."""
        with self._lock:
            self.refusals += 1
            one_by_one = self.refusals <= LOGGED_REFUSALS
            if not one_by_one:
                now = time.monotonic()
                unsummed = self._unsummed
                if not unsummed:
                    self._summed_since = now  # a summary's interval begins
                counted = why
                if why not in unsummed and len(unsummed) >= SUMMED_REASONS:
                    counted = "for other reasons"
                unsummed[counted] = unsummed.get(counted, 0) + 1
                due = now - self._summed_since >= REFUSAL_SUMMARY_S
        level = logging.WARNING if one_by_one else logging.DEBUG
        self._log.log(level, "%s: refused a connection from %s: %s", self._what, peer, why)
        if not one_by_one and due:
            self.sum_up()

    def sum_up(self) -> None:
        """One WARNING for the refusals not logged one by one since the last summary,
        counted by reason."""
        with self._lock:
            unsummed, self._unsummed = self._unsummed, {}
            total = self.refusals
        if unsummed:
            self._log.warning(
                "%s: refused %d more connections (%d in all): %s",
                self._what,
                sum(unsummed.values()),
                total,
                "; ".join(f"{n} {why}" for why, n in unsummed.items()),
            )

    def accept_failed(self, exc: OSError) -> None:
        """Log an ``accept`` that failed (the port then rests ``ACCEPT_PAUSE_S``)."""
        with self._lock:
            self.accept_failures += 1
            count = self.accept_failures
        self._log.log(
            logging.WARNING if count == 1 else logging.DEBUG,
            "%s: accept failed (%d so far): %s; the port rests %g s after each",
            self._what, count, exc, ACCEPT_PAUSE_S,
        )  # fmt: skip
