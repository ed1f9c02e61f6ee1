"""A single-producer, single-consumer ring of fixed-size slots (EDGES_AND_WORKERS.md
§2): reserve / publish on the producer side, acquire / release on the consumer side,
backpressure, bounded waits and close.

The ring lives in one buffer laid out so that it can be shared between processes:

    offset  0  u64 published   records published so far (written by the producer only)
    offset  8  u64 released    records released so far (written by the consumer only)
    offset 16  u64 closed      non-zero once either end closed the edge
    offset 64  slot 0, slot 1, ... each ``RingSpec.slot_bytes`` (header + payload)

Record ``n`` lives in slot ``n % slot_count``. A slot is free when every record that
used it has been released, so the producer never overwrites; records leave in publish
order; a slot is reused only after the consumer released it (which it does once the
step that read it is over). Each side keeps its own position (reserved / acquired) in
the ring object, since it has one owner.

Waits are bounded: ``wait_reserve`` / ``wait_acquire`` raise ``EdgeTimeout`` when the
bound runs out and ``EdgeClosed`` when the edge is closed. The non-blocking
``try_reserve`` / ``try_acquire`` serve single-threaded drivers such as the simulator,
which waits in virtual time.
"""

from __future__ import annotations

import struct
import threading
import time
from collections.abc import Callable
from typing import Protocol

from runplan import RingSpec

CONTROL_BYTES = 64
_U64 = struct.Struct("<Q")
_PUBLISHED, _RELEASED, _CLOSED = 0, 8, 16


class RingError(RuntimeError):
    """A use of the ring that breaks its rules (a bug in the caller)."""


class EdgeClosed(RuntimeError):
    """The edge was closed; nothing more passes through it."""


class EdgeTimeout(TimeoutError):
    """A bounded wait on the edge ran out."""


class Signal(Protocol):
    """A wake-up with one waiter: ``notify`` after a change; ``wait`` returns at once if
    a notification came since the last ``wait`` returned, else when one comes or the
    timeout runs out (spurious returns allowed: waiters re-check)."""

    def notify(self) -> None: ...

    def wait(self, timeout_s: float) -> None: ...


class ThreadSignal:
    """A ``Signal`` between threads of one process (an auto-reset event)."""

    def __init__(self) -> None:
        self._event = threading.Event()

    def notify(self) -> None:
        self._event.set()

    def wait(self, timeout_s: float) -> None:
        self._event.wait(timeout_s)
        self._event.clear()


def ring_bytes(spec: RingSpec) -> int:
    """Bytes of the buffer a ring of ``spec`` needs."""
    return CONTROL_BYTES + spec.slot_count * spec.slot_bytes


