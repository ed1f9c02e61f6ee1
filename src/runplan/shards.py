"""Shards: GGUF files that each hold one stage's slice of a model, and the manifest
that names them (the spec's "pre-split shard collection", PIPELINE_ORCHESTRATION_MVP.md
§3).

What a stage's slice holds (``SliceParts``, ``slice_tensor_names``) is what
``runtime_core.gguf_slice`` loads and what the planner counts: the tensors of its
blocks, the tensors every stage needs (those outside blocks, embedding and head:
llama3's ``rope_freqs`` ...), the token embedding on the first stage, the output norm
and head on the last (the embedding again when the head is tied).

A shard is a valid GGUF file of just those tensors: the source's metadata, unchanged
(``{arch}.block_count`` still counts every block of the model, so that block ``i``
keeps its name and its rope base), plus the ``gguf_pipeline.shard.*`` keys of
``ShardKeys``: the blocks and parts it holds, the source's content key
(``runplan.content``) and a SHA-256 per tensor, in the file's tensor order.

A manifest (``manifest.json``, ``MANIFEST_NAME``; ``read_manifest``) names the shards of
one source, each with the parts it holds. The facts reader refuses a file that holds
only some blocks (``gguf_facts.block_count``); a header read through a manifest
(``GgufHeader.read`` of the manifest or its folder) is the one place where that
refusal is lifted, on purpose: the manifest says which blocks each shard holds, and
every shard is checked to hold exactly those.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import cattrs
from attrs import frozen

from runplan._fields import bool_field, int_field, str_field, tuple_field, typed_field
from runplan.picklable_error import PicklableError
from runplan.plan import StagePlan
from runplan.tensor_names import EMBEDDING_TENSOR, OUTPUT_NORM_TENSOR, OUTPUT_TENSOR, block_index

MANIFEST_NAME = "manifest.json"
MANIFEST_FORMAT = "gguf-pipeline-shards"
MANIFEST_VERSION = 1
#: A manifest is small; a bigger file is not one.
MAX_MANIFEST_BYTES = 1 << 20
#: Every key of ours in a shard's metadata starts with this.
SHARD_PREFIX = "gguf_pipeline.shard."
#: Metadata that says how a model is cut into files (llama.cpp's split sets, our
#: shards), not what the model is.
CUT_KEY_PREFIXES = ("split.", "gguf_pipeline.")


class ShardKeys:
    """The metadata keys a shard carries besides its source's."""

    LAYER_START = SHARD_PREFIX + "layer_start"  # uint32
    LAYER_END = SHARD_PREFIX + "layer_end_exclusive"  # uint32
    EMBEDDING = SHARD_PREFIX + "embedding"  # bool: holds the token embedding (first stage)
    OUTPUT = SHARD_PREFIX + "output"  # bool: holds output norm and head (last stage)
    SOURCE = SHARD_PREFIX + "source"  # string: the source's content key
    MODEL_ID = SHARD_PREFIX + "model_id"  # string: the source's model id
    TENSOR_SHA256 = SHARD_PREFIX + "tensor_sha256"  # [string]: hex, in tensor order


@frozen
class SliceParts:
    """What one stage's slice holds: blocks ``[layer_start, layer_end_exclusive)``, the
    token embedding (``embedding``: the first stage), the output norm and head
    (``output``: the last stage); and always the tensors every stage needs."""

    layer_start: int = int_field()
    layer_end_exclusive: int = int_field()
    embedding: bool = bool_field()
    output: bool = bool_field()

    @classmethod
    def of_stage(cls, stage: StagePlan) -> SliceParts:
        """What a planned stage holds."""
        last = stage.stage_index == stage.stage_count - 1
        return cls(stage.layer_start, stage.layer_end_exclusive, stage.stage_index == 0, last)

    @property
    def blocks(self) -> range:
        return range(self.layer_start, self.layer_end_exclusive)

    def label(self) -> str:
        """A short name for files: ``L0-9.embd``, ``L20-29.out``, ``L0-29.embd.out``."""
        text = f"L{self.layer_start}-{self.layer_end_exclusive - 1}"
        return text + (".embd" if self.embedding else "") + (".out" if self.output else "")

    def describe(self) -> str:
        """``blocks 0-9, the token embedding``, for people."""
        what = [f"blocks {self.layer_start}-{self.layer_end_exclusive - 1}"]
        if self.embedding:
            what.append("the token embedding")
        if self.output:
            what.append("the output norm and head")
        return ", ".join(what)


