"""The object header: fixed binary layout, round trip, malformed bytes, validation
against the receiving end's edge (EDGES_AND_WORKERS.md §1)."""

from __future__ import annotations

import contextlib
import struct

import attrs
import pytest
from hypothesis import given
from hypothesis import strategies as st

from runplan import ObjectKind, provision_all
from runplan.plan import OBJECT_HEADER_BYTES
from runplan.record_header import (
    HeaderCheck,
    HeaderDType,
    HeaderError,
    HeaderRejection,
    ObjectHeader,
)
from tests.support.strategies import small_plan

run_ids = st.text(
    alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"),
    min_size=1,
    max_size=16,
)
headers = st.builds(
    ObjectHeader,
    run_id=run_ids,
    edge_id=st.integers(0, 2**64 - 1),
    sequence=st.integers(0, 2**64 - 1),
    kind=st.sampled_from(ObjectKind),
    dtype=st.sampled_from(HeaderDType),
    rows=st.integers(0, 2**32 - 1),
    extent_bytes=st.integers(0, 2**64 - 1),
    chunk_index=st.integers(0, 2**32 - 2),
    chunk_count=st.integers(1, 2**32 - 1),
).filter(lambda h: h.chunk_index < h.chunk_count)


@given(headers)
def test_pack_unpack_round_trip(header: ObjectHeader) -> None:
    data = header.pack()
    assert len(data) == OBJECT_HEADER_BYTES == 128
    assert ObjectHeader.unpack(data) == header
    assert ObjectHeader.unpack(data + b"payload") == header


def test_layout_is_fixed() -> None:
    header = ObjectHeader("run-1", 7, 3, ObjectKind.ACTIVATION, HeaderDType.F16, 1, 1152)
    data = header.pack()
    assert data[:4] == b"GPOB"
    assert struct.unpack_from("<HBBI", data, 4) == (2, 1, 1, 1)  # writers write version 2
    assert struct.unpack_from("<QQQ", data, 16) == (7, 3, 1152)
    assert data[40:45] == b"run-1" and data[45:104] == bytes(59)
    assert struct.unpack_from("<II", data, 104) == (0, 1)  # chunk 0 of 1
    assert data[112:] == bytes(16)
    chunked = attrs.evolve(header, sequence=0, chunk_index=2, chunk_count=5).pack()
    assert struct.unpack_from("<II", chunked, 104) == (2, 5)


def _version_1(header: ObjectHeader) -> bytes:
    """``header`` as a version 1 writer wrote it: version 1, bytes 104.. all zero."""
    data = header.pack()
    return data[:4] + struct.pack("<H", 1) + data[6:104] + bytes(24)


def test_version_1_records_read_as_chunk_0_of_1() -> None:
    header = ObjectHeader("run-1", 7, 0, ObjectKind.TOKEN, HeaderDType.U32, 3, 12)
    assert ObjectHeader.unpack(_version_1(header)) == header
    assert header.chunk_index == 0 and header.chunk_count == 1
    # Version 1 has no chunk fields: its bytes 104.. are reserved.
    for offset in (104, 108, 120):
        with pytest.raises(HeaderError, match="reserved"):
            ObjectHeader.unpack(_mutate(_version_1(header), offset, b"\x01"))


@pytest.mark.parametrize(("index", "count"), [(0, 0), (1, 1), (5, 3), (2**32 - 1, 2**32 - 1)])
def test_a_chunk_outside_its_count_is_refused(index: int, count: int) -> None:
    header = ObjectHeader("run-1", 7, 0, ObjectKind.TOKEN, HeaderDType.U32, 3, 12)
    with pytest.raises(HeaderError, match="chunk"):
        attrs.evolve(header, chunk_index=index, chunk_count=count).pack()
    data = _mutate(header.pack(), 104, struct.pack("<II", index, count))
    with pytest.raises(HeaderError, match="chunk"):
        ObjectHeader.unpack(data)


def _mutate(data: bytes, offset: int, new: bytes) -> bytes:
    return data[:offset] + new + data[offset + len(new) :]


GOOD = ObjectHeader("run-1", 2, 0, ObjectKind.TOKEN, HeaderDType.U32, 3, 12).pack()


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (GOOD[:127], "128"),
        (_mutate(GOOD, 0, b"GPOC"), "magic"),
        (_mutate(GOOD, 4, struct.pack("<H", 3)), "version"),
        (_mutate(GOOD, 4, struct.pack("<H", 0)), "version"),
        (_mutate(GOOD, 6, b"\x07"), "kind"),
        (_mutate(GOOD, 7, b"\x09"), "dtype"),
        (_mutate(GOOD, 12, b"\x01"), "reserved"),
        (_mutate(GOOD, 112, b"\x01"), "reserved"),
        (_mutate(GOOD, 127, b"\x01"), "reserved"),
        (_mutate(GOOD, 108, bytes(4)), "chunk count"),
        (_mutate(GOOD, 40, bytes(64)), "run id"),
        (_mutate(GOOD, 40, b"a\x00b"), "NUL"),
        (_mutate(GOOD, 40, b"\xff\xfe"), "UTF-8"),
    ],
)
def test_every_malformed_field_is_rejected(data: bytes, message: str) -> None:
    with pytest.raises(HeaderError, match=message):
        ObjectHeader.unpack(data)


