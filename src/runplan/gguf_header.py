"""Reading GGUF headers (metadata and tensor infos), never tensor data.

The bytes are parsed by ``gguf_reader`` (the gguf package's ``GGUFReader``, fast and
strict); ``gguf_files`` opens each file of a source and checks each shard is the one
its set or manifest names, ``gguf_tensors`` checks the tensor infos as llama.cpp does
(tensor types, shapes, where each tensor's data lies); this module reads a source's
header as one and its metadata through typed accessors. Every failure is a
``GgufError`` (``gguf_error``) naming the file and, where there is one, the key or
tensor; nothing takes time or memory in proportion to a count the file cannot back.
"""

from __future__ import annotations

import math
import os
from typing import Any

import attrs
import numpy as np
import numpy.typing as npt
from gguf import GGUFValueType

from runplan.gguf_error import GgufError
from runplan.gguf_files import (
    _check_shard,
    _check_shard_of,
    _open,
    metadata_difference,
    split_paths,
)
from runplan.gguf_reader import HeaderReader
from runplan.gguf_tensors import TensorInfo, _tensor_infos
from runplan.key_types import every_file_type, llamacpp_type
from runplan.shards import (
    ManifestError,
    ShardKeys,
    ShardManifest,
    SliceParts,
    manifest_path,
    read_manifest,
    shards_for,
    slice_tensor_names,
)
from runplan.tensor_names import block_index
from runplan.validate import U32_MAX

#: float32's largest finite value: the float hyperparameters' bound (``number``)
F32_MAX = float(np.finfo(np.float32).max)


