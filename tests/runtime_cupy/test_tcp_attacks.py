"""Attacks on one TCP edge on loopback, as a stranger would play them: a relay in the
middle that holds no key (``tests/support/edge_relay.py``) changes, replays, reorders or
injects a frame, and the edge closes naming the frame that failed, before anything of it
is loaded; with encryption the relay reads nothing of the records; a flood of idle and
garbage connections on the consumer's port never pushes the producer out; a stranger
that stays silent is turned away once its time is up."""

from __future__ import annotations

import logging
import socket
import threading
import time
import uuid
from collections.abc import Iterator

import pytest

from runplan import RingSpec
from runplan.dtypes import DTypeFamily
from runplan.plan import Layout, ObjectKind, ObjectSpec
from runplan.record_header import HeaderCheck, HeaderDType
from runtime_core.edge_ends import ReceiveEnd, SendEnd
from runtime_core.ring import EdgeClosed, EdgeTimeout
from runtime_cupy.edges import strangers as strangers_module
from runtime_cupy.edges import tcp_consumer, tcp_door
from runtime_cupy.edges.tcp import TcpMedium, TcpReceiveRing, TcpSendRing, split_address
from runtime_cupy.edges.tcp_seal import AUTHENTICATED, ENCRYPTED, Protection
from runtime_cupy.process.keys import edge_key, new_secret
from tests.support.descriptors import no_descriptor_left
from tests.support.edge_peers import flood
from tests.support.edge_relay import Relay

SPEC = ObjectSpec(ObjectKind.TOKEN, Layout.TOKEN_IDS, DTypeFamily.UINT, 4, 64)
RING = RingSpec(slot_count=2, alignment=64, slot_bytes=256)
EDGE = 5


class Rendezvous:
    """A rendezvous in memory; ``detour``: the address a producer is told instead."""

    def __init__(self) -> None:
        self.addresses: dict[tuple[str, int], str] = {}
        self.detour: str | None = None

    def publish(self, run_id: str, edge_id: int, address: str) -> None:
        self.addresses[(run_id, edge_id)] = address

    def lookup(self, run_id: str, edge_id: int) -> str | None:
        return self.addresses.get((run_id, edge_id))

    def withdraw(self, run_id: str, edge_id: int) -> None:
        self.addresses.pop((run_id, edge_id), None)


class Told:
    """What the producer looks up: the consumer's address, or a detour's."""

    def __init__(self, real: Rendezvous) -> None:
        self.real = real
        self.detour: str | None = None

    def publish(self, run_id: str, edge_id: int, address: str) -> None:
        raise AssertionError("a producer publishes nothing")

    def lookup(self, run_id: str, edge_id: int) -> str | None:
        return self.detour or self.real.lookup(run_id, edge_id)

    def withdraw(self, run_id: str, edge_id: int) -> None:
        pass


class Refusals(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.reasons: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if "refused a connection" in message:
            self.reasons.append(message.split(": ", 2)[2])


@pytest.fixture
def refusals() -> Iterator[Refusals]:
    handler = Refusals()
    logger = logging.getLogger("runtime_cupy.edges.tcp")
    logger.addHandler(handler)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)


