"""The control channel of a stage on another host: a TCP connection from the stage's
supervisor to the orchestrator, opened before the stage process starts and handed to it
(its ``--control-fd``), so that the stage process is the same as on one host.

The orchestrator listens on its host's address (one port per run, closed at cleanup);
the supervisor connects and proves, with the challenge-response of TCP edges
(``edges.handshake``: HMAC-SHA256 over fresh nonces; the stage index in the edge id's
place, protection ``CONTROL``: the channel seals its own frames), that it holds the
stage's control key (``keys.control_key``), for the stage index it claims; the
orchestrator proves the same back. A stranger on the port (garbage, a wrong key, a
handshake left half done, a stage other than the one awaited) is refused, logged and
changes nothing: every connection's handshake goes on beside the others', each within
``HANDSHAKE_S``, so one that says nothing holds no stage up. The supervisor's side has
``HANDSHAKE_S`` for its whole handshake too (``edges.handshake_read``): an orchestrator,
or a man in the middle, that trickles its answer a byte at a time ends it at the bound.
As on every port strangers knock on (``edges.strangers``): past ``MAX_STRANGERS``
handshakes under way whose HELLO has not proven the key the oldest of them is refused
(one that proved it is never pushed out by strangers; past ``MAX_PROVEN`` of those,
replayed HELLOs, the oldest proven one goes); an ``accept`` that fails (``EMFILE``,
``ENOMEM``, ...) refuses the oldest stranger and rests the port ``ACCEPT_PAUSE_S``;
refusals past the first few are summed up in the log.
Each knock is given a last look at what it sent before it is pushed out: a slow stage
whose HELLO came while strangers flooded the port is proven then, and the next stranger
goes instead; a proven one whose CONFIRM came is let in.
Both ends get keepalive and ``TCP_USER_TIMEOUT`` (``streams.keep_alive``): a host that goes silent
without a FIN breaks the channel within ``streams.SILENT_PEER_S``. Frames are then
those of ``control.ControlChannel``, numbered and MAC'd per stage.
"""

from __future__ import annotations

import contextlib
import logging
import select
import socket
import time
from collections.abc import Callable

from runtime_cupy.edges import handshake as hs
from runtime_cupy.edges.handshake_read import HandshakeDeadline, read_message
from runtime_cupy.edges.strangers import (
    ACCEPT_PAUSE_S,
    LISTEN_BACKLOG,
    MAX_PROVEN,
    MAX_STRANGERS,
    Look,
    StrangerLog,
    turn_away_oldest,
)
from runtime_cupy.process.streams import keep_alive

log = logging.getLogger("runtime_cupy.hosts.ray")

#: How long one connection may take over its whole handshake (either end).
HANDSHAKE_S = 10.0
#: The handshake's protection code for a control link (its frames are
#: ``control.ControlChannel``'s, numbered and MAC'd).
CONTROL = 0


class ControlLinkError(ConnectionError):
    """No authentic control connection came (in time)."""


def _split(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"not a host:port address: {address!r}")
    return host.strip("[]"), int(port)


class _Knock:
    """A connection to the orchestrator's port whose handshake is under way: its HELLO
    read (``nonce_c`` then set, the challenge sent), then its CONFIRM. Reads never take
    more than the message being read, so nothing of the channel's frames is taken."""

    def __init__(self, conn: socket.socket, peer: object, now: float) -> None:
        self.conn = conn
        self.peer = peer
        self.since = now
        self.got = b""
        self.nonce_p = b""
        self.nonce_c: bytes | None = None

    def advance(self, stage_index: int, key: bytes) -> bool:
        """Read what has come; ``True`` once the handshake is done (``OSError``,
        ``ControlLinkError`` or ``hs.HandshakeRefused`` if it cannot be)."""
        nonce_c = self.nonce_c
        hello = nonce_c is None
        need = (hs.HELLO_BYTES if hello else hs.CONFIRM_BYTES) - len(self.got)
        try:
            chunk = self.conn.recv(need)
        except (BlockingIOError, InterruptedError):
            return False
        if not chunk:
            raise ControlLinkError(f"the peer closed the connection after {len(self.got)} bytes")
        self.got += chunk
        (hs.check_hello_prefix if hello else hs.check_confirm_prefix)(self.got)
        if len(chunk) < need:
            return False
        data, self.got = self.got, b""
        if hello:
            try:
                self.nonce_p = hs.verify_hello(key, stage_index, CONTROL, data).nonce_p
            except hs.HandshakeRefused as exc:
                if exc.refusal is not None:
                    with contextlib.suppress(OSError):
                        self.conn.send(hs.refuse(exc.refusal))
                raise
            self.nonce_c = hs.new_nonce()
            reply = hs.challenge(key, stage_index, CONTROL, self.nonce_p, self.nonce_c)
            if self.conn.send(reply) != len(reply):  # a fresh socket's buffer holds it
                raise ControlLinkError("the challenge did not fit the connection's buffer")
            return False
        assert nonce_c is not None
        hs.verify_confirm(key, stage_index, CONTROL, nonce_c, self.nonce_p, data)
        return True


