"""One shard as a GGUF file (``runplan.shards``): some tensors of a source, its metadata
copied as stored, and the shard's own keys, written with ``gguf.GGUFWriter``.

``shard_header`` is the header of such a file (magic, key-value pairs, tensor infos,
padding up to the first tensor's data) as bytes: what a slice transfer sends before the
tensors (``runtime_cupy.slices``). ``write_shard`` writes a whole shard file from the
source's memory map, under a partial file of its own renamed into place once complete.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import numpy as np
from gguf import GGUF_DEFAULT_ALIGNMENT, GGMLQuantizationType, GGUFValueType, GGUFWriter

from runplan.content import SourceContent
from runplan.gguf_error import GgufError
from runplan.gguf_files import metadata_difference
from runplan.gguf_header import GgufHeader
from runplan.shards import CUT_KEY_PREFIXES, ShardKeys, SliceParts
from runplan.whole_file import whole_file

#: ``progress(done_bytes, total_bytes)`` while a shard's tensors are written.
WriteProgress = Callable[[int, int], None]


def _writer(
    header: GgufHeader,
    names: Sequence[str],
    parts: SliceParts,
    source_key: str,
    tensor_sha256: Mapping[str, str],
    model_id: str,
) -> GGUFWriter:
    """A writer holding the shard's metadata and tensor infos, no file yet."""
    arch = header.string("general.architecture")
    writer = GGUFWriter(path=None, arch=arch)
    for key in header.keys():  # noqa: SIM118 (a header is not a mapping)
        if key.startswith(CUT_KEY_PREFIXES) or key == "general.architecture":
            continue  # the writer wrote the architecture itself, the same bytes
        vtype, value, item = header.writer_value(key)
        if vtype == GGUFValueType.ARRAY and not value:
            raise GgufError(header.paths[0], "an empty array, which GGUFWriter cannot write", key)
        writer.add_key_value(key, value, vtype, item)
    if header.has("general.alignment"):
        writer.data_alignment = header.integer("general.alignment")
    writer.add_uint32(ShardKeys.LAYER_START, parts.layer_start)
    writer.add_uint32(ShardKeys.LAYER_END, parts.layer_end_exclusive)
    writer.add_bool(ShardKeys.EMBEDDING, parts.embedding)
    writer.add_bool(ShardKeys.OUTPUT, parts.output)
    writer.add_key_value(ShardKeys.SOURCE, source_key, GGUFValueType.STRING)
    writer.add_key_value(ShardKeys.MODEL_ID, model_id, GGUFValueType.STRING)
    writer.add_key_value(
        ShardKeys.TENSOR_SHA256,
        [tensor_sha256[n] for n in names],
        GGUFValueType.ARRAY,
        GGUFValueType.STRING,
    )
    for name in names:
        info = header.tensors[name]
        rows = 1
        for d in info.shape[1:]:
            rows *= d
        byte_shape = (*reversed(info.shape[1:]), info.n_bytes // rows)
        writer.add_tensor_info(
            name,
            byte_shape,
            np.dtype(np.uint8),
            info.n_bytes,
            raw_dtype=GGMLQuantizationType[info.ggml_type],
        )
    return writer


def _write_header(writer: GGUFWriter, path: Path) -> None:
    writer.write_header_to_file(path)
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    assert writer.fout is not None
    out = writer.fout[0]
    writer.write_padding(out, out.tell())  # the data section starts aligned
    writer.flush()


def shard_header(
    header: GgufHeader,
    names: Sequence[str],
    parts: SliceParts,
    source_key: str,
    tensor_sha256: Mapping[str, str],
    model_id: str,
) -> bytes:
    """The header of the shard of ``names`` (in that order): every byte of the file
    before its first tensor's data."""
    writer = _writer(header, names, parts, source_key, tensor_sha256, model_id)
    with tempfile.TemporaryDirectory(prefix="gguf-pipeline-header-") as folder:
        path = Path(folder) / "header.gguf"
        try:
            _write_header(writer, path)
        finally:
            writer.close()
        return path.read_bytes()


def padded_data_bytes(header: GgufHeader, names: Sequence[str]) -> int:
    """Bytes of a shard's data section holding ``names``: each tensor's data padded to
    the source's alignment, as ``GGUFWriter`` writes them (the last one too)."""
    align = _alignment(header)
    return sum(-(-header.tensors[n].n_bytes // align) * align for n in names)


def _alignment(header: GgufHeader) -> int:
    return header.integer("general.alignment", GGUF_DEFAULT_ALIGNMENT)


def write_shard(
    header: GgufHeader,
    names: Sequence[str],
    parts: SliceParts,
    source_key: str,
    tensor_sha256: Mapping[str, str],
    model_id: str,
    path: str | os.PathLike[str],
    progress: WriteProgress | None = None,
) -> int:
    """Write the shard of ``names`` to ``path`` (through a partial file of its own,
    renamed into place once whole: ``runplan.whole_file``); its size in bytes. The
    header is ``shard_header``'s; the tensors are written here, through a Python file,
    whose every short write raises (``GGUFWriter``'s numpy ``tofile`` dropped a buffered
    tail on a full disk without a word). ``OSError`` (a full disk ...) names ``path``
    and leaves nothing there."""
    head = shard_header(header, names, parts, source_key, tensor_sha256, model_id)
    size = len(head) + padded_data_bytes(header, names)
    align = _alignment(header)
    total = sum(header.tensors[n].n_bytes for n in names)
    done = 0
    with whole_file(path, size) as out:
        out.write(head)
        for name in names:
            n_bytes = header.tensors[name].n_bytes
            out.write(header.tensor_bytes(name).data)
            out.write(bytes(-n_bytes % align))
            done += n_bytes
            if progress is not None:
                progress(done, total)
    return size


def recorded_problem(header: GgufHeader, content: SourceContent) -> str | None:
    """For a source read through a shard manifest, whether ``content`` (its tensors
    hashed as they are on disk, and its key) is what its shards record: each tensor's
    SHA-256 and the source's key, as ``split`` wrote them. ``None`` when it is (and for
    a GGUF file or a split set, which record nothing); else the first difference, a
    tensor's before the key's (which a changed tensor changes too). The key hashes the
    first shard's metadata, so each other shard must hold the same."""
    if header.source_paths == header.paths:
        return None
    shards = [(path, GgufHeader.read(path)) for path in header.paths]
    for path, shard in shards:
        recorded = shard.strings(ShardKeys.TENSOR_SHA256)
        if len(recorded) != len(shard.tensors):
            return f"{path} holds {len(recorded)} SHA-256 for {len(shard.tensors)} tensors"
        for name, want in zip(shard.tensors, recorded, strict=True):
            got = content.tensor_sha256.get(name)
            if got != want:
                return (
                    f"tensor {name!r} of {path} hashes to {got}, its shard records {want}: "
                    "the file changed after it was split"
                )
    first_path, first = shards[0]
    for path, shard in shards[1:]:  # the key hashes the first's metadata: each holds it
        difference = metadata_difference(first, first_path, shard, path)
        if difference is not None:
            return difference[1]
    for path, shard in shards:
        source = shard.string(ShardKeys.SOURCE, "")
        if content.key != source:
            return (
                f"its content key is {content.key}, {path} records {source}: its metadata "
                "changed after it was split"
            )
    return None
