"""TCP edges (EDGES_AND_WORKERS.md §2-§3 across a network, here on loopback): the ring
stays with the consumer, credit is its free slots, records arrive in publish order, a
full ring blocks the producer and nothing is dropped, waits are bounded, close wakes
both ends, every header is checked before a record counts as loaded; before a record
flows both ends prove they hold the run's secret, and strangers on the port change
nothing; every frame after the handshake is sealed, so a relay in the middle that holds
no key can neither change, replay, reorder nor inject one, and with encryption it reads
none."""

from __future__ import annotations

import logging
import socket
import threading
import time
import uuid

import pytest

from runplan import RingSpec
from runplan.dtypes import DTypeFamily
from runplan.plan import Layout, ObjectKind, ObjectSpec
from runplan.record_header import HeaderCheck, HeaderDType, ObjectHeader
from runtime_core.edge_ends import EdgeFaultError, ReceiveEnd, SendEnd
from runtime_core.ring import EdgeClosed, EdgeTimeout
from runtime_cupy.edges import handshake as hs
from runtime_cupy.edges.port import EdgeSetupError
from runtime_cupy.edges.tcp import (
    FRAME,
    RECORD,
    TcpMedium,
    TcpReceiveRing,
    TcpSendRing,
    split_address,
)
from runtime_cupy.edges.tcp_frames import LEAVE
from runtime_cupy.edges.tcp_seal import AUTHENTICATED, ENCRYPTED, Protection
from runtime_cupy.process.keys import edge_key, new_secret
from tests.support.edge_peers import as_producer, recv_exact, sealed
from tests.support.waits import watch_space

SPEC = ObjectSpec(ObjectKind.TOKEN, Layout.TOKEN_IDS, DTypeFamily.UINT, 4, 64)
RING = RingSpec(slot_count=2, alignment=64, slot_bytes=256)
EDGE = 3


class Refusals(logging.Handler):
    """Why the consumer turned each connection away, from its log (any thread)."""

    def __init__(self) -> None:
        super().__init__()
        self.reasons: list[str] = []
        logging.getLogger("runtime_cupy.edges.tcp").addHandler(self)

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if "refused a connection" in message:
            self.reasons.append(message.split(": ", 2)[2])

    def close(self) -> None:
        logging.getLogger("runtime_cupy.edges.tcp").removeHandler(self)
        super().close()


class MemoryRendezvous:
    def __init__(self) -> None:
        self.addresses: dict[tuple[str, int], str] = {}

    def publish(self, run_id: str, edge_id: int, address: str) -> None:
        self.addresses[(run_id, edge_id)] = address

    def lookup(self, run_id: str, edge_id: int) -> str | None:
        return self.addresses.get((run_id, edge_id))

    def withdraw(self, run_id: str, edge_id: int) -> None:
        self.addresses.pop((run_id, edge_id), None)


class Edge:
    """Both ends of one TCP edge in this process, the consumer serviced by a thread as
    its stage's loop would be (``service``), the producer attached as a stage does."""

    def __init__(
        self,
        secret: bytes | None = None,
        producer_secret: bytes | None = None,
        protection: Protection = AUTHENTICATED,
        producer_protection: Protection | None = None,
    ) -> None:
        self.run_id = f"test-{uuid.uuid4().hex}"
        self.secret = secret or new_secret()
        self.rendezvous = MemoryRendezvous()
        self.medium = TcpMedium(self.rendezvous, protection=protection)
        self.producer_medium = TcpMedium(
            self.rendezvous, protection=producer_protection or protection
        )
        self.key = edge_key(self.secret, self.run_id, EDGE)
        self.ring = self.medium.create(self.run_id, EDGE, RING, self.key)
        self.receiver = ReceiveEnd(self.ring, HeaderCheck.for_edge(self.run_id, EDGE, SPEC, 8))
        self.producer_key = edge_key(producer_secret or self.secret, self.run_id, EDGE)
        self.refusals = Refusals()
        self._stop = threading.Event()

    @property
    def address(self) -> tuple[str, int]:
        address = self.rendezvous.lookup(self.run_id, EDGE)
        assert address is not None
        return split_address(address)

    def service_for(self, seconds: float) -> None:
        """Run the consumer's side of the loop (accept, handshakes) for a while."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline and not self._stop.is_set():
            self.ring._data.wait(0.01)

    def attach(self, timeout_s: float = 10) -> SendEnd:
        """Attach as a stage does, retrying while the consumer's loop serves."""
        ring: TcpSendRing | None = None
        deadline = time.monotonic() + timeout_s
        while ring is None:
            assert time.monotonic() < deadline, "the producer never attached"
            ring = self.producer_medium.attach(self.run_id, EDGE, RING, self.producer_key)
            self.ring._data.wait(0.002)
        return SendEnd(ring, self.run_id, EDGE, SPEC)

    def close(self) -> None:
        self._stop.set()
        self.ring.detach()
        self.refusals.close()


