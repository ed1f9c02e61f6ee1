"""The object header (EDGES_AND_WORKERS.md §1): a fixed 128-byte binary layout in front
of every record on an edge, and its validation against the receiving end's edge.

Layout (little-endian)::

    offset size field
         0    4 magic           b"GPOB"
         4    2 version         2 (1 is still read)
         6    1 kind            0 token, 1 activation
         7    1 dtype           0 u32, 1 f16, 2 bf16, 3 f32
         8    4 rows            u32
        12    4 reserved        zero
        16    8 edge_id         u64
        24    8 sequence        u64
        32    8 extent_bytes    u64
        40   64 run_id          UTF-8, zero padded
       104    4 chunk_index     u32 (version 2)
       108    4 chunk_count     u32 (version 2)
       112   16 reserved        zero

Version 2 (CONCURRENT_RUNS.md §4) carries a prefill (sequence 0) in ``chunk_count``
chunk records, ``chunk_index`` ``0..chunk_count-1``; every other record is chunk 0 of 1.
Writers write version 2. A version 1 record (bytes 104..127 reserved, zero) reads as
chunk 0 of 1.
"""

from __future__ import annotations

import enum
import struct

from attrs import frozen

from runplan._fields import int_field, str_field, typed_field
from runplan.dtypes import DTypeFamily
from runplan.plan import MAX_RUN_ID_BYTES, OBJECT_HEADER_BYTES, Layout, ObjectKind, ObjectSpec

MAGIC = b"GPOB"
VERSION = 2
#: The versions ``unpack`` reads: 1 (no chunks) and 2.
READ_VERSIONS = (1, 2)
#: Where a header keeps its sequence and, right after it, its extent (u64 each); its
#: chunk index and, right after it, its chunk count (u32 each).
SEQUENCE_OFFSET = 24
EXTENT_OFFSET = 32
CHUNK_OFFSET = 104
_STRUCT = struct.Struct("<4sHBBI4sQQQ64sII16s")
assert _STRUCT.size == OBJECT_HEADER_BYTES
_ZERO4 = bytes(4)
_ZERO16 = bytes(16)
_U32_MAX = 2**32 - 1


class HeaderDType(enum.Enum):
    U32 = 0
    F16 = 1
    BF16 = 2
    F32 = 3

    @property
    def family_width(self) -> tuple[DTypeFamily, int]:
        return _FAMILY_WIDTH_OF_CODE[self._value_]

    @classmethod
    def of(cls, family: DTypeFamily, width: int) -> HeaderDType:
        """The header dtype of ``(family, width)``; ``ValueError`` if there is none."""
        if isinstance(family, DTypeFamily) and type(width) is int:
            found = _DTYPE_OF_FAMILY_WIDTH.get((family._value_, width))
            if found is not None:
                return found
        for dtype, pair in _FAMILY_WIDTH.items():
            if pair == (family, width):
                return dtype
        raise ValueError(f"no header dtype for {family.value} of {width} bytes")


_FAMILY_WIDTH = {
    HeaderDType.U32: (DTypeFamily.UINT, 4),
    HeaderDType.F16: (DTypeFamily.FLOAT, 2),
    HeaderDType.BF16: (DTypeFamily.BFLOAT, 2),
    HeaderDType.F32: (DTypeFamily.FLOAT, 4),
}
_KIND_CODES = {ObjectKind.TOKEN: 0, ObjectKind.ACTIVATION: 1}
_KINDS = {v: k for k, v in _KIND_CODES.items()}
# The same tables keyed by the members' values (``_value_``), for the per-record paths:
# a dict keyed by an Enum member runs the member's Python-level ``__hash__``, and
# ``HeaderDType(code)`` goes through ``EnumType.__call__``.
_KIND_CODE_OF_VALUE = {kind._value_: code for kind, code in _KIND_CODES.items()}
_FAMILY_WIDTH_OF_CODE = {dtype._value_: pair for dtype, pair in _FAMILY_WIDTH.items()}
_DTYPE_OF_CODE = {dtype._value_: dtype for dtype in HeaderDType}
_DTYPE_OF_FAMILY_WIDTH = {(f._value_, w): dtype for dtype, (f, w) in _FAMILY_WIDTH.items()}
# Read for every record: on Python 3.11 ``Layout.TOKEN_ID_WITH_LOGITS`` goes through the
# slow attribute hook of ``EnumType.__getattr__``.
_WITH_LOGITS = Layout.TOKEN_ID_WITH_LOGITS


