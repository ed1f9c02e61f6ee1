"""The ring's rules (EDGES_AND_WORKERS.md §2), stated over any interleaving of the two
ends: no overwrite, publish order, a slot reused only after release, close."""

from __future__ import annotations

import threading
import time
from collections import deque

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from runplan import RingSpec
from runtime_core.ring import EdgeClosed, EdgeTimeout, LocalRing, Ring, RingError
from tests.support.waits import WatchedSignal

SLOT_BYTES = 64


def _stamp(view: memoryview, n: int) -> None:
    view[:8] = n.to_bytes(8, "little")
    view[8:SLOT_BYTES] = bytes([n % 251]) * (SLOT_BYTES - 8)


def _read_stamp(view: memoryview) -> int:
    n = int.from_bytes(view[:8], "little")
    assert bytes(view[8:SLOT_BYTES]) == bytes([n % 251]) * (SLOT_BYTES - 8), "overwritten"
    return n


class RingRules(RuleBasedStateMachine):
    ring_class: type[Ring] = Ring

    @initialize(slots=st.integers(1, 4))
    def make(self, slots: int) -> None:
        self.ring = self.ring_class(RingSpec(slot_count=slots, alignment=64, slot_bytes=SLOT_BYTES))
        self.slots = slots
        self.next_record = 0
        self.reserved: int | None = None
        self.in_ring: deque[int] = deque()  # published, not yet acquired
        self.held: deque[tuple[int, int]] = deque()  # acquired, not released: (slot, record)
        self.received: list[int] = []
        self.closed = False

    def _in_use(self) -> int:
        return len(self.in_ring) + len(self.held) + (self.reserved is not None)

    @precondition(lambda self: self.reserved is None and not self.closed)
    @rule()
    def reserve(self) -> None:
        slot = self.ring.try_reserve()
        if self._in_use() >= self.slots:
            assert slot is None  # backpressure: never overwrite
            return
        assert slot is not None
        assert all(slot != s for s, _ in self.held)  # not a slot still being read
        _stamp(self.ring.slot(slot), self.next_record)
        self.reserved = slot

    @precondition(lambda self: self.reserved is not None and not self.closed)
    @rule()
    def publish(self) -> None:
        assert self.reserved is not None
        self.ring.publish(self.reserved)
        self.in_ring.append(self.next_record)
        self.next_record += 1
        self.reserved = None

    @precondition(lambda self: not self.closed)
    @rule()
    def acquire(self) -> None:
        slot = self.ring.try_acquire()
        if not self.in_ring:
            assert slot is None
            return
        assert slot is not None
        record = _read_stamp(self.ring.slot(slot))
        assert record == self.in_ring.popleft()  # publish order
        self.held.append((slot, record))
        self.received.append(record)

    @precondition(lambda self: bool(self.held))
    @rule()
    def release(self) -> None:
        slot, _ = self.held.popleft()
        self.ring.release(slot)

    @precondition(lambda self: bool(self.held))
    @rule(offset=st.integers(0, 5))
    def release_out_of_order_is_refused(self, offset: int) -> None:
        slot, _ = self.held[0]
        others = [i for i in range(self.slots + 2) if i != slot]
        with pytest.raises(RingError):
            self.ring.release(others[offset % len(others)])

    @rule()
    def close(self) -> None:
        self.ring.close()
        self.closed = True

    @precondition(lambda self: self.closed)
    @rule()
    def nothing_passes_after_close(self) -> None:
        with pytest.raises(EdgeClosed):
            self.ring.try_acquire()
        reserved, self.reserved = self.reserved, None
        with pytest.raises(EdgeClosed):
            if reserved is None:
                self.ring.try_reserve()
            else:
                self.ring.publish(reserved)

    @invariant()
    def records_leave_in_publish_order(self) -> None:
        assert self.received == list(range(len(self.received)))

    @invariant()
    def counters_agree(self) -> None:
        if hasattr(self, "ring"):
            assert self.ring.published - self.ring.released <= self.slots
            assert self.ring.holding == len(self.held)


