"""Parsing a GGUF header's bytes: the gguf package's ``GGUFReader``, made fast and strict.

The package's parsing of a header is kept, with these changes:

- Fast: arrays of numbers become one NumPy view instead of one view per element, and
  arrays of strings (the vocabulary, the merges) are skipped over and decoded only on
  request. Tensor infos are collected without making data views.
- Strict, and in time bounded by the file's size: every read checks that its bytes are
  in the file (the package's reads silently come back short at the end of the file),
  and every count is checked against the bytes left before anything is read or made
  for it, so a forged count of 2**60 fails at once. Reading stops at the first
  structure llama.cpp's reader (``gguf.cpp``) refuses: an array of arrays, a tensor
  with more than four dimensions, an empty or repeated tensor name. A key-value pair
  that cannot be read (a value of no GGUF type, an array of arrays, a value past the end
  of the file), a repeated key or a ``general.alignment`` that is not a ``UINT32`` power
  of two is a ``BadKey`` naming the key.
- Bounded: at most ``MAX_KEYS`` key-value pairs and ``MAX_TENSORS`` tensors. llama.cpp
  reads any number, but its files hold a few dozen pairs (the vocabulary and per-block
  values are arrays, one pair each) and a few thousand tensors (a mixture's experts
  stacked in one tensor per block), and the package makes a field of several NumPy
  views for each: a 6 MB header of 300,000 keys of one-byte values took 8 s and 490
  MB to read, a 14 MB file of 200,000 one-element tensors 9 s, a file of 100 MB
  minutes and gigabytes.

Every failure is a ``ValueError`` (or an ``IndexError``, ``KeyError``,
``UnicodeDecodeError`` from the package's own code), which ``gguf_files`` turns into a
``GgufError`` naming the file. A key or tensor name that is not UTF-8 is a
``NotUtf8Name``: the package decodes names as it parses, so such a file, which llama.cpp
reads, cannot be read here, and is refused saying so (not as a malformed header).
"""

from __future__ import annotations

import struct
import sys
from typing import Any

import numpy as np
import numpy.typing as npt
from attrs import frozen
from gguf import GGUFReader, GGUFValueType

from runplan.picklable_error import PicklableError

#: llama.cpp's GGML_MAX_DIMS.
MAX_DIMS = 4
ALIGNMENT_KEY = "general.alignment"
# The fewest bytes a key-value pair (key length, type, a one-byte value) and a tensor
# info (name length, dimension count, type, offset) take.
_MIN_KV_BYTES = 8 + 4 + 1
_MIN_TENSOR_INFO_BYTES = 8 + 4 + 4 + 8
_HEADER_BYTES = 4 + 4 + 8 + 8  # magic, version, tensor count, key-value count
#: The most key-value pairs and tensors a header is read with (the module's docstring).
MAX_KEYS = 65_536
MAX_TENSORS = 65_536
_ITEMSIZE: dict[Any, int] = {}  # numpy type -> bytes, for the bounds check of every read


class NotUtf8Name(ValueError):
    """A metadata key's or a tensor's name that is not UTF-8."""


class BadKey(PicklableError, ValueError):
    """A key-value pair the header cannot be read with, naming the key (``key``): a
    key stored twice, or a ``general.alignment`` that is not a ``UINT32`` power of two
    (llama.cpp's reader refuses both)."""

    def __init__(self, key: str, message: str) -> None:
        self.key = key
        super().__init__(message)


@frozen
class StringArray:
    offset: int  # of the first string's length prefix
    count: int


@frozen
class RawTensorInfo:
    name: str
    raw_type: int  # the GGML type id as stored
    shape: tuple[int, ...]  # as stored: fastest-varying dimension first
    offset: int  # relative to the start of the data section, as stored