def slice_tensor_names(tensors: Iterable[str], parts: SliceParts) -> tuple[str, ...]:
    """The names, in the order given, of the tensors a stage holding ``parts`` needs of a
    model with ``tensors``: its blocks' tensors, every tensor outside blocks that is not
    the embedding or the output's (every stage needs those), the embedding on the first
    stage, the output norm and head on the last (the embedding when there is no
    ``output.weight``: a tied head)."""
    names = list(tensors)
    tied = OUTPUT_TENSOR not in names
    out = []
    for name in names:
        block = block_index(name)
        if block is not None:
            keep = parts.layer_start <= block < parts.layer_end_exclusive
        elif name == EMBEDDING_TENSOR:
            keep = parts.embedding or (parts.output and tied)
        elif name in (OUTPUT_TENSOR, OUTPUT_NORM_TENSOR):
            keep = parts.output
        else:
            keep = not name.startswith("blk.")
        if keep:
            out.append(name)
    return tuple(out)


# -- the manifest ------------------------------------------------------------------------


@frozen
class ShardEntry:
    """One shard of a manifest: its file (a name in the manifest's folder), the parts it
    holds, and the bytes of its tensors."""

    file: str = str_field()
    parts: SliceParts = typed_field(SliceParts)
    tensor_bytes: int = int_field()


@frozen
class ShardManifest:
    """The shards of one source (``source``: its content key, ``runplan.content``), in
    stage order, and where they came from: the model id, its block count, and the plan
    that cut them (the stages' node ids and placement, for people)."""

    model_id: str = str_field()
    source: str = str_field()
    block_count: int = int_field()
    shards: tuple[ShardEntry, ...] = tuple_field(ShardEntry)
    nodes: tuple[str, ...] = tuple_field(str, default=())
    placement: str = str_field(default="even")


class ManifestError(PicklableError, ValueError):
    """A manifest that cannot be read or does not describe a shard collection; names
    the file. (``gguf_header`` turns it into a ``GgufError``.)"""

    def __init__(self, path: str | os.PathLike[str], message: str) -> None:
        self.path = os.fspath(path)
        super().__init__(f"{self.path}: {message}")


def _converter() -> cattrs.Converter:
    conv = cattrs.Converter(forbid_extra_keys=True)

    def strict(kind: type) -> Any:
        def structure(value: Any, _type: Any) -> Any:
            if type(value) is not kind:
                raise TypeError(f"expected {kind.__name__}, got {type(value).__name__}")
            return value

        return structure

    for kind in (int, str, bool):
        conv.register_structure_hook(kind, strict(kind))
    conv.register_unstructure_hook(
        SliceParts,
        lambda p: {
            "layer_start": p.layer_start,
            "layer_end_exclusive": p.layer_end_exclusive,
            "embedding": p.embedding,
            "output": p.output,
        },
    )
    return conv


_CONVERTER = _converter()


def manifest_path(path: str | os.PathLike[str]) -> str | None:
    """The manifest ``path`` names (a folder holding ``manifest.json``, or a ``.json``
    file), or ``None`` when it names something else (a GGUF file). A folder whose
    ``manifest.json`` cannot be looked at (a folder this user may not read: mode 000)
    names it too, so that reading it says why (it was "is a directory, not a GGUF
    file")."""
    p = os.fspath(path)
    if os.path.isdir(p):
        candidate = os.path.join(p, MANIFEST_NAME)
        try:
            os.stat(candidate)
        except (FileNotFoundError, NotADirectoryError):
            return None
        except OSError:  # EACCES: ``read_manifest`` says "cannot be read: ..."
            return candidate
        return candidate if os.path.isfile(candidate) else None
    return p if p.endswith(".json") else None


def manifest_json(manifest: ShardManifest) -> str:
    doc = {
        "format": MANIFEST_FORMAT,
        "version": MANIFEST_VERSION,
        **_CONVERTER.unstructure(manifest),
    }
    return json.dumps(doc, indent=2, sort_keys=True) + "\n"


