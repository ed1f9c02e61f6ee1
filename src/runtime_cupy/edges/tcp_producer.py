"""The producer's end of a TCP edge: its connection from ``connect`` to a verified
ACCEPT, then one slot of staging, records sent with credit (see ``edges.tcp``)."""

from __future__ import annotations

import contextlib
import errno
import select
import socket

from runplan.plan import OBJECT_HEADER_BYTES, RingSpec
from runplan.record_header import EXTENT_OFFSET
from runtime_core.ring import EdgeClosed, RingError, ring_bytes
from runtime_cupy.edges import handshake as hs
from runtime_cupy.edges.port import ProcessRing
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
    split_address,
)
from runtime_cupy.process.poller import IN, OUT, TROUBLE, Entry
from runtime_cupy.process.streams import Outbox, StreamBroken, keep_alive


class TcpSendRing(ProcessRing):
    """The producer's end: one slot of staging (the ring is the consumer's), records
    sent with credit, credits counted as they come back."""

    def __init__(self, spec: RingSpec, edge_id: int, sock: socket.socket) -> None:
        super().__init__(spec, anonymous(ring_bytes(spec)), Quiet(), SocketWait(self))
        self._ctr = [0, 0, 0]
        self.edge_id = edge_id
        self._sock: socket.socket | None = sock
        # Credit bounds what can wait to leave: every record the consumer has room for.
        self._out = Outbox(sock, spec.slot_count * (spec.slot_bytes + FRAME.size) + (1 << 16))
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
        if ctr[PUBLISHED] - ctr[RELEASED] >= self._slot_count:
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
        length = OBJECT_HEADER_BYTES + U64.unpack_from(view, EXTENT_OFFSET)[0]
        try:
            self._out.write_pair(FRAME.pack(RECORD, length), view[:length])
        except StreamBroken as exc:
            self._fail(f"the consumer's connection broke: {exc}")
            raise EdgeClosed(self._why) from None
        self._ctr[PUBLISHED] = reserved + 1

    def close(self) -> None:
        if self._why is None:
            self._why = "the edge was closed"
            with contextlib.suppress(StreamBroken):
                self._out.write(FRAME.pack(CLOSE, 0))
        self._ctr[CLOSED] = 1

    def _fail(self, why: str) -> None:
        if self._why is None:
            self._why = why
        self._ctr[CLOSED] = 1
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
            while len(self._in) >= FRAME.size and not self._done:
                kind, value = FRAME.unpack_from(self._in)
                del self._in[: FRAME.size]
                if kind == CREDIT and ctr[RELEASED] + value <= ctr[PUBLISHED]:
                    ctr[RELEASED] += value
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
                self._out.write(FRAME.pack(LEAVE, 0))
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


class Connector:
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
