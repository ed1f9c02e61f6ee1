"""The consumer's door on a TCP edge: the port strangers knock on, the handshake that
proves the producer (``handshake``), and the producer let in (``tcp_consumer``'s ring
is the room behind it).

Strangers never push the producer out. A connection is a *stranger* until its HELLO
proves the key (its first 80 bytes, which the producer sends the moment it is
connected), then *proven* until it CONFIRMs. When more than ``MAX_STRANGERS`` strangers
are open, the oldest goes, after one last look at what it sent (so a producer whose
HELLO came in meanwhile is proven, not pushed out); more than ``MAX_PROVEN`` proven
connections (copies of a HELLO, replayed) push out the oldest proven one. A stranger
has ``HELLO_S`` to prove itself and a proven connection ``CONFIRM_S`` to confirm; then
it goes. A producer turned away unread connects again (``tcp_producer``), within its
run's setup bound, so any number of strangers only delays it.

An ``accept`` that fails (no descriptor left in this process or this host, no memory)
leaves the connection queued and the port readable: the oldest stranger is turned away
(after a last look), its descriptor free for the next try, and the port goes unwatched
for ``ACCEPT_PAUSE_S``. ``MAX_STRANGERS``, ``ACCEPT_PAUSE_S`` and the refusals' log are
those of every port strangers knock on (``strangers``)."""

from __future__ import annotations

import contextlib
import logging
import socket
import time

from runtime_cupy.edges import handshake as hs
from runtime_cupy.edges.port import Rendezvous
from runtime_cupy.edges.strangers import (
    ACCEPT_PAUSE_S,
    MAX_PROVEN,
    MAX_STRANGERS,
    Look,
    StrangerLog,
    turn_away_oldest,
)
from runtime_cupy.edges.tcp_frames import peer_of
from runtime_cupy.edges.tcp_seal import FrameSeal, Protection
from runtime_cupy.process.poller import IN, OUT, TROUBLE
from runtime_cupy.process.streams import Outbox, StreamBroken, keep_alive

log = logging.getLogger("runtime_cupy.edges.tcp")

#: Seconds a stranger has to prove the key (its HELLO), and a proven one to CONFIRM.
HELLO_S = 10.0
CONFIRM_S = 30.0
#: Connections taken from the kernel's queue (``strangers.LISTEN_BACKLOG``) at one turn
#: of the owner's loop (the poll brings it back for the rest: a flood never holds it).
ACCEPTS_PER_TURN = 32


class _Pending:
    """A connection to the consumer's port that has not finished the handshake: a
    stranger until its HELLO proves the key (``hello``), then proven."""

    def __init__(self, sock: socket.socket, now: float) -> None:
        self.sock = sock
        self.peer = peer_of(sock)
        self.out = Outbox(sock)
        self.got = bytearray()
        self.since = now
        self.hello: hs.Hello | None = None
        self.nonce_c = hs.new_nonce()

    def expired(self, now: float) -> bool:
        return now - self.since > (CONFIRM_S if self.hello is not None else HELLO_S)