def _record(n: int) -> bytes:
    return n.to_bytes(4, "little")


def test_records_arrive_in_order_and_a_full_ring_blocks_the_producer() -> None:
    edge = Edge()
    sender = edge.attach()
    producer_waits = watch_space(sender.ring)
    sent: list[int] = []

    def produce() -> None:  # 20 records through 2 slots
        for n in range(20):
            sender.send(n, 1, HeaderDType.U32, _record(n), timeout_s=20)
            sent.append(n)

    thread = threading.Thread(target=produce)
    thread.start()
    got = []
    try:
        for n in range(20):
            record = edge.receiver.receive(timeout_s=20)
            assert record.header.sequence == n and record.header.run_id == edge.run_id
            if n == 0:  # a slow step: the producer fills the other slot, then must wait
                assert producer_waits.wait(10)
                assert len(sent) == RING.slot_count  # sent with credit, no more
                assert edge.ring.published - edge.ring.released <= RING.slot_count
            got.append(int.from_bytes(record.payload, "little"))
            edge.receiver.release(record)
        thread.join(20)
        assert got == list(range(20)) and sent == list(range(20))
    finally:
        sender.ring.detach()  # type: ignore[attr-defined]
        edge.close()


def test_without_credit_the_producer_waits_with_a_bound() -> None:
    edge = Edge()
    sender = edge.attach()
    try:
        for n in range(RING.slot_count):
            sender.send(n, 1, HeaderDType.U32, _record(n), timeout_s=5)
        began = time.monotonic()
        with pytest.raises(EdgeTimeout):  # the consumer never releases: no credit
            sender.send(2, 1, HeaderDType.U32, _record(2), timeout_s=0.3)
        assert time.monotonic() - began < 10
        assert sender.ring.published == RING.slot_count  # nothing sent without credit
    finally:
        sender.ring.detach()  # type: ignore[attr-defined]
        edge.close()


def test_close_wakes_both_ends() -> None:
    edge = Edge()
    sender = edge.attach()
    try:
        for n in range(RING.slot_count):
            sender.send(n, 1, HeaderDType.U32, _record(n), timeout_s=5)
        woken: list[str] = []

        def wait_for_space() -> None:
            try:
                sender.send(2, 1, HeaderDType.U32, _record(2), timeout_s=30)
            except EdgeClosed as exc:
                woken.append(str(exc))

        waiting = watch_space(sender.ring)
        thread = threading.Thread(target=wait_for_space)
        thread.start()
        assert waiting.wait(10)  # it waits for credit now
        began = time.monotonic()
        edge.receiver.close()
        edge.ring.detach()  # what the stopping consumer does next: CLOSE leaves
        thread.join(20)
        assert woken and "closed by its consumer" in woken[0]
        assert time.monotonic() - began < 10  # woken by the close, not the 30 s bound
        with pytest.raises(EdgeClosed):  # and nothing is delivered after close
            edge.receiver.receive(timeout_s=1)
    finally:
        sender.ring.detach()  # type: ignore[attr-defined]
        edge.close()


def test_a_producer_close_reaches_a_waiting_consumer() -> None:
    edge = Edge()
    sender = edge.attach()
    try:
        sender.close()
        sender.ring.detach()  # type: ignore[attr-defined]
        with pytest.raises(EdgeClosed, match="closed by its producer"):
            edge.receiver.receive(timeout_s=10)
    finally:
        edge.close()


def test_a_producer_that_lets_go_without_closing_is_no_fault() -> None:
    edge = Edge()
    sender = edge.attach()
    try:
        sender.send(0, 1, HeaderDType.U32, _record(0), timeout_s=5)
        sender.ring.detach()  # type: ignore[attr-defined]  # LEAVE, then the stream ends
        record = edge.receiver.receive(timeout_s=10)
        assert record.header.sequence == 0  # what was sent before is still delivered
        with pytest.raises(EdgeTimeout):  # then the consumer waits, as for a quiet producer
            edge.receiver.receive(timeout_s=0.2)
    finally:
        edge.close()


def test_a_malformed_record_is_refused_on_load_and_nothing_is_consumed() -> None:
    edge = Edge()
    sender_ring = edge.attach().ring
    try:
        wrong = ObjectSpec(ObjectKind.ACTIVATION, Layout.ROW_MAJOR, DTypeFamily.FLOAT, 4, 64)
        SendEnd(sender_ring, edge.run_id, EDGE, wrong).send(0, 1, HeaderDType.F32, bytes(8), 1)
        with pytest.raises(EdgeFaultError, match="KIND_MISMATCH"):
            edge.receiver.receive(timeout_s=10)
        assert edge.ring.released == 0
    finally:
        sender_ring.detach()  # type: ignore[attr-defined]
        edge.close()