class Pair:
    """Both ends of one edge in this process; the producer looks its consumer up
    through ``told`` (a relay's address, when a test puts one in the way)."""

    def __init__(self, protection: Protection = AUTHENTICATED) -> None:
        self.run_id = f"test-{uuid.uuid4().hex}"
        self.key = edge_key(new_secret(), self.run_id, EDGE)
        self.rendezvous = Rendezvous()
        self.told = Told(self.rendezvous)
        self.ring = TcpMedium(self.rendezvous, protection=protection).create(
            self.run_id, EDGE, RING, self.key
        )
        self.consumer_address = self.rendezvous.lookup(self.run_id, EDGE)
        self.producer_medium = TcpMedium(self.told, protection=protection)
        self.receiver = ReceiveEnd(self.ring, HeaderCheck.for_edge(self.run_id, EDGE, SPEC, 8))
        self.sender: SendEnd | None = None

    def serve(self, seconds: float) -> None:
        """The consumer's loop for a while (accepting, handshakes)."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            self.ring._data.wait(0.005)

    def attach(self, timeout_s: float = 20) -> SendEnd:
        deadline = time.monotonic() + timeout_s
        ring: TcpSendRing | None = None
        while ring is None:
            assert time.monotonic() < deadline, "the producer never attached"
            ring = self.producer_medium.attach(self.run_id, EDGE, RING, self.key)
            self.ring._data.wait(0.002)
        self.sender = SendEnd(ring, self.run_id, EDGE, SPEC)
        return self.sender

    def relay(self, attack: str) -> Relay:
        assert self.consumer_address is not None
        real = split_address(self.consumer_address)
        relay = Relay(lambda: real, attack)
        self.told.detour = f"{relay.address[0]}:{relay.address[1]}"
        return relay

    def close(self) -> None:
        if self.sender is not None:
            self.sender.ring.detach()  # type: ignore[attr-defined]
        self.ring.detach()


def _token(n: int) -> bytes:
    return n.to_bytes(4, "little")


def _send_and_receive(pair: Pair, count: int, *, both_in_flight: bool = False) -> list[int]:
    """Send ``count`` records (two at a time if ``both_in_flight``) and take them; the
    tokens taken. ``EdgeClosed`` with its reason as soon as either end closes."""
    sender = pair.attach()
    got: list[int] = []
    errors: list[EdgeClosed] = []

    def produce() -> None:
        try:
            for n in range(count):
                sender.send(n, 1, HeaderDType.U32, _token(n), timeout_s=10)
        except EdgeClosed as exc:
            errors.append(exc)

    thread = threading.Thread(target=produce, daemon=True)
    thread.start()
    if both_in_flight:
        time.sleep(0.3)  # the producer sends two before the consumer takes any
    deadline = time.monotonic() + 20
    try:
        while len(got) < count and not errors:
            assert time.monotonic() < deadline, f"took {got} only"
            try:
                record = pair.receiver.receive(timeout_s=0.05)
            except EdgeTimeout:
                continue
            got.append(int.from_bytes(record.payload, "little"))
            pair.receiver.release(record)
    finally:
        pair.ring.detach()  # as a stage that stops: the producer's end learns at once
        thread.join(15)
    if errors:
        raise errors[0]
    return got


@pytest.mark.parametrize("protection", [AUTHENTICATED, ENCRYPTED], ids=["hmac", "aes-gcm"])
@pytest.mark.parametrize("attack", ["change@2", "replay@2", "inject@2", "reorder@2"])
def test_a_relay_without_the_key_cannot_change_replay_inject_or_reorder_a_record(
    attack: str, protection: Protection
) -> None:
    pair = Pair(protection)
    relay = pair.relay(attack)
    try:
        with pytest.raises(EdgeClosed, match="frame 2 from the producer failed authentication"):
            _send_and_receive(pair, 5, both_in_flight=attack.startswith("reorder"))
        assert relay.done, "the relay never got to its attack"
        assert pair.ring.published == 2  # records 0 and 1; nothing of the attack was loaded
    finally:
        relay.close()
        pair.close()


@pytest.mark.parametrize("protection", [AUTHENTICATED, ENCRYPTED], ids=["hmac", "aes-gcm"])
def test_a_frame_whose_length_grew_on_the_way_closes_the_edge_when_it_stalls(
    protection: Protection, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A relay adds 64 to the last record's length: the consumer waited for bytes its
    producer never sends (it waits for this record's credit), and the run ended only at
    its token bound, 120 s later, naming no link (a warm chain with ``--recover`` never
    ended). Now the edge closes ``FRAME_STALL_S`` (0.5 here) after the last byte."""
    monkeypatch.setattr(tcp_consumer, "FRAME_STALL_S", 0.5)
    pair = Pair(protection)
    relay = pair.relay("inflate@2")
    try:
        began = time.monotonic()
        stalled = r"a frame announced with \d+ bytes stopped after \d+ of them .*: nothing more"
        with pytest.raises(EdgeClosed, match=stalled + r" for 0.5 s \(its length changed"):
            _send_and_receive(pair, 3)
        assert time.monotonic() - began < 10
        assert relay.done and pair.ring.published == 2
    finally:
        relay.close()
        pair.close()


@pytest.mark.parametrize("protection", [AUTHENTICATED, ENCRYPTED], ids=["hmac", "aes-gcm"])
def test_a_relay_without_the_key_cannot_reorder_the_consumers_credits(
    protection: Protection,
) -> None:
    pair = Pair(protection)
    relay = pair.relay("reorder-credits@0")
    try:
        with pytest.raises(EdgeClosed, match="frame 0 from the consumer failed authentication"):
            _send_and_receive(pair, 6)
        assert relay.done
    finally:
        relay.close()
        pair.close()


def test_an_encrypted_edge_shows_a_relay_nothing_of_its_records() -> None:
    for protection in (AUTHENTICATED, ENCRYPTED):
        pair = Pair(protection)
        relay = pair.relay("pass")
        try:
            assert _send_and_receive(pair, 4) == [0, 1, 2, 3]  # an honest relay changes nothing
            seen = b"".join(relay.records)
            assert len(relay.records) == 4
            in_clear = pair.run_id.encode() in seen
            assert in_clear == (protection is AUTHENTICATED), protection.name
        finally:
            relay.close()
            pair.close()


