"""Edge ends write records from a header template and read them by comparing the bytes
every record of the edge shares: both must agree byte for byte, and verdict for
verdict, with ObjectHeader.pack / unpack and HeaderCheck.validate_shape."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from runplan.plan import OBJECT_HEADER_BYTES
from runplan.record_header import HeaderCheck, HeaderDType, HeaderError, ObjectHeader
from runtime_core.edge_ends import EdgeFaultError, ReceiveEnd, Record, SendEnd
from runtime_core.ring import Ring, RingError
from tests.support.strategies import small_plan

PLAN = small_plan(2, max_tokens=4)
EDGE = PLAN.edges[1]  # stage 0 -> stage 1: activations
CHECK = HeaderCheck.for_edge(PLAN.run_id, EDGE.edge_id, EDGE.object_spec, PLAN.model.hidden_dim)
ROW = np.arange(PLAN.model.hidden_dim, dtype=np.float32).tobytes()


def _ends() -> tuple[Ring, SendEnd, ReceiveEnd]:
    ring = Ring(EDGE.ring_spec)
    return (
        ring,
        SendEnd(ring, PLAN.run_id, EDGE.edge_id, EDGE.object_spec),
        ReceiveEnd(ring, CHECK),
    )


def _reference(view: memoryview) -> Record | str:
    """What the receive end must make of a slot: a record, or the error it raises."""
    try:
        header = ObjectHeader.unpack(view)
    except HeaderError as exc:
        return f"edge {EDGE.edge_id}: bad header: {exc}"
    problem = CHECK.validate_shape(header)
    if problem is not None:
        return f"edge {EDGE.edge_id}: {problem[0].value}: {problem[1]}"
    return Record(0, header, view[OBJECT_HEADER_BYTES : OBJECT_HEADER_BYTES + header.extent_bytes])


@given(sequence=st.integers(1, 2**64 - 1))
def test_a_written_header_is_the_packed_header(sequence: int) -> None:
    ring, send, _ = _ends()
    assert send.try_send(sequence, 1, HeaderDType.F32, ROW)
    header = ObjectHeader(
        PLAN.run_id, EDGE.edge_id, sequence, EDGE.object_spec.kind, HeaderDType.F32, 1, len(ROW)
    )
    assert bytes(ring.slot(0)[:OBJECT_HEADER_BYTES]) == header.pack()


@pytest.mark.parametrize(
    ("sequence", "rows", "dtype"),
    [(2**64, 1, HeaderDType.F32), (1, -1, HeaderDType.F32), (1, 1, "F32")],
)
def test_a_header_field_out_of_range_is_refused_and_nothing_published(
    sequence: int, rows: int, dtype: HeaderDType
) -> None:
    ring, send, receive = _ends()
    with pytest.raises(HeaderError):
        send.try_send(sequence, rows, dtype, ROW)
    with pytest.raises(HeaderError):
        send.send(sequence, rows, dtype, ROW, timeout_s=0.0)
    assert ring.published == 0
    # The refused records took no slot: the next good one is written and read.
    assert send.try_send(0, 1, HeaderDType.F32, ROW)
    send.send(1, 1, HeaderDType.F32, ROW, timeout_s=0.0)
    assert [receive.receive(0.0).header.sequence for _ in range(2)] == [0, 1]


@pytest.mark.parametrize("payload", [b"", ROW + b"x" * 10**6])
def test_a_payload_of_the_wrong_size_takes_no_slot(payload: bytes) -> None:
    ring, send, _ = _ends()
    with pytest.raises(RingError, match="payload of"):
        send.try_send(0, 1, HeaderDType.F32, payload)
    assert send.try_send(0, 1, HeaderDType.F32, ROW)
    assert ring.published == 1


@settings(max_examples=300)
@given(
    sequence=st.integers(0, 3),
    rows=st.integers(1, 2),
    offset=st.integers(0, OBJECT_HEADER_BYTES - 1),
    value=st.integers(0, 255),
)
def test_any_changed_header_byte_is_judged_as_by_a_full_parse(
    sequence: int, rows: int, offset: int, value: int
) -> None:
    ring, send, receive = _ends()
    assert send.try_send(sequence, rows, HeaderDType.F32, ROW * rows)
    ring.slot(0)[offset] = value
    expected = _reference(ring.slot(0))
    try:
        got: Record | str = receive.receive(0.0)
    except EdgeFaultError as exc:
        got = str(exc)
    if isinstance(expected, str):
        assert got == expected
    else:
        assert isinstance(got, Record) and got.header == expected.header
        assert bytes(got.payload) == bytes(expected.payload)