class ControlListener:
    """The orchestrator's port for its stages' control connections."""

    def __init__(self, bind_host: str) -> None:
        family = socket.AF_INET6 if ":" in bind_host else socket.AF_INET
        self._sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            self._sock.bind((bind_host, 0))
            self._sock.listen(LISTEN_BACKLOG)
        except BaseException:
            self._sock.close()
            raise
        port = self._sock.getsockname()[1]
        self.address = f"[{bind_host}]:{port}" if ":" in bind_host else f"{bind_host}:{port}"
        self._strangers = StrangerLog(log, f"control port {self.address}")

    def accept(
        self, stage_index: int, key: bytes, timeout_s: float, gone: Callable[[], str | None]
    ) -> socket.socket:
        """The authentic connection of stage ``stage_index``; ``ControlLinkError`` if
        none came within ``timeout_s``, or once ``gone()`` says why none will come.

        Every connection's handshake goes on at once (``_Knock``), each within
        ``HANDSHAKE_S``: a stranger that connects and says nothing, or says it slowly,
        holds no one else's up (one did, the stage's own handshake then running out
        behind it)."""
        deadline = time.monotonic() + timeout_s
        poller = select.poll()
        listening = self._sock.fileno()
        poller.register(listening, select.POLLIN)
        knocks: dict[int, _Knock] = {}  # oldest first
        rests_until: float | None = None  # the port unwatched until then

        def refuse(fd: int, why: object) -> None:
            knock = knocks.pop(fd)
            poller.unregister(fd)
            self._strangers.refused(knock.peer, str(why))
            knock.conn.close()

        def advance(fd: int) -> socket.socket | None:
            """Read what knock ``fd`` sent (refused if it proves it wrong); its
            connection once its handshake is done."""
            knock = knocks[fd]
            try:
                done = knock.advance(stage_index, key)
            except (OSError, hs.HandshakeRefused) as exc:
                refuse(fd, exc)
                return None
            if not done:
                return None
            del knocks[fd]
            poller.unregister(fd)
            conn = knock.conn
            conn.setblocking(True)
            keep_alive(conn)
            return conn

        def push_out(
            proven: bool, why: str, enough: Callable[[], bool] = lambda: False
        ) -> socket.socket | None:
            """Refuse the oldest knock that has (``proven``) or has not proven the key,
            after a last look at what it sent: a stranger whose HELLO came meanwhile
            is proven, not refused (the next stranger goes instead, unless that is
            ``enough``), and a proven one whose CONFIRM came is let in (returned)."""
            let_in: list[socket.socket] = []

            def look(fd: int) -> Look:
                conn = advance(fd)
                if conn is not None:
                    let_in.append(conn)
                if conn is not None or fd not in knocks:  # let in, or refused by its look
                    return Look.GONE
                return Look.SAME if (knocks[fd].nonce_c is not None) == proven else Look.MOVED

            oldest_first = [fd for fd, k in knocks.items() if (k.nonce_c is not None) == proven]
            turn_away_oldest(oldest_first, look, lambda fd: refuse(fd, why), enough)
            return let_in[0] if let_in else None

        def count(proven: bool) -> int:
            return sum((k.nonce_c is not None) == proven for k in knocks.values())

        def make_room() -> socket.socket | None:
            """Push out the oldest knocks that have not proven the key past
            ``MAX_STRANGERS``, and the oldest proven ones past ``MAX_PROVEN``, each
            after a last look; a proven one whose CONFIRM came is let in (returned)."""
            while count(False) > MAX_STRANGERS:
                why = "pushed out by newer connections before it proved the key"
                push_out(False, why, lambda: count(False) <= MAX_STRANGERS)
            while count(True) > MAX_PROVEN:
                conn = push_out(True, "pushed out by newer connections that proved the key")
                if conn is not None:
                    return conn
            return None

        try:
            while True:
                why = gone()
                if why is not None:
                    raise ControlLinkError(why)
                now = time.monotonic()
                left = deadline - now
                if left <= 0:
                    raise ControlLinkError(f"no control connection within {timeout_s:.0f} s")
                for fd in [fd for fd, k in knocks.items() if now - k.since > HANDSHAKE_S]:
                    refuse(fd, f"no handshake within {HANDSHAKE_S:g} s")
                wait_s = min(left, 0.2)
                if rests_until is not None:
                    if now < rests_until:
                        wait_s = min(wait_s, rests_until - now)
                    else:
                        rests_until = None
                        poller.register(listening, select.POLLIN)
                for fd, _events in poller.poll(wait_s * 1000.0):
                    if fd == listening:
                        try:
                            conn, peer = self._sock.accept()
                        except (BlockingIOError, InterruptedError):
                            continue
                        except OSError as exc:  # EMFILE, ENOMEM, ...: passing
                            self._strangers.accept_failed(exc)
                            why = f"turned away to free a descriptor ({exc.strerror})"
                            push_out(False, why)  # (a stranger's look lets no one in)
                            poller.unregister(listening)
                            rests_until = time.monotonic() + ACCEPT_PAUSE_S
                            continue
                        conn.setblocking(False)
                        knocks[conn.fileno()] = _Knock(conn, peer, time.monotonic())
                        poller.register(conn.fileno(), select.POLLIN)
                        let_in = make_room()
                        if let_in is not None:
                            return let_in
                        continue
                    if fd not in knocks:
                        continue
                    let_in = advance(fd)
                    if let_in is None:
                        let_in = make_room()  # one more proven, maybe
                    if let_in is not None:
                        return let_in
        finally:
            for knock in knocks.values():
                knock.conn.close()
            self._strangers.sum_up()

    def close(self) -> None:
        self._sock.close()