def read_manifest(path: str | os.PathLike[str]) -> ShardManifest:
    """The manifest at ``path``; ``ManifestError`` naming the file and what is wrong:
    not JSON, another format or version, a key missing or of another type, a shard file
    that is not a plain name in the manifest's folder, blocks outside the model, two
    shards of one file."""
    p = os.fspath(path)
    try:
        with open(p, "rb") as f:
            data = f.read(MAX_MANIFEST_BYTES + 1)
    except OSError as exc:
        raise ManifestError(p, f"cannot be read: {exc.strerror}") from None
    if len(data) > MAX_MANIFEST_BYTES:
        raise ManifestError(p, f"more than {MAX_MANIFEST_BYTES} bytes: not a shard manifest")
    try:
        doc = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:  # nested too deep
        raise ManifestError(p, f"not a JSON shard manifest ({exc})") from None
    if not isinstance(doc, dict) or doc.get("format") != MANIFEST_FORMAT:
        raise ManifestError(p, f'not a shard manifest (no "format": "{MANIFEST_FORMAT}")')
    if doc.get("version") != MANIFEST_VERSION:
        raise ManifestError(
            p, f"shard manifest version {doc.get('version')!r}; this reader reads version 1"
        )
    body = {k: v for k, v in doc.items() if k not in ("format", "version")}
    try:
        manifest = _CONVERTER.structure(body, ShardManifest)
    except Exception as exc:  # cattrs, attrs validators
        raise ManifestError(p, f"malformed shard manifest: {_describe(exc)}") from None
    _check_manifest(p, manifest)
    return manifest


#: The longest model id in bytes: with a shard's or a slice's suffix, a file name's 255.
MODEL_ID_MAX_BYTES = 200


def model_id_problem(model_id: str) -> str | None:
    """Why ``model_id`` cannot begin a file's name (shards and the slices a host
    receives are named after it), or ``None``: a ``/`` would put the file in another
    folder (a manifest's ``../x`` wrote shards outside ``--out``)."""
    if not model_id:
        return "it is empty"
    problem = _characters_problem(model_id)
    if problem is not None:
        return problem
    if len(model_id.encode("utf-8", "surrogatepass")) > MODEL_ID_MAX_BYTES:
        return f"it is longer than {MODEL_ID_MAX_BYTES} bytes"
    return None


def _characters_problem(name: str) -> str | None:
    """Whether ``name`` holds a character no file name here may: a folder's separator
    (``/``, ``\\``) or a control character (a terminal escape, printed with the name)."""
    bad = sorted({c for c in name if c in "/\\" or ord(c) < 32 or ord(c) == 127})
    if bad:
        return f"it holds {', '.join(repr(c) for c in bad)}, which a file name cannot"
    return None


def _check_manifest(path: str, manifest: ShardManifest) -> None:
    if not manifest.shards:
        raise ManifestError(path, "names no shard")
    problem = model_id_problem(manifest.model_id)
    if problem is not None:
        raise ManifestError(path, f"model_id {manifest.model_id!r} cannot name a file: {problem}")
    seen: set[str] = set()
    for entry in manifest.shards:
        name = entry.file
        if not name or Path(name).name != name or name in (".", ".."):
            raise ManifestError(path, f"shard file {name!r} is not a file name in its folder")
        problem = _characters_problem(name)
        if problem is not None:
            raise ManifestError(path, f"shard file {name!r} cannot name a file: {problem}")
        if name in seen:
            raise ManifestError(path, f"shard file {name!r} is named twice")
        seen.add(name)
        parts = entry.parts
        if not 0 <= parts.layer_start < parts.layer_end_exclusive <= manifest.block_count:
            raise ManifestError(
                path,
                f"shard {name!r} holds blocks [{parts.layer_start}, "
                f"{parts.layer_end_exclusive}), not a range of the model's "
                f"{manifest.block_count} blocks",
            )


def shards_for(manifest: ShardManifest, parts: SliceParts | None) -> tuple[ShardEntry, ...]:
    """The shards a stage holding ``parts`` reads (``None``: every shard): those holding
    any of its blocks, the embedding's on the first stage, the output's on the last."""
    if parts is None:
        return manifest.shards
    out = []
    for entry in manifest.shards:
        held = entry.parts
        overlaps = held.layer_start < parts.layer_end_exclusive and (
            parts.layer_start < held.layer_end_exclusive
        )
        if overlaps or (parts.embedding and held.embedding) or (parts.output and held.output):
            out.append(entry)
    return tuple(out)


def shard_keys_of(fields: Mapping[str, Any]) -> bool:
    """Whether metadata (keys to anything) is a shard's."""
    return any(key.startswith(SHARD_PREFIX) for key in fields)


def _describe(exc: BaseException) -> str:
    if isinstance(exc, BaseExceptionGroup):
        return "; ".join(_describe(e) for e in exc.exceptions)
    return f"{type(exc).__name__}: {exc}"
