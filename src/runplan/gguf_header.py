"""Reading GGUF headers (metadata and tensor infos), never tensor data.

This extends the gguf package's ``GGUFReader`` rather than parsing the format again:
its parsing of a header is kept, with two changes that make a header of a real model
readable in milliseconds: arrays of numbers become one NumPy view instead of one view
per element, and arrays of strings (the vocabulary, the merges) are skipped over and
decoded only on request. Tensor infos are collected without making data views.
"""

from __future__ import annotations

import os
import re
import struct
import sys
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import numpy.typing as npt
from attrs import frozen
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, GGUFValueType


class GgufError(ValueError):
    """A GGUF file that cannot be read as a model: not GGUF, truncated, malformed, or
    lacking a required key. Names the file and, where there is one, the key."""

    def __init__(self, path: str | os.PathLike[str], message: str, key: str | None = None):
        self.path = os.fspath(path)
        self.key = key
        where = f" (key {key!r})" if key is not None else ""
        super().__init__(f"{self.path}{where}: {message}")


@frozen
class TensorInfo:
    """One tensor as the header describes it. ``shape`` is as stored in the file:
    fastest-varying dimension first (llama.cpp's ``ne``)."""

    name: str
    ggml_type: str  # GGMLQuantizationType name, e.g. "Q4_1"
    shape: tuple[int, ...]
    n_bytes: int
    file_index: int  # which file of the source holds it
    offset: int  # absolute byte offset of the data in that file


@frozen
class _StringArray:
    offset: int  # of the first string's length prefix
    count: int


class _HeaderReader(GGUFReader):
    """``GGUFReader`` with fast arrays and no tensor data views."""

    def __init__(self, path: str) -> None:
        self._string_arrays: dict[int, _StringArray] = {}
        self.tensor_infos: list[tuple[str, int, tuple[int, ...], int]] = []
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

    def _struct_order(self) -> str:
        host_little = sys.byteorder == "little"
        file_little = host_little if self.byte_order == "I" else not host_little
        return "<" if file_little else ">"

    def _get_field_parts(
        self, orig_offs: int, raw_type: int
    ) -> tuple[int, list[npt.NDArray[Any]], list[int], list[GGUFValueType]]:
        if GGUFValueType(raw_type) != GGUFValueType.ARRAY:
            return super()._get_field_parts(orig_offs, raw_type)
        offs = orig_offs
        raw_itype = self._get(offs, np.uint32)
        alen = self._get(offs + 4, np.uint64)
        offs += 12
        itype = GGUFValueType(int(raw_itype[0]))
        count = int(alen[0])
        remaining = len(self.data) - offs
        if itype == GGUFValueType.STRING:
            if count * 8 > remaining:
                raise ValueError(f"string array of {count} items runs past the end of the file")
            self._string_arrays[orig_offs] = _StringArray(offs, count)
            unpack = struct.Struct(self._struct_order() + "Q").unpack_from
            buf = self._view
            for _ in range(count):
                offs += 8 + unpack(buf, offs)[0]
            if offs > len(self.data):
                raise ValueError("string array runs past the end of the file")
            types = [GGUFValueType.ARRAY, GGUFValueType.STRING]
            return offs - orig_offs, [raw_itype, alen], [], types
        nptype = self.gguf_scalar_to_np.get(itype)
        if nptype is None:  # arrays of arrays: the package's own (slow) path
            return super()._get_field_parts(orig_offs, raw_type)
        itemsize = np.dtype(nptype).itemsize
        if count * itemsize > remaining:
            raise ValueError(f"array of {count} {itype.name} runs past the end of the file")
        values = self._get(offs, nptype, count)
        return 12 + count * itemsize, [raw_itype, alen, values], [2], [GGUFValueType.ARRAY, itype]

    def _build_tensors(self, start_offs: int, fields: list[Any]) -> None:
        for field in fields:
            _len, name_data, _n_dims, dims, raw_dtype, offset_tensor = field.parts
            name = bytes(name_data).decode("utf-8")
            self.tensor_infos.append(
                (
                    name,
                    int(raw_dtype[0]),
                    tuple(int(d) for d in dims),
                    int(start_offs + offset_tensor[0]),
                )
            )
        self.tensors = []

    def strings(self, field: Any) -> list[str]:
        key_len, key_data, value_type = field.parts[:3]
        value_offset = field.offset + key_len.nbytes + key_data.nbytes + value_type.nbytes
        arr = self._string_arrays[value_offset]
        unpack = struct.Struct(self._struct_order() + "Q").unpack_from
        buf = self._view
        out = []
        offs = arr.offset
        for _ in range(arr.count):
            (n,) = unpack(buf, offs)
            out.append(str(buf[offs + 8 : offs + 8 + n], "utf-8", "replace"))
            offs += 8 + n
        return out


