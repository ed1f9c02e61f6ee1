"""The consumer's end of a TCP edge: the ring, in this process, filled from the
producer's stream of sealed frames (see ``edges.tcp``); the port strangers knock on,
and the handshake that lets the producer in, are ``tcp_door``'s."""

from __future__ import annotations

import contextlib
import socket
import time

from runplan.plan import OBJECT_HEADER_BYTES, RingSpec
from runplan.record_header import EXTENT_OFFSET
from runtime_core.ring import EdgeClosed, ring_bytes
from runtime_cupy.edges.port import ProcessRing, Rendezvous
from runtime_cupy.edges.strangers import StrangerLog
from runtime_cupy.edges.tcp_door import ConsumerDoor, _Pending, log
from runtime_cupy.edges.tcp_frames import (
    CLOSE,
    CLOSED,
    CREDIT,
    DETACH_DRAIN_S,
    FRAME,
    FRAME_STALL_S,
    LEAVE,
    PUBLISHED,
    RECORD,
    RELEASED,
    U64,
    Quiet,
    SocketWait,
    anonymous,
    unauthentic,
)
from runtime_cupy.edges.tcp_seal import FrameSeal, Protection
from runtime_cupy.process.poller import IN, OUT, TROUBLE, Entry
from runtime_cupy.process.streams import Outbox, StreamBroken

#: What one read of a consumer's stream takes at most (a decode step's record, and more).
_SCRATCH_BYTES = 64 << 10
_NO_BODY = memoryview(bytearray())


class TcpReceiveRing(ConsumerDoor, ProcessRing):
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
        self._strangers = StrangerLog(log, f"edge {edge_id}")  # its refusals, accepts failed
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
        self._byte_at = 0.0  # time.monotonic() of the stream's last byte

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
        if conn is not None and not self._done:
            self._check_stall(time.monotonic())
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

    # -- the stream ---------------------------------------------------------------------
    def _check_stall(self, now: float) -> None:
        """Close the edge on a frame begun that has had no byte for ``FRAME_STALL_S``: a
        length changed on the way had the consumer wait, for ever, for bytes its
        producer never sends (waiting in turn for the credit this frame would return),
        and the run end only at its token bound, naming no link."""
        if (self._frame is None and not self._head_got) or now - self._byte_at < FRAME_STALL_S:
            return
        if self._frame is None:
            what = f"a frame's head stopped after {self._head_got} of {FRAME.size} bytes"
        else:
            body = self._body
            announced = len(body) if body is not None else 0
            got = self._body_got if body is not None else 0
            what = (
                f"a frame announced with {announced} bytes stopped after {got} of them and "
                f"{self._tag_got} of its seal's"
            )
        self._fail(
            f"{what}: nothing more for {FRAME_STALL_S:g} s (its length changed on the way, "
            "or its producer stopped mid-frame)"
        )

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
                        self._byte_at = time.monotonic()
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
            if n:
                self._byte_at = time.monotonic()
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