class ConsumerDoor:
    """The door's half of the consumer's end (``tcp_consumer.TcpReceiveRing``, which
    holds the state it declares here): connections accepted on the port, refused unless
    their handshake proves the key, and the producer's, once it is proven, made the
    stream the ring is filled from."""

    edge_id: int
    run_id: str
    _key: bytes
    _protection: Protection
    _listener: socket.socket | None
    _rendezvous: Rendezvous
    _pending: dict[int, _Pending]
    _strangers: StrangerLog
    _rests_until: float
    _conn: socket.socket | None
    _out: Outbox | None
    _seal: FrameSeal | None
    _opener: FrameSeal | None
    _tag: bytearray

    # -- strangers and the producer ---------------------------------------------------------
    def _accept(self) -> None:
        for _ in range(ACCEPTS_PER_TURN):
            if self._listener is None:
                return
            try:
                sock, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                self._accept_failed(exc)
                return
            keep_alive(sock)
            log.debug("edge %d: accepted %s", self.edge_id, peer_of(sock))
            pending = _Pending(sock, time.monotonic())
            self._pending[sock.fileno()] = pending
            self._advance(pending)  # its HELLO may be here already
            self._make_room()

    def _accept_failed(self, exc: OSError) -> None:
        """The connection stays queued, the port readable: free the oldest stranger's
        descriptor (after a last look) and rest the port for ``ACCEPT_PAUSE_S``."""
        self._strangers.accept_failed(exc)
        self._push_out(f"turned away to free a descriptor ({exc.strerror})")
        self._rests_until = time.monotonic() + ACCEPT_PAUSE_S

    def _expire(self, now: float) -> None:
        for pending in [p for p in self._pending.values() if p.expired(now)]:
            what = "confirm" if pending.hello is not None else "prove it holds the key"
            bound = CONFIRM_S if pending.hello is not None else HELLO_S
            self._refuse(pending, f"did not {what} within {bound:g} s")

    def _make_room(self) -> None:
        """Turn away strangers beyond ``MAX_STRANGERS`` (oldest first, after a last look
        at each) and proven connections beyond ``MAX_PROVEN``."""
        self._expire(time.monotonic())
        why = "pushed out by newer connections before it proved the key"
        while self._count_strangers() > MAX_STRANGERS and self._listener is not None:
            self._push_out(why, MAX_STRANGERS)
        proven = [p for p in self._pending.values() if p.hello is not None]
        for oldest in proven[: max(0, len(proven) - MAX_PROVEN)]:
            self._refuse(oldest, "pushed out by newer connections that proved the key")

    def _count_strangers(self) -> int:
        return sum(p.hello is None for p in self._pending.values())

    def _push_out(self, why: str, enough: int | None = None) -> None:
        """Turn the oldest stranger away after a last look at what it sent
        (``strangers.turn_away_oldest``): one it proves stays, and the next goes,
        unless the strangers left are ``enough`` (``None``: one must go)."""

        def look(stranger: _Pending) -> Look:
            fd = stranger.sock.fileno()
            self._advance(stranger)
            if self._pending.get(fd) is not stranger:  # refused, or let in
                return Look.GONE
            return Look.SAME if stranger.hello is None else Look.MOVED

        def done() -> bool:
            return enough is not None and self._count_strangers() <= enough

        strangers = [p for p in self._pending.values() if p.hello is None]
        turn_away_oldest(strangers, look, lambda p: self._refuse(p, why), done)

    def _refuse(self, pending: _Pending, why: str) -> None:
        self._strangers.refused(pending.peer, why)
        self._pending.pop(pending.sock.fileno(), None)
        pending.sock.close()

    def _handshake(self, pending: _Pending, events: int) -> None:
        if events & OUT:
            try:
                pending.out.flush()
            except StreamBroken as exc:
                self._refuse(pending, f"the connection failed during the handshake ({exc})")
                return
        if events & (IN | TROUBLE):
            self._advance(pending)

    def _advance(self, pending: _Pending) -> None:
        """Read what a connection sent of its handshake and answer it."""
        want = hs.HELLO_BYTES if pending.hello is None else hs.CONFIRM_BYTES
        try:
            data = pending.sock.recv(want - len(pending.got))
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            self._refuse(pending, f"the connection failed during the handshake ({exc})")
            return
        if not data:
            self._refuse(pending, "closed before finishing the handshake")
            return
        pending.got += data
        code = self._protection.code
        try:
            if pending.hello is None:
                if len(pending.got) < want:
                    hs.check_hello_prefix(bytes(pending.got))
                    return
                hello = hs.verify_hello(self._key, self.edge_id, code, bytes(pending.got))
                pending.hello, pending.since = hello, time.monotonic()
                pending.got.clear()
                pending.out.write(
                    hs.challenge(self._key, self.edge_id, code, hello.nonce_p, pending.nonce_c)
                )
                return
            if len(pending.got) < want:
                hs.check_confirm_prefix(bytes(pending.got))
                return
            nonce_p = pending.hello.nonce_p
            hs.verify_confirm(
                self._key, self.edge_id, code, pending.nonce_c, nonce_p, bytes(pending.got)
            )
        except hs.HandshakeRefused as exc:
            if exc.refusal is not None:
                with contextlib.suppress(StreamBroken):
                    pending.out.write(hs.refuse(exc.refusal, self._protection.code))
            self._refuse(pending, str(exc))
            return
        except StreamBroken as exc:
            self._refuse(pending, f"the connection failed during the handshake ({exc})")
            return
        self._pending.pop(pending.sock.fileno())
        self._seal, self._opener = self._protection.seals(
            self._key, pending.nonce_c, nonce_p, producer=False
        )
        self._tag = bytearray(self._opener.tag_bytes)
        self._conn, self._out = pending.sock, pending.out
        log.info(
            "edge %d: producer %s connected (%s)",
            self.edge_id,
            pending.peer,
            self._protection.name,
        )
        self._stop_listening()

    def _stop_listening(self) -> None:
        """No more connections: close the port, turn away whoever is mid-handshake, and
        withdraw the address."""
        if self._listener is not None:
            self._listener.close()
            self._listener = None
            with contextlib.suppress(OSError):
                self._rendezvous.withdraw(self.run_id, self.edge_id)
        for pending in list(self._pending.values()):
            self._refuse(pending, "the edge has its producer, or is closed")
        self._strangers.sum_up()