_SPLIT_RE = re.compile(r"^(?P<prefix>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")


def split_paths(path: str | os.PathLike[str]) -> tuple[str, ...]:
    """The files of the source ``path`` belongs to: itself, or every shard of its
    llama.cpp split set (``name-00002-of-00003.gguf`` names the set too)."""
    p = os.fspath(path)
    m = _SPLIT_RE.match(p)
    if m is None:
        return (p,)
    count = int(m["count"])
    if count < 1 or not 1 <= int(m["no"]) <= count:
        raise GgufError(p, f"split file name says shard {m['no']} of {m['count']}")
    return tuple(f"{m['prefix']}-{i:05d}-of-{count:05d}.gguf" for i in range(1, count + 1))


def model_id_for(path: str | os.PathLike[str]) -> str:
    """The file name without ``.gguf`` and without a split suffix."""
    name = Path(os.fspath(path)).name
    m = _SPLIT_RE.match(name)
    if m is not None:
        return m["prefix"]
    return name.removesuffix(".gguf")


@attrs.define
class GgufHeader:
    """Metadata and tensor infos of one GGUF source (one file or a split set)."""

    paths: tuple[str, ...]
    _readers: list[_HeaderReader]
    tensors: dict[str, TensorInfo]

    @classmethod
    def read(cls, path: str | os.PathLike[str]) -> GgufHeader:
        paths = tuple(os.path.abspath(p) for p in split_paths(path))
        readers = [_open(p) for p in paths]
        tensors: dict[str, TensorInfo] = {}
        for index, (p, reader) in enumerate(zip(paths, readers, strict=True)):
            if len(paths) > 1:
                _check_shard(p, reader, index, len(paths))
            size = len(reader.data)
            for name, raw_type, shape, offset in reader.tensor_infos:
                tensors[name] = _tensor_info(p, name, raw_type, shape, offset, index, size, tensors)
        if len(paths) > 1:
            field = readers[0].fields.get("split.tensors.count")
            if field is not None and field.contents() != len(tensors):
                raise GgufError(
                    paths[0],
                    f"the split set holds {len(tensors)} tensors, its header says "
                    f"{field.contents()}",
                    "split.tensors.count",
                )
        return cls(paths, readers, tensors)

    # -- metadata ---------------------------------------------------------------
    def has(self, key: str) -> bool:
        return key in self._readers[0].fields

    def keys(self) -> list[str]:
        return [k for k in self._readers[0].fields if not k.startswith("GGUF.")]

    def value_type(self, key: str) -> GGUFValueType:
        return self._field(key).types[0]  # type: ignore[no-any-return]

    def get(self, key: str) -> Any:
        """A scalar or string value, or a list for an array of numbers."""
        field = self._field(key)
        if field.types[:2] == [GGUFValueType.ARRAY, GGUFValueType.STRING]:
            return self.strings(key)
        return field.contents()

    def integer(self, key: str, default: int | None = None) -> int:
        if not self.has(key):
            if default is not None:
                return default
            raise GgufError(self.paths[0], "required key is missing", key)
        value = self.get(key)
        if isinstance(value, bool) or not isinstance(value, int):
            raise GgufError(self.paths[0], f"expected an integer, found {value!r}", key)
        return value

    def string(self, key: str, default: str | None = None) -> str:
        if not self.has(key):
            if default is not None:
                return default
            raise GgufError(self.paths[0], "required key is missing", key)
        value = self.get(key)
        if not isinstance(value, str):
            raise GgufError(self.paths[0], f"expected a string, found {value!r}", key)
        return value

    def strings(self, key: str) -> list[str]:
        field = self._field(key)
        if field.types[:2] != [GGUFValueType.ARRAY, GGUFValueType.STRING]:
            raise GgufError(self.paths[0], "expected an array of strings", key)
        return self._readers[0].strings(field)

    def array(self, key: str) -> npt.NDArray[Any]:
        """An array of numbers as one read-only NumPy array."""
        field = self._field(key)
        if field.types[0] != GGUFValueType.ARRAY or len(field.data) != 1:
            raise GgufError(self.paths[0], "expected an array of numbers", key)
        return np.asarray(field.parts[field.data[0]])

    def array_length(self, key: str) -> int:
        field = self._field(key)
        if field.types[0] != GGUFValueType.ARRAY:
            raise GgufError(self.paths[0], "expected an array", key)
        # parts: key length, key, value type, item type, item count, items...
        return int(field.parts[4][0])

    def _field(self, key: str) -> Any:
        field = self._readers[0].fields.get(key)
        if field is None:
            raise GgufError(self.paths[0], "required key is missing", key)
        return field

    # -- tensor data (for loaders; the planner never calls these) ----------------
    def tensor_bytes(self, name: str) -> npt.NDArray[np.uint8]:
        """The raw bytes of one tensor: a view into the memory-mapped file."""
        info = self.tensors[name]
        data: npt.NDArray[np.uint8] = self._readers[info.file_index].data
        return data[info.offset : info.offset + info.n_bytes]