class HeaderError(ValueError):
    """Bytes that are not a well-formed object header."""


@frozen
class ObjectHeader:
    """One record's header. It is made for every record on every edge, so its fields
    are not checked on construction: ``pack`` refuses what the layout cannot hold and
    ``unpack`` makes only well-formed headers."""

    run_id: str
    edge_id: int
    sequence: int  # 0 = prefill, 1.. = decode steps
    kind: ObjectKind
    dtype: HeaderDType
    rows: int  # tokens in this object
    extent_bytes: int  # payload bytes
    chunk_index: int = 0  # of sequence 0 carried in chunk_count records; else 0 of 1
    chunk_count: int = 1

    def pack(self) -> bytes:
        """The 128 header bytes (version 2); ``HeaderError`` if a field does not fit its
        slot or the chunk is not one of its count."""
        if not isinstance(self.run_id, str) or not isinstance(self.kind, ObjectKind):
            raise HeaderError("a header needs a run id string and an object kind")
        if not isinstance(self.dtype, HeaderDType):
            raise HeaderError(f"dtype {self.dtype!r} is not a HeaderDType")
        try:
            run_id = self.run_id.encode("utf-8")
        except UnicodeEncodeError:
            raise HeaderError(f"run id {self.run_id!r} is not valid Unicode") from None
        if not run_id or len(run_id) > MAX_RUN_ID_BYTES or b"\x00" in run_id:
            raise HeaderError(f"run id {self.run_id!r} does not fit the header")
        problem = chunk_problem(self.chunk_index, self.chunk_count)
        if problem is not None:
            raise HeaderError(problem)
        try:
            return _STRUCT.pack(
                MAGIC,
                VERSION,
                _KIND_CODE_OF_VALUE[self.kind._value_],
                self.dtype._value_,
                self.rows,
                _ZERO4,
                self.edge_id,
                self.sequence,
                self.extent_bytes,
                run_id,
                self.chunk_index,
                self.chunk_count,
                _ZERO16,
            )
        except struct.error as exc:
            raise HeaderError(f"a header field is out of range: {exc}") from None

    @classmethod
    def unpack(cls, data: bytes | bytearray | memoryview) -> ObjectHeader:
        """Parse the first 128 bytes of ``data``; ``HeaderError`` on anything malformed."""
        if len(data) < OBJECT_HEADER_BYTES:
            raise HeaderError(f"{len(data)} bytes, a header has {OBJECT_HEADER_BYTES}")
        (
            magic,
            version,
            kind,
            dtype,
            rows,
            res4,
            edge_id,
            sequence,
            extent,
            run_id,
            chunk_index,
            chunk_count,
            res16,
        ) = _STRUCT.unpack_from(data)
        if magic != MAGIC:
            raise HeaderError(f"magic {magic!r}, expected {MAGIC!r}")
        if version not in READ_VERSIONS:
            raise HeaderError(f"version {version}, expected one of {READ_VERSIONS}")
        if version == 1:  # no chunks: the bytes of the chunk fields are reserved, zero
            if chunk_index or chunk_count:
                raise HeaderError("reserved header bytes are not zero")
            chunk_count = 1
        else:
            problem = chunk_problem(chunk_index, chunk_count)
            if problem is not None:
                raise HeaderError(problem)
        if kind not in _KINDS:
            raise HeaderError(f"unknown object kind code {kind}")
        header_dtype = _DTYPE_OF_CODE.get(dtype)
        if header_dtype is None:
            raise HeaderError(f"unknown dtype code {dtype}")
        if res4 != _ZERO4 or res16 != _ZERO16:
            raise HeaderError("reserved header bytes are not zero")
        text = run_id.rstrip(b"\x00")
        if not text or b"\x00" in text:
            raise HeaderError("run id is empty or holds a NUL byte")
        try:
            decoded = text.decode("utf-8")
        except UnicodeDecodeError:
            raise HeaderError("run id is not UTF-8") from None
        return cls(
            decoded,
            edge_id,
            sequence,
            _KINDS[kind],
            header_dtype,
            rows,
            extent,
            chunk_index,
            chunk_count,
        )


def chunk_problem(chunk_index: object, chunk_count: object) -> str | None:
    """Why ``chunk_index`` of ``chunk_count`` is no chunk a header holds, or ``None``."""
    if type(chunk_index) is not int or type(chunk_count) is not int:
        return f"chunk {chunk_index!r} of {chunk_count!r} is not two integers"
    if not 1 <= chunk_count <= _U32_MAX:
        return f"chunk count {chunk_count} is not in 1..{_U32_MAX}"
    if not 0 <= chunk_index < chunk_count:
        return f"chunk index {chunk_index} is not one of 0..{chunk_count - 1}"
    return None