def _begin(host: str, port: int) -> socket.socket:
    """A connection begun, not waited for (a full backlog would make it wait)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setblocking(False)
    sock.connect_ex((host, port))
    return sock


def test_a_flood_of_strangers_never_pushes_the_producer_out(refusals: Refusals) -> None:
    """The producer connects; before the consumer reads its HELLO, more strangers than
    the port keeps come, and more keep coming: the producer still gets in (proven on a
    last look, or connected again), and its records through."""
    pair = Pair()
    assert pair.consumer_address is not None
    host, port = split_address(pair.consumer_address)
    assert pair.producer_medium.attach(pair.run_id, EDGE, RING, pair.key) is None  # connecting
    pair.serve(0.05)  # its connection is accepted
    idle = [_begin(host, port) for _ in range(strangers_module.MAX_STRANGERS + 16)]
    flooder = threading.Thread(target=flood, args=(host, port, 4.0), daemon=True)
    flooder.start()
    try:
        pair.serve(0.3)
        sender = pair.attach()
        sender.send(0, 1, HeaderDType.U32, _token(42), timeout_s=10)
        record = pair.receiver.receive(timeout_s=10)
        assert int.from_bytes(record.payload, "little") == 42
        pushed = [r for r in refusals.reasons if r.startswith("pushed out")]
        assert pushed and all("before it proved the key" in r for r in pushed)  # strangers
    finally:
        flooder.join(10)
        for sock in idle:
            sock.close()
        pair.close()


def test_a_silent_stranger_is_turned_away_when_its_time_is_up(
    refusals: Refusals, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tcp_door, "HELLO_S", 0.2)
    pair = Pair()
    assert pair.consumer_address is not None
    silent = socket.create_connection(split_address(pair.consumer_address))
    try:
        pair.serve(0.6)
        assert refusals.reasons == ["did not prove it holds the key within 0.2 s"]
        assert isinstance(pair.ring, TcpReceiveRing) and not pair.ring.connected
        assert silent.recv(1) == b""  # closed
    finally:
        silent.close()
        pair.close()


def test_a_flood_of_strangers_is_summed_up_in_the_log_not_logged_one_by_one(
    refusals: Refusals, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # Each stranger sends what is no handshake and is turned away at once: the first
    # LOGGED_REFUSALS are logged one by one, the rest are summed up (here when the edge
    # stops listening, as the summary's interval is long).
    monkeypatch.setattr(strangers_module, "REFUSAL_SUMMARY_S", 3600.0)
    strangers = strangers_module.LOGGED_REFUSALS + 20
    pair = Pair()
    assert pair.consumer_address is not None
    address = split_address(pair.consumer_address)
    caplog.set_level(logging.WARNING, logger="runtime_cupy.edges.tcp")
    try:
        for _ in range(strangers):
            with socket.create_connection(address) as sock:
                sock.sendall(b"GET / HTTP/1.1\r\n" + b"x" * 200)
                pair.serve(0.02)
        deadline = time.monotonic() + 10
        while len(refusals.reasons) < strangers_module.LOGGED_REFUSALS:
            assert time.monotonic() < deadline, refusals.reasons
            pair.serve(0.05)
        pair.serve(0.5)  # the rest are refused too, but not logged one by one
        assert len(refusals.reasons) == strangers_module.LOGGED_REFUSALS
        pair.attach()  # the producer gets in: the port closes, the flood is summed up
        summaries = [r.getMessage() for r in caplog.records if "more connections" in r.message]
        why = "not a producer's handshake of this protocol (first bytes b'GET /')"
        assert summaries == [
            f"edge {EDGE}: refused 20 more connections ({strangers} in all): 20 {why}"
        ]
    finally:
        pair.close()


def test_a_port_with_no_descriptor_to_accept_with_rests_instead_of_spinning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Strangers wait in the backlog while this process has no descriptor left (its
    limit lowered to the lowest free one): each accept fails, the port stays readable,
    and the consumer rests it ``ACCEPT_PAUSE_S`` after each failure (it polled it again
    at once, failing and logging a warning each time, thousands a second), with one
    warning; with descriptors again, the strangers are taken and turned away."""
    pair = Pair()
    assert pair.consumer_address is not None
    strangers = [socket.create_connection(split_address(pair.consumer_address)) for _ in range(3)]
    caplog.set_level(logging.DEBUG, logger="runtime_cupy.edges.tcp")
    serving_s = 0.5
    try:
        with no_descriptor_left():
            pair.serve(serving_s)
        failed = [r for r in caplog.records if "accept failed" in r.getMessage()]
        assert 1 <= len(failed) <= serving_s / strangers_module.ACCEPT_PAUSE_S + 2, len(failed)
        assert [r.levelno for r in failed].count(logging.WARNING) == 1
        for sock in strangers:
            sock.sendall(b"GET / HTTP/1.1\r\n\r\n")
        pair.serve(0.3)
        for sock in strangers:
            sock.settimeout(10)
            assert sock.recv(1) == b""  # accepted, then turned away: closed
    finally:
        for sock in strangers:
            sock.close()
        pair.close()