def _authenticated(edge: Edge) -> tuple[socket.socket, object]:
    """A raw connection that completed the handshake (holding the key), and the seal of
    what it sends."""
    sock = socket.create_connection(edge.address, timeout=10)
    thread = threading.Thread(target=edge.service_for, args=(1.0,))
    thread.start()
    send, _ = as_producer(sock, edge.key, EDGE)
    thread.join()
    return sock, send


def _header_and_body(edge: Edge) -> bytes:
    header = ObjectHeader(edge.run_id, EDGE, 0, ObjectKind.TOKEN, HeaderDType.U32, 1, 4)
    return header.pack() + _record(0)


@pytest.mark.parametrize(
    ("frames", "reason"),
    [
        (lambda seal, body: FRAME.pack(RECORD, 100_000) + body, "a record of 100000 bytes"),
        (lambda seal, body: sealed(seal, RECORD, len(body) + 4, body + b"\0" * 4),
         "whose header says"),
        (lambda seal, body: b"".join(sealed(seal, RECORD, len(body), body) for _ in range(3)),
         "beyond its credit"),
        (lambda seal, body: FRAME.pack(9, 0), "unknown kind 9"),
    ],
)  # fmt: skip
def test_a_stream_that_breaks_the_framing_closes_the_edge(frames: object, reason: str) -> None:
    edge = Edge()
    sock, seal = _authenticated(edge)
    try:
        sock.sendall(frames(seal, _header_and_body(edge)))  # type: ignore[operator]
        with pytest.raises(EdgeClosed, match=reason):
            for _ in range(3):  # the valid ones before the bad one still come out
                record = edge.receiver.receive(timeout_s=10)
                assert record.header.sequence == 0
    finally:
        sock.close()
        edge.close()


def test_a_frame_without_its_seal_closes_the_edge_and_is_never_delivered() -> None:
    """An unsealed record (as before frames were sealed), one sealed with another key,
    one whose number was skipped: none is loaded, and the edge names why."""
    for forge in ("unsealed", "other key", "skipped number"):
        edge = Edge()
        sock, seal = _authenticated(edge)
        body = _header_and_body(edge)
        try:
            if forge == "unsealed":
                sock.sendall(FRAME.pack(RECORD, len(body)) + body + bytes(32))
            elif forge == "other key":
                other, _ = AUTHENTICATED.seals(new_secret(), b"c" * 32, b"p" * 32, producer=True)
                sock.sendall(sealed(other, RECORD, len(body), body))
            else:
                sealed(seal, LEAVE)  # sealed as frame 0, never sent: the record is frame 1
                sock.sendall(sealed(seal, RECORD, len(body), body))
            with pytest.raises(EdgeClosed, match="frame 0 from the producer failed authentication"):
                edge.receiver.receive(timeout_s=10)
            assert edge.ring.published == 0, forge
        finally:
            sock.close()
            edge.close()


def test_a_producer_without_the_secret_is_refused_at_attach() -> None:
    edge = Edge(producer_secret=new_secret())
    try:
        with pytest.raises(EdgeSetupError, match="does not hold its run's secret"):
            edge.attach()
        assert edge.refusals.reasons == ["wrong key: the peer does not hold this run's secret"]
        assert not edge.ring.connected
    finally:
        edge.close()


def test_ends_that_seal_otherwise_are_refused_naming_it() -> None:
    edge = Edge(protection=ENCRYPTED, producer_protection=AUTHENTICATED)
    try:
        with pytest.raises(EdgeSetupError, match="it seals its records otherwise") as refused:
            edge.attach()
        assert "(it: encrypted (AES-256-GCM); this end: authenticated (HMAC-SHA256))" in str(
            refused.value
        ), "the producer is told how both ends seal"
        assert edge.refusals.reasons == [
            "a producer that seals its records with protection 1 (this end: 2)"
        ]
    finally:
        edge.close()


