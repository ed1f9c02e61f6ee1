"""The consumer's end of a TCP edge: the ring, in this process, filled from the
producer's stream of sealed frames; the port strangers knock on (see ``edges.tcp``).

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
for ``ACCEPT_PAUSE_S`` (watched at once, a loop would spin on it and log each turn)."""

from __future__ import annotations

import contextlib
import logging
import socket
import time

from runplan.plan import OBJECT_HEADER_BYTES, RingSpec
from runplan.record_header import EXTENT_OFFSET
from runtime_core.ring import EdgeClosed, ring_bytes
from runtime_cupy.edges import handshake as hs
from runtime_cupy.edges.port import ProcessRing, Rendezvous
from runtime_cupy.edges.tcp_frames import (
    CLOSE,
    CLOSED,
    CREDIT,
    DETACH_DRAIN_S,
    FRAME,
    LEAVE,
    PUBLISHED,
    RECORD,
    RELEASED,
    U64,
    Quiet,
    SocketWait,
    anonymous,
    peer_of,
    unauthentic,
)
from runtime_cupy.edges.tcp_seal import FrameSeal, Protection
from runtime_cupy.process.poller import IN, OUT, TROUBLE, Entry
from runtime_cupy.process.streams import Outbox, StreamBroken, keep_alive

log = logging.getLogger("runtime_cupy.edges.tcp")

#: Connections not proven yet that a consumer keeps open at once.
MAX_STRANGERS = 64
#: Connections whose HELLO proved the key, waiting for their CONFIRM, kept at once.
MAX_PROVEN = 4
#: Seconds a stranger has to prove the key (its HELLO), and a proven one to CONFIRM.
HELLO_S = 10.0
CONFIRM_S = 30.0
#: Connections the kernel queues for ``accept``, and those taken from it at one turn of
#: the owner's loop (the poll brings it back for the rest: a flood never holds it).
LISTEN_BACKLOG = 128
ACCEPTS_PER_TURN = 32
#: Seconds the port goes unwatched after an ``accept`` that failed (EMFILE, ...).
ACCEPT_PAUSE_S = 0.05
#: Refusals an edge logs one by one (WARNING); past them, a flood is summed up in one
#: WARNING every ``REFUSAL_SUMMARY_S`` (each refusal still at DEBUG), so strangers on the
#: port cannot fill the stage's log.
LOGGED_REFUSALS = 16
REFUSAL_SUMMARY_S = 10.0
#: Reasons a summary counts one by one (a reason may name what a stranger sent, so a
#: flood could make them many); the rest are counted together.
SUMMED_REASONS = 8
#: What one read of a consumer's stream takes at most (a decode step's record, and more).
_SCRATCH_BYTES = 64 << 10
_NO_BODY = memoryview(bytearray())


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