@attrs.define
class GgufHeader:
    """Metadata and tensor infos of one GGUF source: one file, a llama.cpp split set, or
    the shards a manifest names (``runplan.shards``).

    The typed accessors (``integer``, ``number``, ``boolean``, ``string``, ``strings``,
    ``array``) check a key's GGUF type before they read its value, and raise
    ``GgufError`` naming the file and the key for a value of another type (an array
    where a number belongs is refused without being read; a model key llama.cpp reads
    as exactly one type, ``key_types``, stored as another, as llama.cpp refuses it) or a
    string that is not UTF-8.

    ``paths`` are the files read; ``source_paths`` what names the source (the manifest
    for shards, else ``paths``). ``held_blocks`` is ``None`` when the files hold every
    block of the model; only a header read through a manifest, of the shards one stage
    needs, holds some blocks (those), which the facts reader then accepts."""

    paths: tuple[str, ...]
    _readers: list[HeaderReader]
    tensors: dict[str, TensorInfo]
    held_blocks: frozenset[int] | None = None
    source_paths: tuple[str, ...] = ()
    model_id: str | None = None  # the source's, when its file names do not say it
    #: each key's field's end in the first file (``field_bytes``), found once
    _field_ends: dict[int, int] | None = attrs.field(default=None, init=False, repr=False)

    def __attrs_post_init__(self) -> None:
        if not self.source_paths:
            self.source_paths = self.paths

    @classmethod
    def read(cls, path: str | os.PathLike[str], parts: SliceParts | None = None) -> GgufHeader:
        """The header of the source ``path`` names: a GGUF file, any file of a split
        set, or a shard manifest (``manifest.json`` or its folder). Through a manifest,
        ``parts`` reads only the shards a stage holding those parts needs (``None``:
        every shard). ``TypeError`` for a path that is not a ``str`` or a path-like of
        one (bytes paths are not read); ``GgufError`` for an empty path."""
        path = _path_text(path)
        manifest = manifest_path(path)
        if manifest is not None:
            return cls._read_shards(manifest, parts)
        given = os.path.abspath(path)
        reader = _open(given)
        alone = cls((given,), [reader], {})
        count = alone.integer("split.count") if alone.has("split.count") else 1
        paths = split_paths(given, count)
        readers = [reader if p == given else _open(p) for p in paths]
        tensors: dict[str, TensorInfo] = {}
        for index, (p, reader) in enumerate(zip(paths, readers, strict=True)):
            if len(paths) > 1:
                _check_shard(cls((p,), [reader], {}), p, index, len(paths))
            for info in _tensor_infos(p, reader, index):
                if info.name in tensors:
                    raise GgufError(p, f"tensor {info.name!r} appears twice in the split set")
                tensors[info.name] = info
        header = cls(paths, readers, tensors)
        if len(paths) > 1 and header.has("split.tensors.count"):
            claimed = header.integer("split.tensors.count")
            if claimed != len(tensors):
                raise GgufError(
                    paths[0],
                    f"the split set holds {len(tensors)} tensors, its header says {claimed}",
                    "split.tensors.count",
                )
        return header

    @classmethod
    def _read_shards(cls, path: str, parts: SliceParts | None) -> GgufHeader:
        """The shards of the manifest at ``path`` that ``parts`` needs, read as one
        source; each checked to be the shard its manifest names (its keys, its blocks)."""
        path = os.path.abspath(path)
        try:
            manifest = read_manifest(path)
        except ManifestError as exc:
            raise GgufError(path, str(exc).removeprefix(f"{exc.path}: ")) from None
        if parts is None:  # the whole model: its shards must hold all of it
            _check_whole(path, manifest)
        folder = os.path.dirname(path)
        entries = shards_for(manifest, parts)
        if not entries:
            raise GgufError(path, f"no shard holds {parts.describe() if parts else 'anything'}")
        paths = tuple(os.path.join(folder, e.file) for e in entries)
        readers = [_open(p) for p in paths]
        # each stage takes its hyperparameters from its first shard: every shard must
        # hold the same metadata as stored (the facts read every shard)
        reference = cls((paths[0],), [readers[0]], {})
        tensors: dict[str, TensorInfo] = {}
        held: set[int] = set()
        for index, (p, reader, entry) in enumerate(zip(paths, readers, entries, strict=True)):
            shard = cls((p,), [reader], {})
            _check_shard_of(shard, p, entry, manifest)
            difference = metadata_difference(reference, paths[0], shard, p)
            if difference is not None:
                raise GgufError(p, difference[1], difference[0])
            infos = _tensor_infos(p, reader, index)
            blocks = {b for b in (block_index(i.name) for i in infos) if b is not None}
            if not _is_range(blocks, entry.parts.blocks):
                raise GgufError(
                    p,
                    f"holds blocks {_spans(blocks)}; its manifest says "
                    f"{entry.parts.layer_start}-{entry.parts.layer_end_exclusive - 1}",
                    ShardKeys.LAYER_START,
                )
            held |= blocks
            for info in infos:
                first = tensors.setdefault(info.name, info)
                if (first.ggml_type, first.shape) != (info.ggml_type, info.shape):
                    raise GgufError(
                        p,
                        f"tensor {info.name!r} is {info.ggml_type} {list(info.shape)}, in "
                        f"{paths[first.file_index]} {first.ggml_type} {list(first.shape)}",
                    )
        whole = held == set(range(manifest.block_count))
        return cls(
            paths,
            readers,
            tensors,
            held_blocks=None if whole else frozenset(held),
            source_paths=(path,),
            model_id=manifest.model_id,
        )

    # -- metadata ---------------------------------------------------------------
    def has(self, key: str) -> bool:
        return key in self._readers[0].fields

    def keys(self) -> list[str]:
        return list(self._readers[0].fields)

    def value_type(self, key: str) -> GGUFValueType:
        return self._field(key).types[0]  # type: ignore[no-any-return]

    def get(self, key: str) -> Any:
        """A scalar or string value, or a list for an array (of numbers or strings)."""
        field = self._field(key)
        kind = field.types[0]
        if kind == GGUFValueType.STRING:
            return self._decode(key, field.parts[-1])
        if kind == GGUFValueType.ARRAY:
            if field.types[1] == GGUFValueType.STRING:
                return self.strings(key)
            return self.array(key).tolist()
        return field.parts[-1].tolist()[0]

    def integer(self, key: str, default: int | None = None) -> int:
        """An integer value: of any integer type, or for a key of ``key_types``' table
        of the one type llama.cpp reads it as (UINT32)."""
        if not self.has(key):
            if default is not None:
                return default
            raise GgufError(self.paths[0], "required key is missing", key)
        field = self._field(key)
        if field.types[0] not in _INTEGER_TYPES:
            raise GgufError(self.paths[0], f"expected an integer, found {_describe(field)}", key)
        self._check_llamacpp_type(key, field)
        return int(field.parts[-1][0])

    def dimension(self, key: str, default: int | None = None) -> int:
        """An integer a model sizes itself by (``embedding_length``, ``context_length``,
        a head size): 1..2**32-1, as llama.cpp's ``uint32_t`` hyperparameters hold them;
        else ``GgufError`` naming the key and the value. ``default`` (for a key the file
        lacks) is the caller's to check."""
        if default is not None and not self.has(key):
            return default
        value = self.integer(key)
        if not 1 <= value <= U32_MAX:
            raise GgufError(self.paths[0], f"{value}: it must be in 1..{U32_MAX}", key)
        return value

    def number(self, key: str, default: float | None = None) -> float:
        """An integer or floating-point value, as a float (for a key of ``key_types``'
        table a FLOAT32 only, as llama.cpp reads it): finite and within float32's range
        (llama.cpp holds its hyperparameters as ``float``, and every worker computes in
        float32)."""
        if not self.has(key):
            if default is not None:
                return default
            raise GgufError(self.paths[0], "required key is missing", key)
        field = self._field(key)
        if field.types[0] not in _INTEGER_TYPES | _FLOAT_TYPES:
            raise GgufError(self.paths[0], f"expected a number, found {_describe(field)}", key)
        self._check_llamacpp_type(key, field)
        value = float(field.parts[-1][0])
        if not math.isfinite(value):
            raise GgufError(self.paths[0], f"expected a finite number, found {value}", key)
        if abs(value) > F32_MAX:
            raise GgufError(self.paths[0], f"{value}: past float32's range (+-{F32_MAX:.7g})", key)
        return value

    def boolean(self, key: str, default: bool) -> bool:
        """A bool value (llama.cpp reads flags only as GGUF bools)."""
        if not self.has(key):
            return default
        field = self._field(key)
        if field.types[0] != GGUFValueType.BOOL:
            raise GgufError(self.paths[0], f"expected a bool, found {_describe(field)}", key)
        return bool(field.parts[-1][0])

    def string(self, key: str, default: str | None = None, *, replace: bool = False) -> str:
        """A string; ``replace``: invalid UTF-8 in it replaced (for a name only shown),
        else refused."""
        if not self.has(key):
            if default is not None:
                return default
            raise GgufError(self.paths[0], "required key is missing", key)
        field = self._field(key)
        if field.types[0] != GGUFValueType.STRING:
            raise GgufError(self.paths[0], f"expected a string, found {_describe(field)}", key)
        if replace:
            text: str = field.parts[-1].tobytes().decode("utf-8", errors="replace")
            return text
        return self._decode(key, field.parts[-1])

    def strings(self, key: str, *, keep_bytes: bool = False) -> list[str]:
        """An array of strings, invalid UTF-8 in an element replaced with U+FFFD, or
        with ``keep_bytes`` kept as lone surrogates (``surrogateescape``: the vocabulary's
        tokens, which llama.cpp keeps as bytes: two that differ stay two, and a token's
        bytes come back with ``encode("utf-8", "surrogateescape")``)."""
        field = self._field(key)
        if field.types[:2] != [GGUFValueType.ARRAY, GGUFValueType.STRING]:
            raise GgufError(
                self.paths[0], f"expected an array of strings, found {_describe(field)}", key
            )
        return self._readers[0].strings(field, "surrogateescape" if keep_bytes else "replace")

    def array(self, key: str) -> npt.NDArray[Any]:
        """An array of numbers as one read-only NumPy array."""
        field = self._field(key)
        if field.types[0] != GGUFValueType.ARRAY or len(field.data) != 1:
            raise GgufError(
                self.paths[0], f"expected an array of numbers, found {_describe(field)}", key
            )
        return np.asarray(field.parts[field.data[0]])

    def array_length(self, key: str) -> int:
        """The number of items of an array, without reading them."""
        field = self._field(key)
        if field.types[0] != GGUFValueType.ARRAY:
            raise GgufError(self.paths[0], f"expected an array, found {_describe(field)}", key)
        return _array_count(field)

    def check_every_file_types(self, arch: str) -> None:
        """``GgufError`` naming the first key of the file that llama.cpp reads of every
        file of ``arch`` as one GGUF type (``key_types.every_file_type``) and the file
        stores as another, as llama.cpp refuses it: read here or not."""
        for key in self.keys():
            expected = every_file_type(key, arch)
            if expected is not None:
                self.check_type(key, expected)

    def check_type(self, key: str, expected: GGUFValueType) -> None:
        """``GgufError`` where the file's ``key`` is of another GGUF type than
        ``expected``, the one llama.cpp reads it as (naming the key, both types and the
        value)."""
        self._check_llamacpp_type(key, self._field(key), expected)

    def _check_llamacpp_type(
        self, key: str, field: Any, expected: GGUFValueType | None = None
    ) -> None:
        """A key llama.cpp reads as one GGUF type (``expected``, by default
        ``key_types``' table) stored as another is refused, as llama.cpp refuses it,
        naming the key, both types and the value."""
        if expected is None:
            expected = llamacpp_type(key)
        if expected is not None and field.types[0] != expected:
            raise GgufError(
                self.paths[0],
                f"expected a {expected.name} (llama.cpp reads this key as one and refuses "
                f"another type), found {_describe(field)}",
                key,
            )

    def _field(self, key: str) -> Any:
        field = self._readers[0].fields.get(key)
        if field is None:
            raise GgufError(self.paths[0], "required key is missing", key)
        return field

    def _decode(self, key: str, data: npt.NDArray[np.uint8]) -> str:
        try:
            return data.tobytes().decode("utf-8")
        except UnicodeDecodeError as exc:
            raise GgufError(
                self.paths[0], f"the string is not valid UTF-8 (byte {exc.start})", key
            ) from None

    # -- metadata as stored (for writing shards and keying sources) ------------------
    def field_bytes(self, key: str) -> bytes:
        """The key-value pair ``key`` exactly as the (first) file stores it: key, type
        and value."""
        reader = self._readers[0]
        field = self._field(key)
        if self._field_ends is None:  # once: a file's keys each read (content keys) is n, not n**2
            starts = sorted({f.offset for f in reader.fields.values()})
            self._field_ends = dict(zip(starts, [*starts[1:], reader.kv_end], strict=True))
        return bytes(reader.data[field.offset : self._field_ends[field.offset]])

    def writer_value(self, key: str) -> tuple[GGUFValueType, Any, GGUFValueType | None]:
        """``key``'s value as ``gguf.GGUFWriter.add_key_value`` takes it to write the
        same bytes: its type, the value (strings as their stored bytes, arrays as lists)
        and an array's item type."""
        field = self._field(key)
        kind = field.types[0]
        if kind == GGUFValueType.STRING:
            return kind, bytes(field.parts[-1]), None
        if kind != GGUFValueType.ARRAY:
            return kind, field.parts[-1].tolist()[0], None
        item = field.types[1]
        if item == GGUFValueType.STRING:
            return kind, self._readers[0].raw_strings(field), item
        return kind, self.array(key).tolist(), item

    def path_for(self, name: str) -> str:
        """The file that holds tensor ``name``, or should: for shards read through a
        manifest, the first shard read whose parts take it (``slice_tensor_names``, by
        the shard's own keys), else the manifest; else the first file."""
        info = self.tensors.get(name)
        if info is not None:
            return self.paths[info.file_index]
        if self.source_paths == self.paths:
            return self.paths[0]
        names = [*self.tensors, name]
        for path, reader in zip(self.paths, self._readers, strict=True):
            shard = type(self)((path,), [reader], {})
            parts = SliceParts(
                shard.integer(ShardKeys.LAYER_START),
                shard.integer(ShardKeys.LAYER_END),
                shard.boolean(ShardKeys.EMBEDDING, False),
                shard.boolean(ShardKeys.OUTPUT, False),
            )
            if name in slice_tensor_names(names, parts):
                return path
        return self.source_paths[0]

    # -- tensor data (for loaders; the planner never calls these) ----------------
    def tensor_bytes(self, name: str) -> npt.NDArray[np.uint8]:
        """The raw bytes of one tensor: a view into the memory-mapped file."""
        info = self.tensors[name]
        data: npt.NDArray[np.uint8] = self._readers[info.file_index].data
        return data[info.offset : info.offset + info.n_bytes]