TestRingRules = RingRules.TestCase


class LocalRingRules(RingRules):
    """The same rules for the in-process ring, which has its own operations."""

    ring_class = LocalRing


TestLocalRingRules = LocalRingRules.TestCase


def _ring(slots: int = 1) -> Ring:
    return Ring(RingSpec(slot_count=slots, alignment=64, slot_bytes=SLOT_BYTES))


def test_a_full_ring_blocks_the_producer_until_the_consumer_releases() -> None:
    space = WatchedSignal()
    ring = Ring(RingSpec(slot_count=1, alignment=64, slot_bytes=SLOT_BYTES), space=space)
    ring.publish(ring.wait_reserve(1.0))
    got: list[int] = []
    producer = threading.Thread(target=lambda: got.append(ring.wait_reserve(5.0)))
    producer.start()
    assert space.waiting.wait(5.0)  # the producer found the ring full and waits
    assert not got  # still waiting: backpressure
    slot = ring.wait_acquire(1.0)
    ring.release(slot)
    producer.join(2.0)
    assert got == [0]


def test_a_wait_that_runs_out_is_an_edge_timeout() -> None:
    ring = _ring(1)
    start = time.monotonic()
    with pytest.raises(EdgeTimeout):
        ring.wait_acquire(0.2)
    assert 0.15 < time.monotonic() - start < 10.0  # (the upper bound: on a hang)
    ring.publish(ring.wait_reserve(1.0))
    with pytest.raises(EdgeTimeout):
        ring.wait_reserve(0.1)


def test_close_wakes_a_waiting_consumer_with_edge_closed() -> None:
    data = WatchedSignal()
    ring = Ring(RingSpec(slot_count=2, alignment=64, slot_bytes=SLOT_BYTES), data=data)
    errors: list[BaseException] = []

    def consume() -> None:
        try:
            ring.wait_acquire(10.0)
        except BaseException as exc:
            errors.append(exc)

    consumer = threading.Thread(target=consume)
    consumer.start()
    assert data.waiting.wait(5.0)  # the consumer found no record and waits
    ring.close()
    consumer.join(2.0)
    assert not consumer.is_alive()
    assert len(errors) == 1 and isinstance(errors[0], EdgeClosed)


def test_records_cross_threads_in_order_under_backpressure() -> None:
    ring = _ring(2)
    n = 500
    seen: list[int] = []

    def produce() -> None:
        for i in range(n):
            slot = ring.wait_reserve(5.0)
            _stamp(ring.slot(slot), i)
            ring.publish(slot)

    producer = threading.Thread(target=produce)
    producer.start()
    for _ in range(n):
        slot = ring.wait_acquire(5.0)
        seen.append(_read_stamp(ring.slot(slot)))
        ring.release(slot)
    producer.join(5.0)
    assert seen == list(range(n))


@pytest.mark.parametrize("packed", [False, True])
def test_the_counters_are_little_endian_u64_at_offsets_0_8_16(packed: bool) -> None:
    """The layout another process reads, whichever way this host writes the counters
    (a u64 view on little-endian hosts, struct calls elsewhere)."""
    from runtime_core.ring import _PackedCounters

    buf = bytearray(64 + 2 * SLOT_BYTES)
    ring = Ring(RingSpec(slot_count=2, alignment=64, slot_bytes=SLOT_BYTES), buf)
    if packed:
        ring._ctr = _PackedCounters(memoryview(buf))
    for _ in range(300):  # past one byte
        ring.publish(ring.try_reserve())  # type: ignore[arg-type]
        ring.release(ring.try_acquire())  # type: ignore[arg-type]
    ring.close()
    assert [int.from_bytes(buf[i : i + 8], "little") for i in (0, 8, 16)] == [300, 300, 1]
    assert (ring.published, ring.released, ring.closed) == (300, 300, True)
