"""The slice server's door: what each of its connections is, and how many of each it
keeps, so that no one, stranger or holder of a stage's key, holds more of the server's
threads and descriptors than the stages it admits need.

A connection is a *stranger* until its HELLO proves an admitted stage's key, then
*proven* until its CONFIRM comes, then *served* (its stage's slice). A HELLO proves
only that its sender held the key once: a copy of one, replayed by whoever saw it on
the network, is proven too, though it can never CONFIRM. So:

- strangers: at most ``MAX_STRANGERS`` (``edges.strangers``); past them the oldest is
  turned away, after a last look at what it sent (``look``): a stage whose HELLO came
  in while strangers crowded the port, its thread not at it yet, is proven then and
  stays, and the next oldest goes instead (``edges.strangers.turn_away_oldest``, as at
  the Ray control port);
- proven: at most ``MAX_PROVEN`` of each stage (copies of its HELLO, each held up to
  the handshake's bound); past them that stage's oldest proven one is turned away (a
  stage's own CONFIRM follows its HELLO within a round trip), and no copy of one
  stage's HELLO turns another stage's connection away;
- served: at most ``SERVED_PER_STAGE`` of each admission of a stage (its fetch, and
  one more: a fetch tried again while the server's end of the first still closes);
  past them the new one is refused, naming the stage and the bound.

With ``S`` stages admitted, the server holds at most ``MAX_STRANGERS + S x
(MAX_PROVEN + SERVED_PER_STAGE)`` connections, one thread each (and a recovery's lost
host's, admitted before, until they end).

Turning a connection away shuts it down; its thread then ends and closes it. When the
server closes, every connection not served yet is turned away (``close``)."""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Callable

from runtime_cupy.edges.strangers import (
    MAX_PROVEN,
    MAX_STRANGERS,
    Look,
    StrangerLog,
    turn_away_oldest,
)
from runtime_cupy.slices.protocol import Refused

#: Connections of one admission of a stage served at once (its slice's transfer, and
#: a fetch tried again while the server's end of the first still closes).
SERVED_PER_STAGE = 2


class SliceDoor:
    """The connections of one slice server, by what they proved; refusals logged
    through ``log``; ``look``: a last look at a stranger, the stage whose key the HELLO
    waiting on it proves (``protocol.hello_proves``), never waiting. Safe from any
    thread."""

    def __init__(
        self, log: StrangerLog, look: Callable[[socket.socket], int | None] = lambda c: None
    ) -> None:
        self.log = log
        self._look = look
        self._lock = threading.Lock()
        self._strangers: dict[socket.socket, object] = {}  # oldest first: its peer
        self._proven: dict[socket.socket, tuple[object, int]] = {}  # oldest first
        self._served: dict[tuple[int, int], set[socket.socket]] = {}  # (stage, admission)
        self._closed = False

    def knocked(self, conn: socket.socket, peer: object) -> None:
        """A connection accepted: a stranger; past ``MAX_STRANGERS`` the oldest goes,
        after a last look."""
        with self._lock:
            self._strangers[conn] = peer
            if self._closed:  # knocked as the server closed
                self._strangers.pop(conn)
                _shut(conn)
                return
        while self.strangers() > MAX_STRANGERS:
            self.turn_away_oldest(
                "pushed out by newer connections before it proved the key", MAX_STRANGERS
            )

    def strangers(self) -> int:
        with self._lock:
            return len(self._strangers)

    def turn_away_oldest(self, why: str, enough: int | None = None) -> None:
        """End the handshake of the oldest stranger, if there is one, after a last look
        at what it sent: one whose HELLO proves an admitted stage's key is proven then,
        and the next oldest goes instead, unless the strangers left are ``enough``
        (``None``: one must go, to free what it holds)."""
        said: list[tuple[object, str]] = []
        with self._lock:

            def look(conn: socket.socket) -> Look:
                index = self._look(conn)
                if index is None:
                    return Look.SAME
                said.extend(self._prove(conn, index))
                return Look.MOVED

            def away(conn: socket.socket) -> None:
                said.append((self._strangers.pop(conn), why))
                _shut(conn)

            def done() -> bool:
                return enough is not None and len(self._strangers) <= enough

            turn_away_oldest(list(self._strangers), look, away, done)
        for peer, reason in said:
            self.log.refused(peer, reason)

    def proved(self, conn: socket.socket, index: int) -> None:
        """``conn``'s HELLO proved stage ``index``'s key: no stranger now (a last look
        may have found that first); past ``MAX_PROVEN`` of that stage's proven
        connections the oldest goes. ``Refused`` if ``conn`` was turned away already."""
        with self._lock:
            if conn in self._proven:  # proven by a last look
                self._proven[conn] = (self._proven[conn][0], index)
                return
            if conn not in self._strangers:
                raise Refused("turned away before it proved the key")
            said = self._prove(conn, index)
        for peer, reason in said:
            self.log.refused(peer, reason)

    def _prove(self, conn: socket.socket, index: int) -> list[tuple[object, str]]:
        """(Lock held.) Stranger ``conn`` proven for stage ``index``: the stage's oldest
        proven connections past ``MAX_PROVEN`` shut, and each (peer, why) to log."""
        self._proven[conn] = (self._strangers.pop(conn), index)
        stage = [c for c, (_, i) in self._proven.items() if i == index]
        out = [(c, self._proven.pop(c)[0]) for c in stage[: max(0, len(stage) - MAX_PROVEN)]]
        why = (
            f"pushed out by newer connections that proved stage {index}'s key "
            f"(at most {MAX_PROVEN} a stage before they confirm it)"
        )
        for old, _peer in out:
            _shut(old)
        return [(peer, why) for _old, peer in out]

    def let_in(self, conn: socket.socket, peer: object, index: int, admission: int) -> None:
        """``conn`` confirmed stage ``index``'s key (of its ``admission``-th admission):
        served now; ``Refused`` if it was turned away meanwhile, or (logged) if that
        admission has ``SERVED_PER_STAGE`` connections served already."""
        with self._lock:
            if self._proven.pop(conn, None) is None:
                raise Refused("turned away before it confirmed the key")
            served = self._served.setdefault((index, admission), set())
            full = len(served) >= SERVED_PER_STAGE
            if not full:
                served.add(conn)
        if full:
            why = (
                f"stage {index} has {SERVED_PER_STAGE} connections served already "
                f"(at most {SERVED_PER_STAGE} a stage)"
            )
            self.log.refused(peer, why)
            raise Refused(why)

    def left(self, conn: socket.socket) -> bool:
        """``conn`` ended before it was let in: whether it was still a stranger or
        proven (``False``: turned away, and logged so, already)."""
        with self._lock:
            ours = self._strangers.pop(conn, None) is not None
            return self._proven.pop(conn, None) is not None or ours

    def served_ended(self, conn: socket.socket, index: int, admission: int) -> None:
        with self._lock:
            served = self._served.get((index, admission))
            if served is not None:
                served.discard(conn)
                if not served:
                    del self._served[(index, admission)]

    def close(self) -> None:
        """The server closes: every connection not served yet is turned away (its
        thread then ends and closes it; one that knocks after is turned away at once),
        so none of them outlives the server for the handshake's bound, or is served by a
        closed server; the refusals not logged one by one are summed up."""
        with self._lock:
            self._closed = True
            conns = [*self._strangers, *self._proven]
            self._strangers.clear()
            self._proven.clear()
            for conn in conns:
                _shut(conn)
        self.log.sum_up()


def _shut(conn: socket.socket) -> None:
    with contextlib.suppress(OSError):
        conn.shutdown(socket.SHUT_RDWR)