_INTEGER_TYPES = frozenset(
    {
        GGUFValueType.UINT8,
        GGUFValueType.INT8,
        GGUFValueType.UINT16,
        GGUFValueType.INT16,
        GGUFValueType.UINT32,
        GGUFValueType.INT32,
        GGUFValueType.UINT64,
        GGUFValueType.INT64,
    }
)
_FLOAT_TYPES = frozenset({GGUFValueType.FLOAT32, GGUFValueType.FLOAT64})


def _array_count(field: Any) -> int:
    # parts: key length, key, value type, item type, item count, ...
    return int(field.parts[4][0])


def _describe(field: Any) -> str:
    kind = field.types[0]
    if kind == GGUFValueType.ARRAY:
        return f"an array of {_array_count(field)} {field.types[1].name}"
    if kind == GGUFValueType.STRING:
        return f"a string of {len(field.parts[-1])} bytes"
    return f"a {kind.name} ({field.parts[-1].tolist()[0]!r})"


def _spans(blocks: set[int]) -> str:
    """``0-4, 7``: blocks as runs of consecutive ones (``none``)."""
    runs: list[list[int]] = []
    for b in sorted(blocks):
        if runs and runs[-1][-1] == b - 1:
            runs[-1].append(b)
        else:
            runs.append([b])
    return ", ".join(f"{r[0]}-{r[-1]}" if len(r) > 1 else str(r[0]) for r in runs) or "none"


