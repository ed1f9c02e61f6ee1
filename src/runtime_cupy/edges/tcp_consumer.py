"""The consumer's end of a TCP edge: the ring, in this process, filled from the
producer's stream; the port strangers knock on (see ``edges.tcp``)."""

from __future__ import annotations

import contextlib
import logging
import socket

from runplan.plan import OBJECT_HEADER_BYTES, RingSpec
from runplan.record_header import EXTENT_OFFSET
from runtime_core.ring import EdgeClosed, ring_bytes
from runtime_cupy.edges import handshake as hs
from runtime_cupy.edges.port import ProcessRing, Rendezvous
from runtime_cupy.edges.tcp_frames import (
    CLOSE,
    CLOSED,
    DETACH_DRAIN_S,
    FRAME,
    LEAVE,
    ONE_CREDIT,
    PUBLISHED,
    RECORD,
    RELEASED,
    U64,
    Quiet,
    SocketWait,
    anonymous,
    peer_of,
)
from runtime_cupy.process.poller import IN, OUT, TROUBLE, Entry
from runtime_cupy.process.streams import Outbox, StreamBroken, keep_alive

log = logging.getLogger("runtime_cupy.edges.tcp")

#: Handshakes a consumer keeps open at once; a newer stranger pushes out the oldest.
MAX_PENDING = 16
#: What one read of a consumer's stream takes at most (a decode step's record, and more).
_SCRATCH_BYTES = 64 << 10


class _Pending:
    """A connection to the consumer's port that has not proved itself yet."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.peer = peer_of(sock)
        self.out = Outbox(sock)
        self.nonce_c = hs.new_nonce()
        self.got = bytearray()
        self.out.write(hs.challenge(self.nonce_c))


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
    ) -> None:
        super().__init__(spec, anonymous(ring_bytes(spec)), SocketWait(self), Quiet())
        self._ctr = [0, 0, 0]
        self.run_id, self.edge_id = run_id, edge_id
        self._key = key
        self._listener: socket.socket | None = listener
        self._rendezvous = rendezvous
        self._pending: dict[int, _Pending] = {}
        self._conn: socket.socket | None = None
        self._out: Outbox | None = None
        self._why: str | None = None  # why the edge is closed
        self._left = False  # the producer let go (LEAVE): its end of stream is no fault
        self._done = False  # nothing more is read from the stream
        self._head = bytearray(FRAME.size)
        self._head_got = 0
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
                self._out.write(ONE_CREDIT)
            except StreamBroken as exc:
                self._fail(f"cannot return credit: {exc}")

    def close(self) -> None:
        """Close the edge: nothing more is delivered; the producer hears CLOSE."""
        if self._why is None:
            self._why = "the edge was closed"
        self._ctr[CLOSED] = 1
        self._stop_listening()
        if self._out is not None and not self._done:
            with contextlib.suppress(StreamBroken):
                self._out.write(FRAME.pack(CLOSE, 0))
        self._done = True

    def _fail(self, why: str) -> None:
        if self._why is None:
            self._why = why
        self._ctr[CLOSED] = 1
        self._done = True

    # -- the loop's side --------------------------------------------------------------------
    def watch(self, want: bool) -> tuple[Entry, ...]:
        entries: list[Entry] = []
        if self._listener is not None:
            entries.append((self._listener.fileno(), IN))
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
        assert self._listener is not None
        while True:
            try:
                sock, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                log.warning("edge %d: accept failed: %s", self.edge_id, exc)
                return
            keep_alive(sock)
            log.debug("edge %d: accepted %s", self.edge_id, peer_of(sock))
            try:
                pending = _Pending(sock)
            except StreamBroken:
                sock.close()
                continue
            if len(self._pending) >= MAX_PENDING:
                oldest = next(iter(self._pending))
                self._refuse(self._pending[oldest], "pushed out by newer connections")
            self._pending[sock.fileno()] = pending

    def _refuse(self, pending: _Pending, why: str) -> None:
        log.warning("edge %d: refused a connection from %s: %s", self.edge_id, pending.peer, why)
        self._pending.pop(pending.sock.fileno(), None)
        pending.sock.close()

    def _handshake(self, pending: _Pending, events: int) -> None:
        try:
            if events & OUT:
                pending.out.flush()
            if not events & (IN | TROUBLE):
                return
            data = pending.sock.recv(hs.PROOF_BYTES - len(pending.got))
        except (BlockingIOError, InterruptedError):
            return
        except (OSError, StreamBroken) as exc:
            self._refuse(pending, f"the connection failed during the handshake ({exc})")
            return
        if not data:
            self._refuse(pending, "closed before finishing the handshake")
            return
        pending.got += data
        try:
            if len(pending.got) < hs.PROOF_BYTES:
                hs.check_proof_prefix(bytes(pending.got))
                return
            proof = hs.verify_proof(self._key, self.edge_id, pending.nonce_c, bytes(pending.got))
            pending.out.write(hs.accept(self._key, self.edge_id, pending.nonce_c, proof.nonce_p))
        except hs.HandshakeRefused as exc:
            self._refuse(pending, str(exc))
            return
        except StreamBroken as exc:
            self._refuse(pending, f"the connection failed during the handshake ({exc})")
            return
        self._pending.pop(pending.sock.fileno())
        self._conn, self._out = pending.sock, pending.out
        log.info("edge %d: producer %s connected", self.edge_id, pending.peer)
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
                        if self._body_got == len(body):
                            self._record_done(body)
                        continue
                else:
                    n = conn.recv_into(scratch)
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                self._fail(f"the producer's connection broke: {exc}")
                return
            if n == 0:
                if not self._left or self._body is not None or self._head_got:
                    self._fail("the producer's connection ended")
                self._done = True
                return
            self._take(scratch[:n])
            if n < len(scratch):
                return

    def _take(self, data: memoryview) -> None:
        """Frames (or parts of them) read from the stream."""
        pos, end = 0, len(data)
        head = self._head
        while pos < end and not self._done:
            body = self._body
            if body is not None:
                take = min(len(body) - self._body_got, end - pos)
                body[self._body_got : self._body_got + take] = data[pos : pos + take]
                self._body_got += take
                pos += take
                if self._body_got == len(body):
                    self._record_done(body)
                continue
            take = min(FRAME.size - self._head_got, end - pos)
            head[self._head_got : self._head_got + take] = data[pos : pos + take]
            self._head_got += take
            pos += take
            if self._head_got == FRAME.size:
                self._head_got = 0
                self._frame(*FRAME.unpack(head))

    def _frame(self, kind: int, value: int) -> None:
        ctr = self._ctr
        if kind == RECORD:
            if ctr[PUBLISHED] - ctr[RELEASED] >= self._slot_count:
                self._fail("the producer sent beyond its credit")
            elif not OBJECT_HEADER_BYTES <= value <= self.spec.slot_bytes:
                self._fail(
                    f"a record of {value} bytes; slots hold "
                    f"{OBJECT_HEADER_BYTES}..{self.spec.slot_bytes}"
                )
            else:
                slot = self.slot(ctr[PUBLISHED] % self._slot_count)
                self._body, self._body_got = slot[:value], 0
        elif kind == CLOSE:
            self._fail("the edge was closed by its producer")
        elif kind == LEAVE:
            self._left = True
        else:
            self._fail(f"a frame of unknown kind {kind}")

    def _record_done(self, body: memoryview) -> None:
        self._body = None
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