def _open(path: str) -> _HeaderReader:
    if not os.path.exists(path):
        raise GgufError(path, "no such file")
    if os.path.isdir(path):
        raise GgufError(path, "is a directory, not a GGUF file")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise GgufError(path, f"not a GGUF file (magic {magic!r}, expected b'GGUF')")
    try:
        return _HeaderReader(path)
    except GgufError:
        raise
    except (
        ValueError,
        IndexError,
        KeyError,
        OverflowError,
        struct.error,
        UnicodeDecodeError,
        MemoryError,
    ) as exc:
        raise GgufError(path, f"malformed or truncated header: {exc}") from exc


def _check_shard(path: str, reader: _HeaderReader, index: int, count: int) -> None:
    for key, want in (("split.no", index), ("split.count", count)):
        field = reader.fields.get(key)
        if field is None:
            raise GgufError(path, "a shard of a split set lacks its split key", key)
        got = field.contents()
        if got != want:
            raise GgufError(path, f"is {got}, expected {want} for this shard", key)


def _tensor_info(
    path: str,
    name: str,
    raw_type: int,
    shape: tuple[int, ...],
    offset: int,
    index: int,
    file_size: int,
    seen: dict[str, TensorInfo],
) -> TensorInfo:
    if name in seen:
        raise GgufError(path, f"tensor {name!r} appears twice")
    try:
        qtype = GGMLQuantizationType(raw_type)
    except ValueError:
        raise GgufError(path, f"tensor {name!r} has unknown GGML type {raw_type}") from None
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    if not shape or any(d < 1 for d in shape) or shape[0] % block_size:
        raise GgufError(
            path, f"tensor {name!r} has shape {list(shape)}, impossible for {qtype.name}"
        )
    n_elems = 1
    for d in shape:
        n_elems *= d
    n_bytes = n_elems // block_size * type_size
    if offset + n_bytes > file_size:
        raise GgufError(
            path,
            f"truncated: tensor {name!r} needs bytes up to {offset + n_bytes}, "
            f"the file has {file_size}",
        )
    return TensorInfo(name, qtype.name, shape, n_bytes, index, offset)
