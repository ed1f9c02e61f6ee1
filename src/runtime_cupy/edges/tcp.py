"""Edges over TCP (EDGES_AND_WORKERS.md §2-§3 between hosts): the ring stays with the
consumer and a stream carries records to it; the producer's credit is the consumer's
free slots, returned one by one as slots are released.

So the ring contract holds unchanged across the network:

- a full ring blocks the producer: it sends a record only with credit (``published -
  released < slot_count``, ``released`` counted from the consumer's credits), and a
  producer that sends beyond its credit breaks the stream; nothing is dropped or
  overwritten;
- records arrive, and leave the ring, in publish order (one stream, slots in turn);
- every wait is bounded by the run's timeouts (the ends never wait on their own: the
  owner's loop does, with its bounds), and a silent peer (no FIN: a cut cable, a host
  gone) breaks the connection within ``streams.SILENT_PEER_S`` (kernel keepalive and
  ``TCP_USER_TIMEOUT``), which poll reports as an error even on an end nobody reads;
- either end may close the edge: a CLOSE frame, or the connection's end, wakes the
  other end's loop and its next operation raises ``EdgeClosed``; a producer that lets
  go without closing (its stage stopped; the consumer may still wait for its own
  StopRun) says so with LEAVE;
- the receiving end (``runtime_core.edges.ReceiveEnd``) validates every header before
  a record counts as loaded; the stream itself is checked as it is read (a record
  larger than a slot, or whose header disagrees with its frame, breaks the stream).

The consumer listens on a port of its own and publishes ``host:port`` at the host
port's rendezvous under ``(run_id, edge_id)``; the producer looks it up and connects.
Before a record flows, both prove they hold the run's secret (``handshake``). A stranger
on the port (garbage, a wrong key, a half-finished handshake, a producer of another
edge) is refused, logged, and changes nothing; once its producer is in, the consumer
stops listening and withdraws its address. The handshake authenticates the connection;
the records after it are neither signed nor encrypted (the stages are trusted, §10, and
a stranger off the path cannot write into an established stream).

Frames after the handshake are an 8-byte head ``kind:u8 pad:3 value:u32``:

    producer -> consumer   RECORD value=length, then the record (header + payload)
                           CLOSE, LEAVE
    consumer -> producer   CREDIT value=slots released, CLOSE
"""

from __future__ import annotations

import contextlib
import errno
import logging
import mmap
import select
import socket
import struct

from runplan.header import EXTENT_OFFSET
from runplan.plan import OBJECT_HEADER_BYTES, RingSpec
from runtime_core.ring import EdgeClosed, RingError, ring_bytes
from runtime_cupy.edges import handshake as hs
from runtime_cupy.edges.base import EdgeSetupError, ProcessRing, Rendezvous
from runtime_cupy.poller import IN, OUT, TROUBLE, Entry
from runtime_cupy.streams import Outbox, StreamBroken, keep_alive

log = logging.getLogger("runtime_cupy.edges.tcp")

_FRAME = struct.Struct("<BxxxI")
RECORD, CREDIT, CLOSE, LEAVE = 1, 2, 3, 4
_ONE_CREDIT = _FRAME.pack(CREDIT, 1)
_U64 = struct.Struct("<Q")
_PUBLISHED, _RELEASED, _CLOSED = 0, 1, 2
#: Handshakes a consumer keeps open at once; a newer stranger pushes out the oldest.
MAX_PENDING = 16
#: What one read of a consumer's stream takes at most (a decode step's record, and more).
_SCRATCH_BYTES = 64 << 10
#: How long a process letting go of an end waits for its last frames to leave.
DETACH_DRAIN_S = 0.5