def test_a_consumer_without_the_secret_gets_no_records() -> None:
    """A stranger listening where the rendezvous points is not taken for the consumer."""
    run_id = f"test-{uuid.uuid4().hex}"
    rendezvous = MemoryRendezvous()
    listener = socket.create_server(("127.0.0.1", 0))
    rendezvous.publish(run_id, EDGE, f"127.0.0.1:{listener.getsockname()[1]}")
    medium = TcpMedium(rendezvous)
    key = edge_key(new_secret(), run_id, EDGE)

    refused = threading.Event()

    def impostor() -> None:
        conn, _ = listener.accept()
        hello = hs.verify_hello(key, EDGE, AUTHENTICATED.code, recv_exact(conn, hs.HELLO_BYTES))
        wrong = edge_key(new_secret(), run_id, EDGE)
        conn.sendall(hs.challenge(wrong, EDGE, AUTHENTICATED.code, hello.nonce_p, b"x" * 32))
        refused.wait(10)  # hold the connection until the producer has refused it
        conn.close()

    thread = threading.Thread(target=impostor)
    thread.start()
    try:
        with pytest.raises(EdgeSetupError, match="does not hold this run's secret"):
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                if medium.attach(run_id, EDGE, RING, key) is not None:
                    pytest.fail("attached to an impostor")
                time.sleep(0.002)
    finally:
        refused.set()
        thread.join(10)
        listener.close()


def test_strangers_on_the_port_change_nothing() -> None:
    edge = Edge()
    address = edge.address
    service = threading.Thread(target=edge.service_for, args=(3.0,))
    service.start()
    strangers: list[socket.socket] = []
    try:
        # Garbage.
        garbage = socket.create_connection(edge.address, timeout=10)
        garbage.sendall(b"GET / HTTP/1.1\r\n\r\n")
        # A wrong secret.
        wrong = socket.create_connection(edge.address, timeout=10)
        stranger_key = edge_key(new_secret(), edge.run_id, EDGE)
        wrong.sendall(hs.hello(stranger_key, EDGE, AUTHENTICATED.code, hs.new_nonce()))
        # A producer of another edge of this run (the right secret, the wrong edge).
        other = socket.create_connection(edge.address, timeout=10)
        other_key = edge_key(edge.secret, edge.run_id, EDGE + 1)
        other.sendall(hs.hello(other_key, EDGE + 1, AUTHENTICATED.code, hs.new_nonce()))
        # A record for this edge without any handshake.
        header = ObjectHeader(edge.run_id, EDGE, 0, ObjectKind.TOKEN, HeaderDType.U32, 1, 4)
        record = socket.create_connection(edge.address, timeout=10)
        record.sendall(FRAME.pack(RECORD, 132) + header.pack() + _record(0))
        # Half a handshake, then silence.
        half = socket.create_connection(edge.address, timeout=10)
        half.sendall(hs.HELLO_MAGIC + bytes([hs.VERSION]))
        strangers = [garbage, wrong, other, record, half]
        deadline = time.monotonic() + 10
        while len(edge.refusals.reasons) < 4 and time.monotonic() < deadline:
            time.sleep(0.01)
        refused = sorted(edge.refusals.reasons)
        assert len(refused) == 4, refused
        assert refused[0] == f"a producer of edge {EDGE + 1} (this is edge {EDGE})"
        not_ours = "not a producer's handshake of this protocol (first bytes b'"
        assert refused[1].startswith(not_ours + "G")
        assert refused[2].startswith(not_ours + "\\x01")
        assert refused[3] == "wrong key: the peer does not hold this run's secret"
        # Those that sent a whole HELLO were told why.
        assert hs.REFUSE_MAGIC in wrong.recv(64) and hs.REFUSE_MAGIC in other.recv(64)
        assert not edge.ring.connected and edge.ring.published == 0
        # The producer still gets in, and its records through; the half handshake is
        # turned away once it has.
        service.join()
        sender = edge.attach()
        sender.send(0, 1, HeaderDType.U32, _record(7), timeout_s=5)
        got = edge.receiver.receive(timeout_s=10)
        assert got.header.sequence == 0 and bytes(got.payload) == _record(7)
        assert edge.refusals.reasons[-1] == "the edge has its producer, or is closed"
        assert edge.rendezvous.lookup(edge.run_id, EDGE) is None  # no longer listening
        with pytest.raises(OSError):
            socket.create_connection(address, timeout=5)
        sender.ring.detach()  # type: ignore[attr-defined]
    finally:
        for sock in strangers:
            sock.close()
        edge.close()


def test_a_consumer_ring_is_a_ring_of_its_own_with_credit_for_each_release() -> None:
    edge = Edge()
    sender = edge.attach()
    try:
        assert isinstance(edge.ring, TcpReceiveRing) and isinstance(sender.ring, TcpSendRing)
        for n in range(6):
            sender.send(n, 1, HeaderDType.U32, _record(n), timeout_s=10)
            record = edge.receiver.receive(timeout_s=10)
            edge.receiver.release(record)
        assert edge.ring.released == 6
        assert sender.ring.published == 6 and sender.ring.released >= 4
    finally:
        sender.ring.detach()  # type: ignore[attr-defined]
        edge.close()