class HeaderReader(GGUFReader):
    """``GGUFReader`` with fast arrays, strict reads and no tensor data views."""

    def __init__(self, path: str) -> None:
        self.string_arrays: dict[int, StringArray] = {}
        self.tensor_infos: list[RawTensorInfo] = []
        self.kv_end = 0  # where the key-value pairs end (and the tensor infos begin)
        self.header_numbers: dict[str, Any] = {}  # the package's GGUF.version, ... fields
        super().__init__(path, "r")

    # The base class keeps the file as an ``np.memmap``, whose every slice pays for
    # memmap bookkeeping; a plain ndarray view of the same mapping slices faster.
    @property  # type: ignore[override]
    def data(self) -> npt.NDArray[np.uint8]:
        return self._data

    @data.setter
    def data(self, value: npt.NDArray[np.uint8]) -> None:
        self._data = value.view(np.ndarray)
        self._view = self._data.data

    def _get(
        self,
        offset: int,
        dtype: npt.DTypeLike,
        count: int = 1,
        override_order: Any = None,
    ) -> npt.NDArray[Any]:
        count = int(count)
        itemsize = _ITEMSIZE.get(dtype)
        if itemsize is None:
            itemsize = _ITEMSIZE.setdefault(dtype, np.dtype(dtype).itemsize)
        if count < 0 or int(offset) + itemsize * count > len(self._data):
            raise ValueError(
                f"truncated: {count} x {np.dtype(dtype).name} at byte {offset} run past "
                f"the end of the file ({len(self._data)} bytes)"
            )
        return super()._get(offset, dtype, count, override_order)

    def _struct_order(self) -> str:
        host_little = sys.byteorder == "little"
        file_little = host_little if self.byte_order == "I" else not host_little
        return "<" if file_little else ">"

    def _remaining(self, offs: int) -> int:
        return len(self._data) - offs

    def _push_field(self, field: Any, skip_sum: bool = False) -> int:
        """The package files the header's own numbers (version, counts) among the keys,
        under names a file's key may also have (``GGUF.version``, which llama.cpp
        reads as any key): those are kept apart (``header_numbers``), so ``fields``
        holds the file's keys, all of them, and only them."""
        if field.offset < _HEADER_BYTES:  # magic, version and the two counts
            self.header_numbers[field.name] = field
            return 0 if skip_sum else sum(int(part.nbytes) for part in field.parts)
        first = self.fields.get(field.name)
        if first is not None:
            raise BadKey(
                field.name,
                f"stored twice, at bytes {first.offset} and {field.offset} (llama.cpp "
                "refuses a repeated key)",
            )
        return int(super()._push_field(field, skip_sum))

    def _build_fields(self, offs: int, count: int) -> int:
        count = int(count)
        if count > MAX_KEYS:
            raise ValueError(
                f"the header claims {count} key-value pairs; at most {MAX_KEYS} are read "
                "(a model's file holds a few dozen)"
            )
        if count * _MIN_KV_BYTES > self._remaining(offs):
            raise ValueError(
                f"the header claims {count} key-value pairs; the {self._remaining(offs)} "
                "bytes left cannot hold them"
            )
        for _ in range(count):  # one pair at a time: a value that fails names its key
            start = offs
            try:
                offs = int(super()._build_fields(offs, 1))
            except UnicodeDecodeError as exc:
                after = (
                    f"after the key {list(self.fields)[-1]!r}" if self.fields else "the first key"
                )
                raise NotUtf8Name(
                    f"a metadata key name that is not UTF-8: {bytes(exc.object)!r} (byte "
                    f"{exc.start}), {after}; llama.cpp reads such a key, the gguf package "
                    "this reader uses does not"
                ) from None
            except BadKey:
                raise
            except (ValueError, IndexError, OverflowError, struct.error) as exc:
                key = self._key_at(start)
                if key is None:  # the key itself is what cannot be read
                    raise
                raise BadKey(key, f"malformed or truncated value: {exc}") from None
        return offs

    def _key_at(self, offs: int) -> str | None:
        """The name of the key whose pair starts at ``offs``, if it reads (the package's
        own string reading), else ``None``."""
        try:
            _length, name = self._get_str(offs)
            return bytes(name).decode("utf-8")
        except (ValueError, IndexError, OverflowError):
            return None

    def _get_field_parts(
        self, orig_offs: int, raw_type: int
    ) -> tuple[int, list[npt.NDArray[Any]], list[int], list[GGUFValueType]]:
        if _value_type(raw_type) != GGUFValueType.ARRAY:
            return super()._get_field_parts(orig_offs, raw_type)
        offs = orig_offs
        raw_itype = self._get(offs, np.uint32)
        alen = self._get(offs + 4, np.uint64)
        offs += 12
        itype = _value_type(raw_itype[0], "an array's item type")
        count = int(alen[0])
        remaining = self._remaining(offs)
        if itype == GGUFValueType.STRING:
            if count * 8 > remaining:
                raise ValueError(f"string array of {count} items runs past the end of the file")
            self.string_arrays[orig_offs] = StringArray(offs, count)
            offs = self._skip_strings(offs, count)
            types = [GGUFValueType.ARRAY, GGUFValueType.STRING]
            return offs - orig_offs, [raw_itype, alen], [], types
        nptype = self.gguf_scalar_to_np.get(itype)
        if nptype is None:
            raise ValueError(f"an array of {itype.name} (llama.cpp reads no arrays of arrays)")
        itemsize = np.dtype(nptype).itemsize
        if count * itemsize > remaining:
            raise ValueError(f"array of {count} {itype.name} runs past the end of the file")
        values = self._get(offs, nptype, count)
        return 12 + count * itemsize, [raw_itype, alen, values], [2], [GGUFValueType.ARRAY, itype]

    def _skip_strings(self, offs: int, count: int) -> int:
        """The offset past ``count`` length-prefixed strings starting at ``offs``. A
        length read past the end of the file is a ``struct.error``; a length that runs
        past it a ``ValueError`` naming the string, its length and its offset."""
        unpack = struct.Struct(self._struct_order() + "Q").unpack_from
        buf, end = self._view, len(self._data)
        for index in range(count):
            length = unpack(buf, offs)[0]
            if length > end - offs - 8:
                raise ValueError(
                    f"string {index} of an array of {count}, at byte {offs}, claims {length} "
                    "bytes: past the end of the file"
                )
            offs += 8 + length
        return offs

    def _check_alignment(self) -> None:
        """The package's test of ``general.alignment`` (a ``UINT32``, a power of two),
        made before it, so that the refusal names the key and its value."""
        field = self.fields.get(ALIGNMENT_KEY)
        if field is None:
            return
        if field.types != [GGUFValueType.UINT32]:
            kind = "/".join(t.name for t in field.types)
            raise BadKey(ALIGNMENT_KEY, f"stored as {kind}: llama.cpp reads it only as a UINT32")
        value = int(field.parts[-1][0])
        if value == 0 or value & (value - 1):
            raise BadKey(
                ALIGNMENT_KEY,
                f"{value}: the data's alignment must be a power of two (1, 2, 4, ...)",
            )

    def _build_tensor_info(self, offs: int, count: int) -> tuple[int, list[Any]]:
        self.kv_end = int(offs)
        self._check_alignment()
        count = int(count)
        if count > MAX_TENSORS:
            raise ValueError(
                f"the header claims {count} tensors; at most {MAX_TENSORS} are read (a "
                "model's file holds a few thousand)"
            )
        if count * _MIN_TENSOR_INFO_BYTES > self._remaining(offs):
            raise ValueError(
                f"the header claims {count} tensors; the {self._remaining(offs)} bytes "
                "left cannot hold their infos"
            )
        names: set[str] = set()
        for index in range(count):
            try:
                field = self._get_tensor_info_field(offs)
            except UnicodeDecodeError as exc:
                raise NotUtf8Name(
                    f"tensor {index}'s name is not UTF-8: {bytes(exc.object)!r} (byte {exc.start})"
                ) from None
            offs += sum(int(part.nbytes) for part in field.parts)
            _len, _name, n_dims, dims, raw_dtype, offset = field.parts
            name = field.name
            if not name:
                raise ValueError(f"tensor {index} has an empty name")
            if name in names:
                raise ValueError(f"tensor {name!r} appears twice")
            if int(n_dims[0]) > MAX_DIMS:
                raise ValueError(f"tensor {name!r} has {int(n_dims[0])} dimensions (at most 4)")
            names.add(name)
            self.tensor_infos.append(
                RawTensorInfo(name, int(raw_dtype[0]), tuple(int(d) for d in dims), int(offset[0]))
            )
        return offs, []

    def _build_tensors(self, start_offs: int, fields: list[Any]) -> None:
        self.tensors = []

    def strings(self, field: Any, errors: str = "replace") -> list[str]:
        """The strings of an array-of-strings field, invalid UTF-8 replaced (``errors``:
        how ``bytes.decode`` takes it; ``surrogateescape`` keeps the bytes)."""
        return [str(raw, "utf-8", errors) for raw in self.raw_strings(field)]

    def raw_strings(self, field: Any) -> list[bytes]:
        """The strings of an array-of-strings field, as the file stores them."""
        key_len, key_data, value_type = field.parts[:3]
        value_offset = field.offset + key_len.nbytes + key_data.nbytes + value_type.nbytes
        arr = self.string_arrays[value_offset]
        unpack = struct.Struct(self._struct_order() + "Q").unpack_from
        buf = self._view
        out = []
        offs = arr.offset
        for _ in range(arr.count):
            (n,) = unpack(buf, offs)
            out.append(bytes(buf[offs + 8 : offs + 8 + n]))
            offs += 8 + n
        return out


def _value_type(raw: Any, what: str = "a value type") -> GGUFValueType:
    """``raw`` as a ``GGUFValueType``; else ``ValueError`` naming the number stored."""
    try:
        return GGUFValueType(int(raw))
    except ValueError:
        known = f"{min(GGUFValueType).value}..{max(GGUFValueType).value}"
        raise ValueError(f"{what} of {int(raw)}, none of GGUF's ({known})") from None
