"""The files of a GGUF source: the shards of a llama.cpp split set (a file whose
``split.count`` is more than 1), named by any of their file names (``split_paths``,
``model_id_for``); each file opened as a GGUF file
(``_open``: a regular file, little-endian, a header that parses); and each shard
checked to be the one its split set (``_check_shard``) or its manifest
(``_check_shard_of``) names."""

from __future__ import annotations

import errno
import os
import re
import struct
from pathlib import Path
from typing import TYPE_CHECKING

from runplan.gguf_error import GgufError, GgufUnmapped
from runplan.gguf_reader import BadKey, HeaderReader, NotUtf8Name
from runplan.key_types import SPLIT_KEYS
from runplan.resource_limits import with_limit
from runplan.shards import CUT_KEY_PREFIXES, ShardEntry, ShardKeys, ShardManifest

if TYPE_CHECKING:
    from runplan.gguf_header import GgufHeader

_SPLIT_RE = re.compile(r"^(?P<prefix>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")


def split_paths(path: str | os.PathLike[str], count: int) -> tuple[str, ...]:
    """The files of the source ``path`` belongs to, whose ``split.count`` is ``count``
    (as llama.cpp, a split set is one whose file says it has more than one shard):
    itself, or every shard of its llama.cpp split set, named by llama.cpp's pattern
    (``name-00002-of-00003.gguf`` names the set too)."""
    p = os.fspath(path)
    if count <= 1:
        return (p,)
    m = _SPLIT_RE.match(p)
    if m is None:
        raise GgufError(
            p,
            f"is {count}: the file is a shard of a split set of {count} files, but its name "
            f"does not end in -NNNNN-of-{count:05d}.gguf as llama.cpp names a split set's "
            "files (name them so, and give any of them)",
            "split.count",
        )
    if int(m["count"]) != count:
        raise GgufError(p, f"is {count}; the file name says {int(m['count'])}", "split.count")
    if not 1 <= int(m["no"]) <= count:
        raise GgufError(p, f"split file name says shard {m['no']} of {m['count']}")
    return tuple(f"{m['prefix']}-{i:05d}-of-{count:05d}.gguf" for i in range(1, count + 1))


def model_id_for(path: str | os.PathLike[str]) -> str:
    """The file name without ``.gguf`` and without a split suffix."""
    name = Path(os.fspath(path)).name
    m = _SPLIT_RE.match(name)
    if m is not None:
        return m["prefix"]
    return name.removesuffix(".gguf")


def _open(path: str) -> HeaderReader:
    if not os.path.exists(path):
        raise GgufError(path, "no such file")
    if os.path.isdir(path):
        raise GgufError(path, "is a directory, not a GGUF file")
    if not os.path.isfile(path):  # a FIFO or a device: reading it may wait for ever
        raise GgufError(path, "is not a regular file (a FIFO, a socket or a device)")
    try:
        with open(path, "rb") as f:
            start = f.read(8)
    except OSError as exc:
        raise GgufError(path, f"cannot be read: {exc.strerror}") from exc
    magic, version = start[:4], start[4:]
    if magic != b"GGUF":
        raise GgufError(path, f"not a GGUF file (magic {magic!r}, expected b'GGUF')")
    # llama.cpp's test (gguf.cpp): a version whose low 16 bits are 0 is one written
    # big-endian. The header would read, but the tensor data is byte-swapped for every
    # worker (the kernels and the gguf package's dequantization read little-endian).
    if len(version) == 4 and version[:2] == b"\0\0" and version != b"\0\0\0\0":
        raise GgufError(
            path,
            f"a big-endian GGUF file (version {int.from_bytes(version, 'big')} written "
            "big-endian): only little-endian GGUF files are read, as llama.cpp reads them",
        )
    try:
        return HeaderReader(path)
    except NotUtf8Name as exc:
        raise GgufError(path, str(exc)) from None
    except BadKey as exc:
        raise GgufError(path, str(exc), exc.key) from None
    except (
        ValueError,
        IndexError,
        KeyError,
        OverflowError,
        struct.error,
        UnicodeDecodeError,
    ) as exc:
        raise GgufError(path, f"malformed or truncated header: {exc}") from exc
    except OSError as exc:
        if exc.errno == errno.ENOMEM:  # the host's memory or this process's limit
            why = with_limit(f"cannot be mapped: {exc.strerror}", exc.errno)
            raise GgufUnmapped(path, why) from exc
        raise GgufError(path, f"cannot be mapped: {exc.strerror}") from exc


def _check_shard(shard: GgufHeader, path: str, index: int, count: int) -> None:
    for key, want in (("split.no", index), ("split.count", count)):
        if not shard.has(key):
            raise GgufError(path, "a shard of a split set lacks its split key", key)
        shard.check_type(key, SPLIT_KEYS[key])  # llama.cpp's: of every shard
        got = shard.integer(key)
        if got != want:
            raise GgufError(path, f"is {got}, expected {want} for this shard", key)


def _check_shard_of(
    shard: GgufHeader, path: str, entry: ShardEntry, manifest: ShardManifest
) -> None:
    """``GgufError`` unless the shard's own keys say what its manifest says of it."""
    parts = entry.parts
    for key, want in (
        (ShardKeys.LAYER_START, parts.layer_start),
        (ShardKeys.LAYER_END, parts.layer_end_exclusive),
    ):
        if not shard.has(key):
            raise GgufError(path, "a shard named by a manifest lacks its shard key", key)
        got = shard.integer(key)
        if got != want:
            raise GgufError(path, f"is {got}; its manifest says {want}", key)
    for key, flag in ((ShardKeys.EMBEDDING, parts.embedding), (ShardKeys.OUTPUT, parts.output)):
        if shard.boolean(key, False) != flag:
            raise GgufError(path, f"is {not flag}; its manifest says {flag}", key)
    source = shard.string(ShardKeys.SOURCE, "")
    if source != manifest.source:
        raise GgufError(
            path, f"is a shard of {source or 'no source'}, its manifest's is {manifest.source}",
            ShardKeys.SOURCE,
        )  # fmt: skip
    arch = shard.string("general.architecture")
    blocks = shard.integer(f"{arch}.block_count")
    if blocks != manifest.block_count:
        raise GgufError(
            path, f"is {blocks}; its manifest says {manifest.block_count}", f"{arch}.block_count"
        )


def metadata_difference(
    first: GgufHeader, first_path: str, shard: GgufHeader, path: str
) -> tuple[str, str] | None:
    """The first key whose pair (key, type and value bytes) ``shard`` at ``path`` stores
    otherwise than ``first`` at ``first_path``, or holds where the other does not,
    outside the shard keys (``split.*``, ``gguf_pipeline.*``), and what differs; or
    ``None``. The shards of one source hold its metadata as stored: each stage takes its
    hyperparameters from its own first shard."""
    model_keys = {k for k in first.keys() if not k.startswith(CUT_KEY_PREFIXES)}  # noqa: SIM118
    keys = {k for k in shard.keys() if not k.startswith(CUT_KEY_PREFIXES)}  # noqa: SIM118
    for key in sorted(keys ^ model_keys):
        return key, f"{key} is in {path if key in keys else first_path} only, of its shards"
    for key in sorted(keys):
        if shard.field_bytes(key) != first.field_bytes(key):
            return key, (
                f"{key} is stored otherwise in {path} than in {first_path}: a shard's "
                "metadata changed after it was split"
            )
    return None