def _is_range(blocks: set[int], expected: range) -> bool:
    """Whether ``blocks`` is ``expected`` (a step-1 range), without making a set of the
    range: a manifest may claim any count."""
    return len(blocks) == len(expected) and (
        not blocks or (min(blocks) == expected.start and max(blocks) == expected.stop - 1)
    )


def _check_whole(path: str, manifest: ShardManifest) -> None:
    """``GgufError`` unless the manifest's shards together hold every block, the token
    embedding and the output (a manifest with a shard's entry taken out once read as
    the whole model, its missing blocks weighing nothing to the planner, and failed
    only as stages loaded, blaming another shard). Spans, not blocks, are walked: a
    hostile manifest's count may be any size."""
    first, missing, reached = None, 0, 0  # blocks before `reached` are held or counted
    spans = sorted((e.parts.layer_start, e.parts.layer_end_exclusive) for e in manifest.shards)
    for start, end in [*spans, (manifest.block_count, manifest.block_count)]:
        if start > reached:
            first = reached if first is None else first
            missing += start - reached
        reached = max(reached, end)
    if first is not None:
        raise GgufError(
            path,
            f"no shard holds block {first} ({missing} of its "
            f"{manifest.block_count} blocks are in none): the whole model needs them all",
        )
    for part in ("embedding", "output"):
        if not any(getattr(e.parts, part) for e in manifest.shards):
            raise GgufError(path, f"no shard holds the {part}: the whole model needs it")


def _path_text(path: object) -> str:
    """``path`` as text, refused before anything reads it where it is no path: a bytes
    path once failed inside (in ``str.endswith``), and an empty one was read as the
    current folder (``os.path.abspath("")``)."""
    text = os.fspath(path) if isinstance(path, str | os.PathLike) else path
    if not isinstance(text, str):
        raise TypeError(
            f"a GGUF path must be a str or an os.PathLike of one, not {type(path).__name__}: "
            f"{path!r:.80}"
        )
    if not text:
        raise GgufError("''", "an empty path names no file")
    return text