class TcpReceiveRing(ProcessRing):
    """The consumer's end: the ring, in this process, filled from the producer's stream."""

    def __init__(
        self,
        spec: RingSpec,
        run_id: str,
        edge_id: int,
        key: bytes,
        listener: socket.socket,
        rendezvous: Rendezvous,
        protection: Protection,
    ) -> None:
        super().__init__(spec, anonymous(ring_bytes(spec)), SocketWait(self), Quiet())
        self._ctr = [0, 0, 0]
        self.run_id, self.edge_id = run_id, edge_id
        self._key = key
        self._protection = protection
        self._listener: socket.socket | None = listener
        self._rendezvous = rendezvous
        self._pending: dict[int, _Pending] = {}  # by descriptor, oldest first
        self._refusals = 0  # connections turned away so far
        self._unsummed: dict[str, int] = {}  # refusals not yet in a summary, by reason
        self._summed_since = 0.0  # time.monotonic() of the first refusal not summed up
        self._accept_failures = 0  # accepts that failed so far (the first logged)
        self._rests_until = 0.0  # time.monotonic() until which the port goes unwatched
        self._conn: socket.socket | None = None
        self._out: Outbox | None = None
        self._seal: FrameSeal | None = None  # what this end sends
        self._opener: FrameSeal | None = None  # what the producer sends
        self._why: str | None = None  # why the edge is closed
        self._left = False  # the producer let go (LEAVE): its end of stream is no fault
        self._done = False  # nothing more is read from the stream
        self._head = bytearray(FRAME.size)
        self._head_got = 0
        self._frame: tuple[int, int, bytes] | None = None  # kind, value, head being read
        self._tag = bytearray()
        self._tag_got = 0
        self._frames_in = 0
        self._scratch = memoryview(bytearray(_SCRATCH_BYTES))
        self._body: memoryview | None = None  # the slot a record is being read into
        self._body_got = 0

    @property
    def connected(self) -> bool:
        return self._conn is not None

    # -- ring operations ------------------------------------------------------------------
    def try_acquire(self) -> int | None:
        if self._why is not None:
            raise EdgeClosed(self._why)
        return super().try_acquire()

    def release(self, index: int) -> None:
        super().release(index)
        if self._out is not None and not self._done:
            try:
                self._send(CREDIT, 1)
            except StreamBroken as exc:
                self._fail(f"cannot return credit: {exc}")

    def _send(self, kind: int, value: int) -> None:
        """Send a frame without a body (CREDIT, CLOSE), sealed."""
        assert self._out is not None and self._seal is not None
        head = FRAME.pack(kind, value)
        _, tag = self._seal.seal(head, b"")
        self._out.write_parts(head, tag)

    def close(self) -> None:
        """Close the edge: nothing more is delivered; the producer hears CLOSE."""
        if self._why is None:
            self._why = "the edge was closed"
        self._ctr[CLOSED] = 1
        self._stop_listening()
        if self._out is not None and not self._done:
            with contextlib.suppress(StreamBroken):
                self._send(CLOSE, 0)
        self._done = True

    def _fail(self, why: str) -> None:
        if self._why is None:
            self._why = why
        self._ctr[CLOSED] = 1
        self._done = True

    # -- the loop's side --------------------------------------------------------------------
    def watch(self, want: bool) -> tuple[Entry, ...]:
        entries: list[Entry] = []
        if self._listener is not None and time.monotonic() >= self._rests_until:
            entries.append((self._listener.fileno(), IN))
        if self._pending:
            self._expire(time.monotonic())
        for fd, pending in self._pending.items():
            entries.append((fd, IN | (OUT if pending.out.wants_write else 0)))
        conn, out = self._conn, self._out
        if conn is not None and out is not None:
            events = (IN if want and not self._done else 0) | (OUT if out.wants_write else 0)
            if events or not self._done:
                entries.append((conn.fileno(), events))
        return tuple(entries)

    def ready(self, fd: int, events: int) -> None:
        if self._listener is not None and fd == self._listener.fileno():
            self._accept()
        elif fd in self._pending:
            self._handshake(self._pending[fd], events)
        elif self._conn is not None and fd == self._conn.fileno() and self._out is not None:
            if events & OUT:
                try:
                    self._out.flush()
                except StreamBroken as exc:
                    self._fail(str(exc))
            if events & (IN | TROUBLE) and not self._done:
                self._pump()

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
        self._accept_failures += 1
        level = logging.WARNING if self._accept_failures == 1 else logging.DEBUG
        log.log(level, "edge %d: accept failed (%d so far): %s; the port rests %g s after each",
                self.edge_id, self._accept_failures, exc, ACCEPT_PAUSE_S)  # fmt: skip
        strangers = [p for p in self._pending.values() if p.hello is None]
        if strangers:
            self._push_out(strangers[0], f"turned away to free a descriptor ({exc.strerror})")
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
        strangers = [p for p in self._pending.values() if p.hello is None]
        while len(strangers) > MAX_STRANGERS and self._listener is not None:
            self._push_out(
                strangers.pop(0), "pushed out by newer connections before it proved the key"
            )
        proven = [p for p in self._pending.values() if p.hello is not None]
        for oldest in proven[: max(0, len(proven) - MAX_PROVEN)]:
            self._refuse(oldest, "pushed out by newer connections that proved the key")

    def _push_out(self, stranger: _Pending, why: str) -> None:
        """Turn a stranger away unless a last look at what it sent proves it."""
        self._advance(stranger)
        if stranger.sock.fileno() in self._pending and stranger.hello is None:
            self._refuse(stranger, why)

    def _refuse(self, pending: _Pending, why: str) -> None:
        self._refusals += 1
        if self._refusals <= LOGGED_REFUSALS:
            log.warning(
                "edge %d: refused a connection from %s: %s", self.edge_id, pending.peer, why
            )
        else:
            log.debug("edge %d: refused a connection from %s: %s", self.edge_id, pending.peer, why)
            now = time.monotonic()
            unsummed = self._unsummed
            if not unsummed:
                self._summed_since = now  # a summary's interval begins
            if why not in unsummed and len(unsummed) >= SUMMED_REASONS:
                why = "for other reasons"
            unsummed[why] = unsummed.get(why, 0) + 1
            if now - self._summed_since >= REFUSAL_SUMMARY_S:
                self._sum_up()
        self._pending.pop(pending.sock.fileno(), None)
        pending.sock.close()

    def _sum_up(self) -> None:
        """One WARNING for the refusals not logged one by one since the last summary,
        counted by reason."""
        unsummed, self._unsummed = self._unsummed, {}
        if unsummed:
            log.warning(
                "edge %d: refused %d more connections (%d in all): %s",
                self.edge_id,
                sum(unsummed.values()),
                self._refusals,
                "; ".join(f"{n} {why}" for why, n in unsummed.items()),
            )

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
        self._sum_up()

    # -- the stream ---------------------------------------------------------------------
    def _pump(self) -> None:
        """Read what the stream holds into the ring's slots: a record that came with its
        head is copied from the read buffer; the rest of a larger one is read straight
        into its slot. One read when the socket had less than a buffer's worth (level-
        triggered poll brings the loop back for whatever came later)."""
        conn = self._conn
        assert conn is not None
        scratch = self._scratch
        while not self._done:
            body = self._body
            try:
                if body is not None and len(body) - self._body_got >= len(scratch):
                    n = conn.recv_into(body[self._body_got :])
                    if n:
                        self._body_got += n
                        self._frame_progress()
                        continue
                else:
                    n = conn.recv_into(scratch)
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                self._fail(f"the producer's connection broke: {exc}")
                return
            if n == 0:
                if not self._left or self._frame is not None or self._head_got:
                    self._fail("the producer's connection ended")
                self._done = True
                return
            self._take(scratch[:n])
            if n < len(scratch):
                return

    def _take(self, data: memoryview) -> None:
        """Frames (or parts of them) read from the stream: head, body, tag."""
        pos, end = 0, len(data)
        head, tag = self._head, self._tag
        while pos < end and not self._done:
            body = self._body
            if body is not None and self._body_got < len(body):
                take = min(len(body) - self._body_got, end - pos)
                body[self._body_got : self._body_got + take] = data[pos : pos + take]
                self._body_got += take
                pos += take
                self._frame_progress()
                continue
            if self._frame is not None:
                take = min(len(tag) - self._tag_got, end - pos)
                tag[self._tag_got : self._tag_got + take] = data[pos : pos + take]
                self._tag_got += take
                pos += take
                self._frame_progress()
                continue
            take = min(FRAME.size - self._head_got, end - pos)
            head[self._head_got : self._head_got + take] = data[pos : pos + take]
            self._head_got += take
            pos += take
            if self._head_got == FRAME.size:
                self._head_got = 0
                self._frame_head(bytes(head))

    def _frame_head(self, head: bytes) -> None:
        """A frame's head, before its body and seal: where its body goes."""
        kind, value = FRAME.unpack(head)
        ctr = self._ctr
        if kind == RECORD:
            if ctr[PUBLISHED] - ctr[RELEASED] >= self._slot_count:
                self._fail("the producer sent beyond its credit")
                return
            if not OBJECT_HEADER_BYTES <= value <= self.spec.slot_bytes:
                self._fail(
                    f"a record of {value} bytes; slots hold "
                    f"{OBJECT_HEADER_BYTES}..{self.spec.slot_bytes}"
                )
                return
            self._body, self._body_got = self.slot(ctr[PUBLISHED] % self._slot_count)[:value], 0
        elif kind not in (CLOSE, LEAVE):
            self._fail(f"a frame of unknown kind {kind}")
            return
        self._frame, self._tag_got = (kind, value, head), 0
        self._frame_progress()

    def _frame_progress(self) -> None:
        """Open the frame once its body and tag are in, and act on it."""
        frame = self._frame
        if frame is None or self._tag_got < len(self._tag):
            return
        body = self._body
        if body is not None and self._body_got < len(body):
            return
        self._frame, self._body = None, None
        kind, _, head = frame
        assert self._opener is not None
        if not self._opener.open(head, body if body is not None else _NO_BODY, bytes(self._tag)):
            self._fail(unauthentic("producer", self._frames_in))
            return
        self._frames_in += 1
        if kind == RECORD and body is not None:
            self._record_done(body)
        elif kind == CLOSE:
            self._fail("the edge was closed by its producer")
        elif kind == LEAVE:
            self._left = True

    def _record_done(self, body: memoryview) -> None:
        extent = U64.unpack_from(body, EXTENT_OFFSET)[0]
        if extent != len(body) - OBJECT_HEADER_BYTES:
            self._fail(
                f"a record framed as {len(body)} bytes whose header says {extent} bytes of payload"
            )
            return
        self._ctr[PUBLISHED] += 1

    def detach(self) -> None:
        self._stop_listening()
        conn, out = self._conn, self._out
        self._conn = self._out = None
        self._done = True
        if conn is not None and out is not None:
            with contextlib.suppress(OSError, ValueError):
                out.drain(DETACH_DRAIN_S)
            conn.close()
