"""Edge ends over a ring: a record is the 128-byte object header followed by its
payload (EDGES_AND_WORKERS.md §1). ``SendEnd`` writes records, ``ReceiveEnd`` reads and
validates them; either may close the edge."""

from __future__ import annotations

import struct

from attrs import frozen

from runplan.plan import OBJECT_HEADER_BYTES, ObjectKind, ObjectSpec
from runplan.record_header import (
    EXTENT_OFFSET,
    SEQUENCE_OFFSET,
    HeaderCheck,
    HeaderDType,
    HeaderError,
    ObjectHeader,
)
from runtime_core.ring import Ring, RingError

# The header split into what one edge's records share (magic, version, kind, dtype;
# reserved bytes and edge id; run id and reserved bytes) and what each record sets
# (rows; sequence and extent): records are written from a template of the shared
# bytes, and a record whose shared bytes are the template's is read without parsing
# them again (any other record gets the full parse and its precise error).
_ROWS_OFFSET = 8
_SPLIT = struct.Struct("<8sI12sQQ88s")
_ROWS = struct.Struct("<I")
_SEQUENCE_EXTENT = struct.Struct("<QQ")


def _check_split() -> None:
    probe = ObjectHeader("r", 2, 3, ObjectKind.TOKEN, HeaderDType.U32, 4, 5).pack()
    fields = _SPLIT.unpack(probe)
    if (
        _SPLIT.size != OBJECT_HEADER_BYTES
        or SEQUENCE_OFFSET != 24
        or EXTENT_OFFSET != 32
        or fields[1] != 4
        or fields[3:5] != (3, 5)
        or _ROWS.unpack_from(probe, _ROWS_OFFSET)[0] != 4
    ):
        raise AssertionError("runtime_core.edge_ends does not match the object header layout")


_check_split()


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
        self._templates: dict[int, bytearray] = {}  # a header per dtype's value

    def _template(self, dtype: HeaderDType) -> bytearray:
        """A header of this edge's records of ``dtype``, its rows, sequence and extent
        to be filled in (``HeaderError`` for what no header can hold)."""
        # Keyed by the member's value: an Enum key costs a Python-level __hash__.
        known = type(dtype) is HeaderDType
        template = self._templates.get(dtype._value_) if known else None
        if template is None:
            header = ObjectHeader(self.run_id, self.edge_id, 0, self.object_spec.kind, dtype, 0, 0)
            template = bytearray(header.pack())  # HeaderError for what cannot be packed
            if known:
                self._templates[dtype._value_] = template
        return template

    def _prepare(
        self, sequence: int, rows: int, dtype: HeaderDType, payload: bytes | bytearray | memoryview
    ) -> tuple[bytearray, bytes | memoryview]:
        """The header and payload bytes of one record, checked before a slot is reserved:
        a record that cannot be written (``RingError``, ``HeaderError``) takes no slot."""
        # Bytes (what the controllers write) are already a flat run of bytes.
        data = payload if type(payload) is bytes else memoryview(payload).cast("B")
        if not 0 < len(data) <= self.object_spec.max_extent:
            raise RingError(
                f"payload of {len(data)} bytes; edge {self.edge_id} takes 1.."
                f"{self.object_spec.max_extent}"
            )
        header = self._template(dtype)
        try:
            _ROWS.pack_into(header, _ROWS_OFFSET, rows)
            _SEQUENCE_EXTENT.pack_into(header, SEQUENCE_OFFSET, sequence, len(data))
        except struct.error as exc:
            raise HeaderError(f"a header field is out of range: {exc}") from None
        return header, data

    def _write(self, slot: int, header: bytearray, data: bytes | memoryview) -> None:
        view = self.ring.slot(slot)
        view[:OBJECT_HEADER_BYTES] = header
        view[OBJECT_HEADER_BYTES : OBJECT_HEADER_BYTES + len(data)] = data
        self.ring.publish(slot)

    def try_send(
        self, sequence: int, rows: int, dtype: HeaderDType, payload: bytes | bytearray | memoryview
    ) -> bool:
        """Write and publish one record; ``False`` (nothing written) while the ring is
        full. Raises ``EdgeClosed`` once the edge is closed."""
        header, data = self._prepare(sequence, rows, dtype, payload)
        slot = self.ring.try_reserve()
        if slot is None:
            return False
        self._write(slot, header, data)
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
        header, data = self._prepare(sequence, rows, dtype, payload)
        self._write(self.ring.wait_reserve(timeout_s), header, data)

    def close(self) -> None:
        self.ring.close()


class ReceiveEnd:
    """The consumer end of one edge of one run. ``check`` says what records must look
    like; the run id, edge id and sequence are left to the caller (the stage machine
    rejects records of other runs or edges without faulting, and faults on sequence)."""

    def __init__(self, ring: Ring, check: HeaderCheck) -> None:
        self.ring = ring
        self.check = check
        self._expected: tuple[bytes, bytes, bytes, ObjectKind, HeaderDType] | None = None
        spec = check.object_spec
        try:
            dtype = HeaderDType.of(spec.dtype_family, spec.dtype_width_bytes)
            template = ObjectHeader(check.run_id, check.edge_id, 0, spec.kind, dtype, 0, 0)
            fixed = _SPLIT.unpack(template.pack())
        except (ValueError, HeaderError):  # no record can pass the check: parse each
            pass
        else:
            if ring.spec.slot_bytes >= OBJECT_HEADER_BYTES:
                self._expected = (fixed[0], fixed[2], fixed[5], spec.kind, dtype)

    def _parse(self, view: memoryview) -> ObjectHeader:
        expected = self._expected
        if expected is not None:
            head, rows, middle, sequence, extent, tail = _SPLIT.unpack_from(view)
            if head == expected[0] and middle == expected[1] and tail == expected[2]:
                check = self.check
                kind, dtype = expected[3], expected[4]
                return ObjectHeader(
                    check.run_id, check.edge_id, sequence, kind, dtype, rows, extent
                )
        try:
            return ObjectHeader.unpack(view)
        except HeaderError as exc:
            raise EdgeFaultError(f"edge {self.check.edge_id}: bad header: {exc}") from None

    def _read(self, slot: int) -> Record:
        view = self.ring.slot(slot)
        header = self._parse(view)
        problem = self.check.validate_shape(header)
        if problem is not None:
            raise EdgeFaultError(f"edge {self.check.edge_id}: {problem[0].value}: {problem[1]}")
        payload = view[OBJECT_HEADER_BYTES : OBJECT_HEADER_BYTES + header.extent_bytes]
        return Record(slot, header, payload)

    def receive(self, timeout_s: float) -> Record:
        """The next record, waiting for it up to ``timeout_s``. A refused record raises
        ``EdgeFaultError`` and stays unreleased: nothing of it is consumed."""
        return self._read(self.ring.wait_acquire(timeout_s))

    def release(self, record: Record) -> None:
        """Free the record's slot (after the step that read it, or to discard it)."""
        self.ring.release(record.slot)

    def close(self) -> None:
        self.ring.close()