class HeaderRejection(enum.Enum):
    """Why a receiving end refuses a record (an edge fault; nothing is consumed)."""

    RUN_ID_MISMATCH = "RUN_ID_MISMATCH"
    EDGE_ID_MISMATCH = "EDGE_ID_MISMATCH"
    KIND_MISMATCH = "KIND_MISMATCH"
    DTYPE_MISMATCH = "DTYPE_MISMATCH"
    SEQUENCE_OUT_OF_ORDER = "SEQUENCE_OUT_OF_ORDER"
    EXTENT_ZERO = "EXTENT_ZERO"
    EXTENT_TOO_LARGE = "EXTENT_TOO_LARGE"
    ROWS_MISMATCH = "ROWS_MISMATCH"
    CHUNK_MISMATCH = "CHUNK_MISMATCH"  # a chunked record of a sequence other than 0


@frozen
class HeaderCheck:
    """What a receiving end expects: its run, its edge, the edge's object spec, the
    bytes of one payload row, and the next sequence."""

    run_id: str = str_field()
    edge_id: int = int_field()
    object_spec: ObjectSpec = typed_field(ObjectSpec)
    row_bytes: int = int_field()  # hidden_dim * width for activations, 4 for token ids

    @classmethod
    def for_edge(
        cls, run_id: str, edge_id: int, object_spec: ObjectSpec, hidden_dim: int
    ) -> HeaderCheck:
        """The check of an edge of a run whose activations are ``hidden_dim`` wide."""
        if object_spec.kind is ObjectKind.TOKEN:
            row_bytes = 4
        else:
            row_bytes = hidden_dim * object_spec.dtype_width_bytes
        return cls(run_id, edge_id, object_spec, row_bytes)

    def validate(
        self, header: ObjectHeader, expected_sequence: int
    ) -> tuple[HeaderRejection, str] | None:
        """``None`` if the record is acceptable, else the reason and a detail."""
        if header.run_id != self.run_id:
            return HeaderRejection.RUN_ID_MISMATCH, f"{header.run_id!r} != {self.run_id!r}"
        if header.edge_id != self.edge_id:
            return HeaderRejection.EDGE_ID_MISMATCH, f"{header.edge_id} != {self.edge_id}"
        if header.sequence != expected_sequence:
            return (
                HeaderRejection.SEQUENCE_OUT_OF_ORDER,
                f"sequence {header.sequence}, expected {expected_sequence}",
            )
        return self.validate_shape(header)

    def validate_shape(self, header: ObjectHeader) -> tuple[HeaderRejection, str] | None:
        """The checks of ``validate`` that do not depend on the run, the edge id or the
        sequence: kind, dtype, extent, rows, and a chunk only at sequence 0."""
        spec = self.object_spec
        if header.kind is not spec.kind:
            return HeaderRejection.KIND_MISMATCH, f"{header.kind.value} != {spec.kind.value}"
        if header.dtype.family_width != (spec.dtype_family, spec.dtype_width_bytes):
            return HeaderRejection.DTYPE_MISMATCH, f"{header.dtype.name}"
        if header.extent_bytes == 0:
            return HeaderRejection.EXTENT_ZERO, "empty payload"
        if header.extent_bytes > spec.max_extent:
            return (
                HeaderRejection.EXTENT_TOO_LARGE,
                f"{header.extent_bytes} > max_extent {spec.max_extent}",
            )
        if header.rows < 1 or (header.sequence > 0 and header.rows != 1):
            return HeaderRejection.ROWS_MISMATCH, f"{header.rows} rows at {header.sequence}"
        if header.sequence > 0 and header.chunk_count != 1:
            return (
                HeaderRejection.CHUNK_MISMATCH,
                f"chunk {header.chunk_index} of {header.chunk_count} at sequence "
                f"{header.sequence}: only the prefill (sequence 0) is chunked",
            )
        trailer = spec.max_extent - 4 if spec.layout is _WITH_LOGITS else 0
        if header.extent_bytes != header.rows * self.row_bytes + trailer:
            return (
                HeaderRejection.ROWS_MISMATCH,
                f"{header.rows} rows of {self.row_bytes} bytes (+{trailer}) "
                f"!= extent {header.extent_bytes}",
            )
        return None