@given(st.binary(min_size=128, max_size=140))
def test_unpack_on_random_bytes_raises_only_header_error(data: bytes) -> None:
    with contextlib.suppress(HeaderError):
        ObjectHeader.unpack(data)


@pytest.mark.parametrize("run_id", ["", "x" * 65, "a\x00b", "\ud800"])
def test_pack_refuses_what_the_layout_cannot_hold(run_id: str) -> None:
    with pytest.raises(HeaderError):
        ObjectHeader(run_id, 1, 0, ObjectKind.TOKEN, HeaderDType.U32, 1, 4).pack()
    with pytest.raises(HeaderError):
        ObjectHeader("r", 2**64, 0, ObjectKind.TOKEN, HeaderDType.U32, 1, 4).pack()


def _checks(return_logits: bool = False) -> tuple[HeaderCheck, HeaderCheck, HeaderCheck]:
    plan = small_plan(2, return_logits=return_logits)
    first, second = provision_all(plan)
    hidden = plan.model.hidden_dim * plan.model.dtype_width_bytes
    return (
        HeaderCheck(plan.run_id, first.inbound.edge_id, first.inbound.object_spec, 4),
        HeaderCheck(plan.run_id, second.inbound.edge_id, second.inbound.object_spec, hidden),
        HeaderCheck(plan.run_id, second.outbound.edge_id, second.outbound.object_spec, 4),
    )


def test_validation_accepts_the_records_a_run_sends() -> None:
    token_in, activation, token_out = _checks()
    assert (
        token_in.validate(
            ObjectHeader("run-1", token_in.edge_id, 0, ObjectKind.TOKEN, HeaderDType.U32, 5, 20), 0
        )
        is None
    )
    assert (
        activation.validate(
            ObjectHeader(
                "run-1",
                activation.edge_id,
                3,
                ObjectKind.ACTIVATION,
                HeaderDType.F32,
                1,
                activation.row_bytes,
            ),
            3,
        )
        is None
    )
    assert (
        token_out.validate(
            ObjectHeader("run-1", token_out.edge_id, 0, ObjectKind.TOKEN, HeaderDType.U32, 1, 4), 0
        )
        is None
    )
    (_, _, with_logits) = _checks(return_logits=True)
    extent = with_logits.object_spec.max_extent
    assert (
        with_logits.validate(
            ObjectHeader(
                "run-1", with_logits.edge_id, 2, ObjectKind.TOKEN, HeaderDType.U32, 1, extent
            ),
            2,
        )
        is None
    )


def test_validation_rejects_each_mismatch() -> None:
    token_in, activation, _ = _checks()
    good = ObjectHeader(
        "run-1",
        activation.edge_id,
        1,
        ObjectKind.ACTIVATION,
        HeaderDType.F32,
        1,
        activation.row_bytes,
    )
    assert activation.validate(good, 1) is None
    cases = {
        HeaderRejection.RUN_ID_MISMATCH: attrs.evolve(good, run_id="run-2"),
        HeaderRejection.EDGE_ID_MISMATCH: attrs.evolve(good, edge_id=good.edge_id + 1),
        HeaderRejection.KIND_MISMATCH: attrs.evolve(good, kind=ObjectKind.TOKEN),
        HeaderRejection.DTYPE_MISMATCH: attrs.evolve(good, dtype=HeaderDType.F16),
        HeaderRejection.SEQUENCE_OUT_OF_ORDER: attrs.evolve(good, sequence=2),
        HeaderRejection.EXTENT_ZERO: attrs.evolve(good, extent_bytes=0),
        HeaderRejection.EXTENT_TOO_LARGE: attrs.evolve(
            good, extent_bytes=activation.object_spec.max_extent + 1
        ),
        HeaderRejection.ROWS_MISMATCH: attrs.evolve(
            good, rows=2, extent_bytes=2 * good.extent_bytes
        ),
        HeaderRejection.CHUNK_MISMATCH: attrs.evolve(good, chunk_index=0, chunk_count=2),
    }
    for reason, header in cases.items():
        result = activation.validate(header, 1)
        assert result is not None and result[0] is reason, (reason, result)
    # A prompt of 3 tokens must carry 12 bytes.
    prompt = ObjectHeader("run-1", token_in.edge_id, 0, ObjectKind.TOKEN, HeaderDType.U32, 3, 8)
    result = token_in.validate(prompt, 0)
    assert result is not None and result[0] is HeaderRejection.ROWS_MISMATCH
    # A chunk of a prompt is fine: chunk 1 of 3, 2 of its tokens.
    chunk = ObjectHeader(
        "run-1", token_in.edge_id, 0, ObjectKind.TOKEN, HeaderDType.U32, 2, 8, 1, 3
    )
    assert token_in.validate(chunk, 0) is None