def split_address(address: str) -> tuple[str, int]:
    """``host:port`` (``[v6]:port`` too) as ``(host, port)``; ``ValueError`` if not."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise ValueError(f"not an address: {address!r} (expected host:port)")
    return host.strip("[]"), int(port)


def _peer(sock: socket.socket) -> str:
    try:
        host, port = sock.getpeername()[:2]
    except OSError:
        return "?"
    return f"{host}:{port}"


class _Wait:
    """The ring's ``Signal`` for blocking waits outside an event loop (``wait_acquire``,
    ``wait_reserve``): poll what the ring watches, and let it take what came."""

    def __init__(self, ring: ProcessRing) -> None:
        self.ring = ring

    def notify(self) -> None:
        pass

    def wait(self, timeout_s: float) -> None:
        poller = select.poll()
        for fd, events in self.ring.watch(True):
            poller.register(fd, events)
        for fd, events in poller.poll(max(0.0, timeout_s) * 1000.0):
            self.ring.ready(fd, events)


class _Quiet:
    def notify(self) -> None:
        pass

    def wait(self, timeout_s: float) -> None:
        pass


def _anonymous(size: int) -> memoryview:
    """Zeroed memory that takes pages only where written (a slot's worth, mostly)."""
    return memoryview(mmap.mmap(-1, max(size, 1)))


# -- the consumer ---------------------------------------------------------------------


class _Pending:
    """A connection to the consumer's port that has not proved itself yet."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.peer = _peer(sock)
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
        super().__init__(spec, _anonymous(ring_bytes(spec)), _Wait(self), _Quiet())
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
        self._head = bytearray(_FRAME.size)
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
                self._out.write(_ONE_CREDIT)
            except StreamBroken as exc:
                self._fail(f"cannot return credit: {exc}")

    def close(self) -> None:
        """Close the edge: nothing more is delivered; the producer hears CLOSE."""
        if self._why is None:
            self._why = "the edge was closed"
        self._ctr[_CLOSED] = 1
        self._stop_listening()
        if self._out is not None and not self._done:
            with contextlib.suppress(StreamBroken):
                self._out.write(_FRAME.pack(CLOSE, 0))
        self._done = True

    def _fail(self, why: str) -> None:
        if self._why is None:
            self._why = why
        self._ctr[_CLOSED] = 1
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
            log.debug("edge %d: accepted %s", self.edge_id, _peer(sock))
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
            take = min(_FRAME.size - self._head_got, end - pos)
            head[self._head_got : self._head_got + take] = data[pos : pos + take]
            self._head_got += take
            pos += take
            if self._head_got == _FRAME.size:
                self._head_got = 0
                self._frame(*_FRAME.unpack(head))

    def _frame(self, kind: int, value: int) -> None:
        ctr = self._ctr
        if kind == RECORD:
            if ctr[_PUBLISHED] - ctr[_RELEASED] >= self._slot_count:
                self._fail("the producer sent beyond its credit")
            elif not OBJECT_HEADER_BYTES <= value <= self.spec.slot_bytes:
                self._fail(
                    f"a record of {value} bytes; slots hold "
                    f"{OBJECT_HEADER_BYTES}..{self.spec.slot_bytes}"
                )
            else:
                slot = self.slot(ctr[_PUBLISHED] % self._slot_count)
                self._body, self._body_got = slot[:value], 0
        elif kind == CLOSE:
            self._fail("the edge was closed by its producer")
        elif kind == LEAVE:
            self._left = True
        else:
            self._fail(f"a frame of unknown kind {kind}")

    def _record_done(self, body: memoryview) -> None:
        self._body = None
        extent = _U64.unpack_from(body, EXTENT_OFFSET)[0]
        if extent != len(body) - OBJECT_HEADER_BYTES:
            self._fail(
                f"a record framed as {len(body)} bytes whose header says {extent} bytes of payload"
            )
            return
        self._ctr[_PUBLISHED] += 1

    def detach(self) -> None:
        self._stop_listening()
        conn, out = self._conn, self._out
        self._conn = self._out = None
        self._done = True
        if conn is not None and out is not None:
            with contextlib.suppress(OSError, ValueError):
                out.drain(DETACH_DRAIN_S)
            conn.close()


# -- the producer ---------------------------------------------------------------------


class TcpSendRing(ProcessRing):
    """The producer's end: one slot of staging (the ring is the consumer's), records
    sent with credit, credits counted as they come back."""

    def __init__(self, spec: RingSpec, edge_id: int, sock: socket.socket) -> None:
        super().__init__(spec, _anonymous(ring_bytes(spec)), _Quiet(), _Wait(self))
        self._ctr = [0, 0, 0]
        self.edge_id = edge_id
        self._sock: socket.socket | None = sock
        # Credit bounds what can wait to leave: every record the consumer has room for.
        self._out = Outbox(sock, spec.slot_count * (spec.slot_bytes + _FRAME.size) + (1 << 16))
        self._in = bytearray()
        self._why: str | None = None
        self._done = False

    def slot(self, index: int) -> memoryview:
        """The staging slot, whatever ``index`` (records leave it as they are published)."""
        return super().slot(0)

    def try_reserve(self) -> int | None:
        if self._why is not None:
            raise EdgeClosed(self._why)
        ctr = self._ctr
        if ctr[_PUBLISHED] - ctr[_RELEASED] >= self._slot_count:
            self._pump()  # credits that came back, not read yet
            if self._why is not None:
                raise EdgeClosed(self._why)
        return super().try_reserve()

    def publish(self, index: int) -> None:
        reserved = self._reserved
        if reserved is None or index != reserved % self._slot_count:
            raise RingError(f"slot {index} was not reserved")
        self._reserved = None
        if self._why is not None:
            raise EdgeClosed(self._why)
        view = super().slot(0)
        length = OBJECT_HEADER_BYTES + _U64.unpack_from(view, EXTENT_OFFSET)[0]
        try:
            self._out.write_pair(_FRAME.pack(RECORD, length), view[:length])
        except StreamBroken as exc:
            self._fail(f"the consumer's connection broke: {exc}")
            raise EdgeClosed(self._why) from None
        self._ctr[_PUBLISHED] = reserved + 1

    def close(self) -> None:
        if self._why is None:
            self._why = "the edge was closed"
            with contextlib.suppress(StreamBroken):
                self._out.write(_FRAME.pack(CLOSE, 0))
        self._ctr[_CLOSED] = 1

    def _fail(self, why: str) -> None:
        if self._why is None:
            self._why = why
        self._ctr[_CLOSED] = 1
        self._done = True

    def watch(self, want: bool) -> tuple[Entry, ...]:
        sock = self._sock
        if sock is None:
            return ()
        events = (IN if want and not self._done else 0) | (OUT if self._out.wants_write else 0)
        if not events and self._done:
            return ()
        return ((sock.fileno(), events),)

    def ready(self, fd: int, events: int) -> None:
        if events & OUT:
            try:
                self._out.flush()
            except StreamBroken as exc:
                self._fail(f"the consumer's connection broke: {exc}")
        if events & (IN | TROUBLE) and not self._done:
            self._pump()

    def _pump(self) -> None:
        """Take the credits and closes the consumer sent."""
        sock = self._sock
        ctr = self._ctr
        while sock is not None and not self._done:
            try:
                data = sock.recv(4096)
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                self._fail(f"the consumer's connection broke: {exc}")
                return
            if not data:
                self._fail("the consumer's connection ended")
                return
            self._in += data
            more = len(data) == 4096
            while len(self._in) >= _FRAME.size and not self._done:
                kind, value = _FRAME.unpack_from(self._in)
                del self._in[: _FRAME.size]
                if kind == CREDIT and ctr[_RELEASED] + value <= ctr[_PUBLISHED]:
                    ctr[_RELEASED] += value
                elif kind == CREDIT:
                    self._fail("credit for records never sent")
                elif kind == CLOSE:
                    self._fail("the edge was closed by its consumer")
                else:
                    self._fail(f"a frame of unknown kind {kind}")
            if not more:
                return

    def detach(self) -> None:
        sock, self._sock = self._sock, None
        if sock is None:
            return
        if not self._done and self._why is None:
            with contextlib.suppress(StreamBroken):
                self._out.write(_FRAME.pack(LEAVE, 0))
        with contextlib.suppress(OSError, ValueError):
            self._out.drain(DETACH_DRAIN_S)
            sock.shutdown(socket.SHUT_WR)
        # Credits not read yet would make the close abortive (a reset, which may cost
        # the consumer records it has not read yet): read them away first.
        with contextlib.suppress(OSError):
            while sock.recv(4096):
                pass
        self._done = True
        sock.close()


class _Connector:
    """A producer's connection to its consumer, from ``connect`` to a verified ACCEPT,
    advanced without blocking each time the producer tries to attach."""

    def __init__(self, address: str, edge_id: int, key: bytes) -> None:
        host, port = split_address(address)
        self.address, self.edge_id, self.key = address, edge_id, key
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.sock = socket.socket(family, socket.SOCK_STREAM)
        self.sock.setblocking(False)
        keep_alive(self.sock)
        self.state = "connecting"
        self.got = bytearray()
        self.nonce_c = b""
        self.nonce_p = hs.new_nonce()
        self.out = Outbox(self.sock)
        err = self.sock.connect_ex((host, port))
        if err not in (0, errno.EINPROGRESS, errno.EAGAIN):
            self.sock.close()
            raise ConnectionRefusedError(err, f"{address}: {errno.errorcode.get(err, err)}")

    def progress(self) -> socket.socket | None:
        """The authenticated socket once the handshake is done, else ``None``;
        ``ConnectionError`` while the consumer cannot be reached (try again later),
        ``hs.HandshakeRefused`` if it proves to be no consumer of this edge."""
        if self.state == "connecting":
            poller = select.poll()
            poller.register(self.sock.fileno(), select.POLLOUT)
            if not poller.poll(0):
                return None
            err = self.sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
            if err:
                raise ConnectionRefusedError(
                    err, f"{self.address}: {errno.errorcode.get(err, err)}"
                )
            self.state = "challenge"
        want = hs.CHALLENGE_BYTES if self.state == "challenge" else hs.ACCEPT_BYTES
        self.out.flush()
        try:
            data = self.sock.recv(want - len(self.got))
        except (BlockingIOError, InterruptedError):
            return None
        if not data:
            raise hs.HandshakeRefused(
                f"the consumer of edge {self.edge_id} at {self.address} closed the connection"
            )
        self.got += data
        if self.state == "challenge":
            if len(self.got) < want:
                hs.check_challenge_prefix(bytes(self.got))
                return None
            self.nonce_c = hs.read_challenge(bytes(self.got))
            self.got.clear()
            self.out.write(hs.proof(self.key, self.edge_id, self.nonce_c, self.nonce_p))
            self.state = "accept"
            return None
        if len(self.got) < want:
            hs.check_accept_prefix(bytes(self.got))
            return None
        hs.verify_accept(self.key, self.edge_id, self.nonce_c, self.nonce_p, bytes(self.got))
        return self.sock

    def close(self) -> None:
        self.sock.close()


class TcpMedium:
    """TCP, for an edge whose ends are on different hosts (or forced, on one host).
    The consumer listens on ``bind_host`` (a free port) and publishes
    ``advertise_host:port`` at ``rendezvous``."""

    name = "tcp"

    def __init__(
        self,
        rendezvous: Rendezvous,
        bind_host: str = "127.0.0.1",
        advertise_host: str | None = None,
    ) -> None:
        self.rendezvous = rendezvous
        self.bind_host = bind_host
        self.advertise_host = advertise_host or bind_host
        self._connecting: dict[tuple[str, int], _Connector] = {}

    def create(self, run_id: str, edge_id: int, spec: RingSpec, key: bytes) -> TcpReceiveRing:
        family = socket.AF_INET6 if ":" in self.bind_host else socket.AF_INET
        listener = socket.socket(family, socket.SOCK_STREAM)
        try:
            listener.bind((self.bind_host, 0))
            listener.listen(MAX_PENDING)
            listener.setblocking(False)
            port = listener.getsockname()[1]
            ring = TcpReceiveRing(spec, run_id, edge_id, key, listener, self.rendezvous)
            host = f"[{self.advertise_host}]" if ":" in self.advertise_host else self.advertise_host
            self.rendezvous.publish(run_id, edge_id, f"{host}:{port}")
            log.debug("edge %d: published %s:%d", edge_id, host, port)
        except BaseException:
            listener.close()
            raise
        return ring

    def attach(self, run_id: str, edge_id: int, spec: RingSpec, key: bytes) -> TcpSendRing | None:
        name = (run_id, edge_id)
        connector = self._connecting.get(name)
        try:
            if connector is None:
                address = self.rendezvous.lookup(run_id, edge_id)
                if address is None:
                    return None
                connector = self._connecting[name] = _Connector(address, edge_id, key)
            sock = connector.progress()
        except hs.HandshakeRefused as exc:
            self._drop(name)
            raise EdgeSetupError(f"edge {edge_id}: {exc}") from None
        except (ConnectionError, OSError, StreamBroken) as exc:
            log.info("edge %d: consumer not reachable yet: %s", edge_id, exc)
            self._drop(name)
            return None  # the consumer is not there (yet, or any more): try again later
        except ValueError as exc:  # what the rendezvous holds is no address
            self._drop(name)
            raise EdgeSetupError(f"edge {edge_id}: {exc}") from None
        if sock is None:
            return None
        del self._connecting[name]
        return TcpSendRing(spec, edge_id, sock)

    def _drop(self, name: tuple[str, int]) -> None:
        connector = self._connecting.pop(name, None)
        if connector is not None:
            connector.close()

    def remove(self, run_id: str, edge_id: int) -> None:
        self._drop((run_id, edge_id))
        with contextlib.suppress(OSError):
            self.rendezvous.withdraw(run_id, edge_id)
