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
import sys
import threading
import time
from collections.abc import Callable
from typing import Protocol

from runplan import RingSpec

CONTROL_BYTES = 64
_U64 = struct.Struct("<Q")
_PUBLISHED, _RELEASED, _CLOSED = 0, 1, 2  # the u64 counters at offsets 0, 8 and 16


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


class _Counters(Protocol):
    """The three u64 counters of a ring, by index (``_PUBLISHED``, ...)."""

    def __getitem__(self, index: int, /) -> int: ...

    def __setitem__(self, index: int, value: int, /) -> None: ...


class _PackedCounters:
    """The counters read and written one little-endian u64 at a time through
    ``struct`` (for hosts that are not little-endian)."""

    def __init__(self, buf: memoryview) -> None:
        self._buf = buf

    def __getitem__(self, index: int) -> int:
        return int(_U64.unpack_from(self._buf, 8 * index)[0])

    def __setitem__(self, index: int, value: int) -> None:
        _U64.pack_into(self._buf, 8 * index, value)


def _shared_counters(buf: memoryview) -> _Counters:
    """The counters at the start of ``buf``: on a little-endian host a view of them as
    native u64 items, whose reads and writes are single aligned 8-byte accesses (the
    buffer of a shared ring is page-aligned), and much cheaper than ``struct`` calls."""
    if sys.byteorder == "little" and buf.contiguous and not buf.readonly:
        return buf[: 3 * 8].cast("B").cast("Q")
    return _PackedCounters(buf)


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
        self._ctr: _Counters = _shared_counters(self._buf)
        self._slot_count = spec.slot_count
        self._reserved: int | None = None  # producer: record number reserved, unpublished
        self._acquired = 0  # consumer: records handed out so far

    # -- shared counters ------------------------------------------------------------
    @property
    def published(self) -> int:
        return self._ctr[_PUBLISHED]

    @property
    def released(self) -> int:
        return self._ctr[_RELEASED]

    @property
    def closed(self) -> bool:
        return self._ctr[_CLOSED] != 0

    def close(self) -> None:
        """Close the edge from either end; waiters wake with ``EdgeClosed``."""
        self._ctr[_CLOSED] = 1
        self._data.notify()
        self._space.notify()

    def _release_buffer(self) -> None:
        """Let go of this object's views of the buffer (before the buffer is unmapped);
        the ring is unusable afterwards."""
        if isinstance(self._ctr, memoryview):
            self._ctr.release()
        self._buf.release()

    def slot(self, index: int) -> memoryview:
        """The bytes of slot ``index`` (header + payload)."""
        start = CONTROL_BYTES + index * self.spec.slot_bytes
        return self._buf[start : start + self.spec.slot_bytes]

    # -- producer ---------------------------------------------------------------------
    def try_reserve(self) -> int | None:
        """The slot for the next record, or ``None`` while every slot is in use."""
        ctr = self._ctr
        if ctr[_CLOSED]:
            raise EdgeClosed("the edge is closed")
        if self._reserved is not None:
            raise RingError("a slot is already reserved and not yet published")
        n = ctr[_PUBLISHED]
        if n - ctr[_RELEASED] >= self._slot_count:
            return None
        self._reserved = n
        return n % self._slot_count

    def publish(self, index: int) -> None:
        """Make the reserved slot ``index`` visible to the consumer."""
        reserved = self._reserved
        if reserved is None or index != reserved % self._slot_count:
            raise RingError(f"slot {index} was not reserved")
        ctr = self._ctr
        if ctr[_CLOSED]:
            self._reserved = None
            raise EdgeClosed("the edge is closed")
        ctr[_PUBLISHED] = reserved + 1
        self._reserved = None
        self._data.notify()

    def wait_reserve(self, timeout_s: float) -> int:
        """Reserve, waiting for a free slot (the backpressure) up to ``timeout_s``."""
        return self._wait(self.try_reserve, self._space, timeout_s, "a free slot")

    # -- consumer ---------------------------------------------------------------------
    def try_acquire(self) -> int | None:
        """The slot of the next published record, in publish order, or ``None``."""
        ctr = self._ctr
        if ctr[_CLOSED]:
            raise EdgeClosed("the edge is closed")
        acquired = self._acquired
        if acquired >= ctr[_PUBLISHED]:
            return None
        self._acquired = acquired + 1
        return acquired % self._slot_count

    def release(self, index: int) -> None:
        """Free the oldest acquired, unreleased slot (``index`` must be it)."""
        ctr = self._ctr
        n = ctr[_RELEASED]
        if n >= self._acquired or index != n % self._slot_count:
            raise RingError(
                f"slot {index} is not the oldest acquired slot (the released counter "
                f"reads {n}, {self._acquired} records acquired)"
            )
        ctr[_RELEASED] = n + 1
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
    """A ring whose two ends live in one process: the counters are a plain list (the
    slots stay in the buffer)."""

    def __init__(
        self,
        spec: RingSpec,
        buffer: memoryview | bytearray | None = None,
        data: Signal | None = None,
        space: Signal | None = None,
    ) -> None:
        super().__init__(spec, buffer, data, space)
        self._ctr = [0, 0, 0]