def connect(address: str, stage_index: int, key: bytes, timeout_s: float) -> socket.socket:
    """The supervisor's side: connect to the orchestrator (within ``timeout_s``) and
    prove the stage's key, the whole handshake within ``HANDSHAKE_S``
    (``edges.handshake_read``: ``HandshakeTimeUp`` past it, however the orchestrator's
    answer trickled in; ``HandshakeClosed`` if it closes first; ``hs.HandshakeRefused``
    for a refusal or an answer that does not prove the key)."""
    host, port = _split(address)
    sock = socket.create_connection((host, port), timeout=timeout_s)
    try:
        deadline = HandshakeDeadline(HANDSHAKE_S)
        sock.settimeout(HANDSHAKE_S)
        nonce_p = hs.new_nonce()
        sock.sendall(hs.hello(key, stage_index, CONTROL, nonce_p))
        head = read_message(sock, hs.REPLY_HEAD_BYTES, hs.check_reply_prefix, deadline)
        rest = hs.reply_bytes(head) - len(head)
        rest_data = read_message(sock, rest, lambda _data: None, deadline)
        nonce_c = hs.read_reply(key, stage_index, CONTROL, nonce_p, head + rest_data)
        sock.sendall(hs.confirm(key, stage_index, CONTROL, nonce_c, nonce_p))
        sock.settimeout(None)
        keep_alive(sock)
    except BaseException:
        with contextlib.suppress(OSError):
            sock.close()
        raise
    return sock
