"""Edge ends over a ring: a record is the 128-byte object header followed by its
payload (EDGES_AND_WORKERS.md §1). ``SendEnd`` writes records, ``ReceiveEnd`` reads and
validates them; either may close the edge."""

from __future__ import annotations

from attrs import frozen

from runplan.header import HeaderCheck, HeaderDType, HeaderError, ObjectHeader
from runplan.plan import OBJECT_HEADER_BYTES, ObjectSpec
from runtime_core.ring import Ring, RingError


class EdgeFaultError(RuntimeError):
    """A record the receiving end refuses (bad header, wrong shape): an edge fault."""


@frozen
class Record:
    slot: int
    header: ObjectHeader
    payload: memoryview  # valid until the record is released


class SendEnd:
    """The producer end of one edge of one run."""

    def __init__(self, ring: Ring, run_id: str, edge_id: int, object_spec: ObjectSpec) -> None:
        self.ring = ring
        self.run_id = run_id
        self.edge_id = edge_id
        self.object_spec = object_spec

    def _write(
        self,
        slot: int,
        sequence: int,
        rows: int,
        dtype: HeaderDType,
        payload: bytes | bytearray | memoryview,
    ) -> None:
        # Bytes (what the controllers write) are already a flat run of bytes.
        data = payload if type(payload) is bytes else memoryview(payload).cast("B")
        if not 0 < len(data) <= self.object_spec.max_extent:
            raise RingError(
                f"payload of {len(data)} bytes; edge {self.edge_id} takes 1.."
                f"{self.object_spec.max_extent}"
            )
        header = ObjectHeader(
            self.run_id, self.edge_id, sequence, self.object_spec.kind, dtype, rows, len(data)
        )
        view = self.ring.slot(slot)
        view[:OBJECT_HEADER_BYTES] = header.pack()
        view[OBJECT_HEADER_BYTES : OBJECT_HEADER_BYTES + len(data)] = data

    def try_send(
        self, sequence: int, rows: int, dtype: HeaderDType, payload: bytes | bytearray | memoryview
    ) -> bool:
        """Write and publish one record; ``False`` (nothing written) while the ring is
        full. Raises ``EdgeClosed`` once the edge is closed."""
        slot = self.ring.try_reserve()
        if slot is None:
            return False
        self._write(slot, sequence, rows, dtype, payload)
        self.ring.publish(slot)
        return True

    def send(
        self,
        sequence: int,
        rows: int,
        dtype: HeaderDType,
        payload: bytes | bytearray | memoryview,
        timeout_s: float,
    ) -> None:
        """Write and publish one record, waiting up to ``timeout_s`` for a free slot."""
        slot = self.ring.wait_reserve(timeout_s)
        self._write(slot, sequence, rows, dtype, payload)
        self.ring.publish(slot)

    def close(self) -> None:
        self.ring.close()


class ReceiveEnd:
    """The consumer end of one edge of one run. ``check`` says what records must look
    like; the run id, edge id and sequence are left to the caller (the stage machine
    rejects records of other runs or edges without faulting, and faults on sequence)."""

    def __init__(self, ring: Ring, check: HeaderCheck) -> None:
        self.ring = ring
        self.check = check

    def _read(self, slot: int) -> Record:
        view = self.ring.slot(slot)
        try:
            header = ObjectHeader.unpack(view)
        except HeaderError as exc:
            raise EdgeFaultError(f"edge {self.check.edge_id}: bad header: {exc}") from None
        problem = self.check.validate_shape(header)
        if problem is not None:
            raise EdgeFaultError(f"edge {self.check.edge_id}: {problem[0].value}: {problem[1]}")
        payload = view[OBJECT_HEADER_BYTES : OBJECT_HEADER_BYTES + header.extent_bytes]
        return Record(slot, header, payload)

    def try_receive(self) -> Record | None:
        """The next record, or ``None`` if none is published. A refused record raises
        ``EdgeFaultError`` and stays unreleased: nothing of it is consumed."""
        slot = self.ring.try_acquire()
        return None if slot is None else self._read(slot)

    def receive(self, timeout_s: float) -> Record:
        return self._read(self.ring.wait_acquire(timeout_s))

    def release(self, record: Record) -> None:
        """Free the record's slot (after the step that read it, or to discard it)."""
        self.ring.release(record.slot)

    def close(self) -> None:
        self.ring.close()
