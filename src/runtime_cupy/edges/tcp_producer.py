"""The producer's end of a TCP edge: its connection from ``connect`` to a verified
CHALLENGE and the CONFIRM sent, then one slot of staging, records sent sealed and with
credit (see ``edges.tcp``)."""

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
    unauthentic,
)
from runtime_cupy.edges.tcp_seal import FrameSeal, Protection
from runtime_cupy.process.poller import IN, OUT, TROUBLE, Entry
from runtime_cupy.process.streams import Outbox, StreamBroken, keep_alive


class TcpSendRing(ProcessRing):
    """The producer's end: one slot of staging (the ring is the consumer's), records
    sent sealed with credit, credits counted as they come back (once they open)."""

    def __init__(
        self, spec: RingSpec, edge_id: int, out: Outbox, send: FrameSeal, receive: FrameSeal
    ) -> None:
        super().__init__(spec, anonymous(ring_bytes(spec)), Quiet(), SocketWait(self))
        self._ctr = [0, 0, 0]
        self.edge_id = edge_id
        self._sock: socket.socket | None = out.sock
        self._seal, self._opener = send, receive
        self._frame_bytes = FRAME.size + receive.tag_bytes  # the consumer's frames
        # Credit bounds what can wait to leave: every record the consumer has room for
        # (after what is left of the handshake).
        frame = FRAME.size + send.tag_bytes
        out.limit = spec.slot_count * (spec.slot_bytes + frame) + (1 << 16)
        self._out = out
        self._in = bytearray()
        self._frames_in = 0
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
        head = FRAME.pack(RECORD, length)
        body, tag = self._seal.seal(head, view[:length])
        try:
            self._out.write_parts(head, body, tag)
        except StreamBroken as exc:
            self._fail(f"the consumer's connection broke: {exc}")
            raise EdgeClosed(self._why) from None
        self._ctr[PUBLISHED] = reserved + 1

    def _send(self, kind: int) -> None:
        """Send a frame without a body (CLOSE, LEAVE), sealed."""
        head = FRAME.pack(kind, 0)
        _, tag = self._seal.seal(head, b"")
        self._out.write_parts(head, tag)

    def close(self) -> None:
        if self._why is None:
            self._why = "the edge was closed"
            with contextlib.suppress(StreamBroken):
                self._send(CLOSE)
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
            size = self._frame_bytes
            while len(self._in) >= size and not self._done:
                head = bytes(self._in[: FRAME.size])
                tag = bytes(self._in[FRAME.size : size])
                del self._in[:size]
                if not self._opener.open(head, memoryview(b""), tag):
                    self._fail(unauthentic("consumer", self._frames_in))
                    break
                self._frames_in += 1
                kind, value = FRAME.unpack(head)
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
                self._send(LEAVE)
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
    """A producer's connection to its consumer, from ``connect`` to a verified CHALLENGE
    and the CONFIRM sent, advanced without blocking each time the producer tries to
    attach. The HELLO leaves the moment the connection is up, so that the consumer
    tells this producer from the strangers on its port by its first bytes."""

    def __init__(self, address: str, edge_id: int, key: bytes, protection: Protection) -> None:
        host, port = split_address(address)
        self.address, self.edge_id, self.key = address, edge_id, key
        self.protection = protection
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.sock = socket.socket(family, socket.SOCK_STREAM)
        self.sock.setblocking(False)
        keep_alive(self.sock)
        self.state = "connecting"
        self.got = bytearray()
        self.want = hs.REPLY_HEAD_BYTES
        self.nonce_p = hs.new_nonce()
        self.out = Outbox(self.sock)
        err = self.sock.connect_ex((host, port))
        if err not in (0, errno.EINPROGRESS, errno.EAGAIN):
            self.sock.close()
            raise ConnectionRefusedError(err, f"{address}: {errno.errorcode.get(err, err)}")

    def progress(self) -> tuple[FrameSeal, FrameSeal] | None:
        """Move the handshake on: the seals ``(send, receive)`` once it is done (the
        connection is then ``sock``, what is left to send of the handshake in ``out``),
        else ``None``; ``ConnectionError`` while the consumer cannot be reached or
        turned the connection away unread (``hs.Dropped``: try again later),
        ``hs.HandshakeRefused`` if it refused this producer or proves to be no consumer
        of this edge."""
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
            self.out.write(hs.hello(self.key, self.edge_id, self.protection.code, self.nonce_p))
            self.state = "reply"
        self.out.flush()
        while len(self.got) < self.want:  # the reply's head, then the rest of it
            try:
                data = self.sock.recv(self.want - len(self.got))
            except (BlockingIOError, InterruptedError):
                return None
            if not data:
                raise hs.Dropped(
                    f"the consumer of edge {self.edge_id} at {self.address} closed the "
                    "connection before the handshake was done"
                )
            self.got += data
            hs.check_reply_prefix(bytes(self.got))
            if len(self.got) == hs.REPLY_HEAD_BYTES == self.want:
                self.want = hs.reply_bytes(bytes(self.got))
        code = self.protection.code
        nonce_c = hs.read_reply(self.key, self.edge_id, code, self.nonce_p, bytes(self.got))
        self.out.write(hs.confirm(self.key, self.edge_id, code, nonce_c, self.nonce_p))
        self.state = "done"
        return self.protection.seals(self.key, nonce_c, self.nonce_p, producer=True)

    def close(self) -> None:
        self.sock.close()