class Ring:
    """One edge's ring over ``buffer`` (``ring_bytes(spec)`` bytes, zeroed when new).

    ``data`` wakes the consumer (a record was published, or the edge closed) and
    ``space`` the producer (a slot was released, or the edge closed).
    """

    def __init__(
        self,
        spec: RingSpec,
        buffer: memoryview | bytearray | None = None,
        data: Signal | None = None,
        space: Signal | None = None,
    ) -> None:
        if spec.slot_count < 1 or spec.slot_bytes < 1:
            raise RingError(f"a ring needs slots: {spec}")
        self.spec = spec
        size = ring_bytes(spec)
        self._buf = memoryview(buffer if buffer is not None else bytearray(size))
        if len(self._buf) < size:
            raise RingError(f"buffer of {len(self._buf)} bytes, the ring needs {size}")
        self._data: Signal = data if data is not None else ThreadSignal()
        self._space: Signal = space if space is not None else ThreadSignal()
        self._reserved: int | None = None  # producer: record number reserved, unpublished
        self._acquired = 0  # consumer: records handed out so far

    # -- shared counters ------------------------------------------------------------
    def _get(self, offset: int) -> int:
        return int(_U64.unpack_from(self._buf, offset)[0])

    def _set_counter(self, offset: int, value: int) -> None:
        _U64.pack_into(self._buf, offset, value)

    @property
    def published(self) -> int:
        return self._get(_PUBLISHED)

    @property
    def released(self) -> int:
        return self._get(_RELEASED)

    @property
    def closed(self) -> bool:
        return self._get(_CLOSED) != 0

    def close(self) -> None:
        """Close the edge from either end; waiters wake with ``EdgeClosed``."""
        self._set_counter(_CLOSED, 1)
        self._data.notify()
        self._space.notify()

    def slot(self, index: int) -> memoryview:
        """The bytes of slot ``index`` (header + payload)."""
        start = CONTROL_BYTES + index * self.spec.slot_bytes
        return self._buf[start : start + self.spec.slot_bytes]

    # -- producer ---------------------------------------------------------------------
    def try_reserve(self) -> int | None:
        """The slot for the next record, or ``None`` while every slot is in use."""
        if self.closed:
            raise EdgeClosed("the edge is closed")
        if self._reserved is not None:
            raise RingError("a slot is already reserved and not yet published")
        n = self.published
        if n - self.released >= self.spec.slot_count:
            return None
        self._reserved = n
        return n % self.spec.slot_count

    def publish(self, index: int) -> None:
        """Make the reserved slot ``index`` visible to the consumer."""
        if self._reserved is None or index != self._reserved % self.spec.slot_count:
            raise RingError(f"slot {index} was not reserved")
        if self.closed:
            self._reserved = None
            raise EdgeClosed("the edge is closed")
        self._set_counter(_PUBLISHED, self._reserved + 1)
        self._reserved = None
        self._data.notify()

    def wait_reserve(self, timeout_s: float) -> int:
        """Reserve, waiting for a free slot (the backpressure) up to ``timeout_s``."""
        return self._wait(self.try_reserve, self._space, timeout_s, "a free slot")

    # -- consumer ---------------------------------------------------------------------
    def try_acquire(self) -> int | None:
        """The slot of the next published record, in publish order, or ``None``."""
        if self.closed:
            raise EdgeClosed("the edge is closed")
        if self._acquired >= self.published:
            return None
        index = self._acquired % self.spec.slot_count
        self._acquired += 1
        return index

    def release(self, index: int) -> None:
        """Free the oldest acquired, unreleased slot (``index`` must be it)."""
        n = self.released
        if n >= self._acquired or index != n % self.spec.slot_count:
            raise RingError(f"slot {index} is not the oldest acquired slot")
        self._set_counter(_RELEASED, n + 1)
        self._space.notify()

    def wait_acquire(self, timeout_s: float) -> int:
        """Acquire, waiting for a published record up to ``timeout_s``."""
        return self._wait(self.try_acquire, self._data, timeout_s, "a record")

    @property
    def acquired(self) -> int:
        """Records handed to the consumer so far (the next one's number)."""
        return self._acquired

    @property
    def reserved(self) -> int | None:
        """The number of the record reserved and not yet published, if any."""
        return self._reserved

    @property
    def holding(self) -> int:
        """Records acquired and not yet released."""
        return self._acquired - self.released

    @staticmethod
    def _wait(
        attempt: Callable[[], int | None], signal: Signal, timeout_s: float, what: str
    ) -> int:
        deadline = time.monotonic() + timeout_s
        while True:
            got = attempt()
            if got is not None:
                return got
            left = deadline - time.monotonic()
            if left <= 0:
                raise EdgeTimeout(f"no {what} within {timeout_s:.3f} s")
            signal.wait(left)


class LocalRing(Ring):
    """A ring whose two ends live in one process: the counters are plain attributes
    (the slots stay in the buffer), which makes every operation cheaper. The four
    operations below are ``Ring``'s, reading the counters directly."""

    def __init__(
        self,
        spec: RingSpec,
        buffer: memoryview | bytearray | None = None,
        data: Signal | None = None,
        space: Signal | None = None,
    ) -> None:
        self._counters = {_PUBLISHED: 0, _RELEASED: 0, _CLOSED: 0}
        super().__init__(spec, buffer, data, space)
        self._slot_count = spec.slot_count

    def _get(self, offset: int) -> int:
        return self._counters[offset]

    def _set_counter(self, offset: int, value: int) -> None:
        self._counters[offset] = value

    @property
    def published(self) -> int:
        return self._counters[_PUBLISHED]

    @property
    def released(self) -> int:
        return self._counters[_RELEASED]

    @property
    def closed(self) -> bool:
        return self._counters[_CLOSED] != 0

    def try_reserve(self) -> int | None:
        counters = self._counters
        if counters[_CLOSED]:
            raise EdgeClosed("the edge is closed")
        if self._reserved is not None:
            raise RingError("a slot is already reserved and not yet published")
        n = counters[_PUBLISHED]
        if n - counters[_RELEASED] >= self._slot_count:
            return None
        self._reserved = n
        return n % self._slot_count

    def publish(self, index: int) -> None:
        reserved = self._reserved
        if reserved is None or index != reserved % self._slot_count:
            raise RingError(f"slot {index} was not reserved")
        counters = self._counters
        if counters[_CLOSED]:
            self._reserved = None
            raise EdgeClosed("the edge is closed")
        counters[_PUBLISHED] = reserved + 1
        self._reserved = None
        self._data.notify()

    def try_acquire(self) -> int | None:
        counters = self._counters
        if counters[_CLOSED]:
            raise EdgeClosed("the edge is closed")
        acquired = self._acquired
        if acquired >= counters[_PUBLISHED]:
            return None
        self._acquired = acquired + 1
        return acquired % self._slot_count

    def release(self, index: int) -> None:
        counters = self._counters
        n = counters[_RELEASED]
        if n >= self._acquired or index != n % self._slot_count:
            raise RingError(f"slot {index} is not the oldest acquired slot")
        counters[_RELEASED] = n + 1
        self._space.notify()
