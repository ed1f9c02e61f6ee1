"""What a GGUF source holds, as hashes: a SHA-256 per tensor (of its stored bytes) and
the source's content key, one SHA-256 over its metadata and every tensor's name, type,
shape and hash.

The content key names a model by what it is, not where it lies: the same file at two
paths, a copy on another host, and the shards ``python -m runplan split`` cut from it
have one key (the keys that say how a model is cut, ``split.*`` and
``gguf_pipeline.*``, are left out; each other key-value pair is hashed exactly as the
file stores it, in key order). Slice caches are keyed by it, and a shard records the
key of the source it was cut from.

Hashing reads every tensor's bytes through the memory map; tensors are hashed on
several threads at once (``hashlib`` lets go of the interpreter lock while it hashes).
This is the one place besides ``runplan.split`` where ``runplan`` reads tensor data.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor

from attrs import frozen

from runplan.cpus import usable_cpus
from runplan.gguf_header import GgufHeader
from runplan.shards import CUT_KEY_PREFIXES

KEY_PREFIX = "sha256:"
_LABEL = b"gguf-pipeline/source-content/1\x00"

#: ``progress(done_bytes, total_bytes)`` while tensors are hashed (any thread).
HashProgress = Callable[[int, int], None]


@frozen
class SourceContent:
    """A source's content key and each tensor's SHA-256 (hex), by name."""

    key: str
    tensor_sha256: Mapping[str, str]


def hash_threads() -> int:
    """Threads to hash with: the CPUs this process may use (``usable_cpus``), at most 8."""
    return min(8, usable_cpus())


def tensor_sha256(
    header: GgufHeader,
    names: Iterable[str] | None = None,
    *,
    progress: HashProgress | None = None,
) -> dict[str, str]:
    """The SHA-256 (hex) of each of ``names`` (default: every tensor), read through the
    memory map on ``hash_threads()`` threads."""
    chosen = list(header.tensors if names is None else names)
    total = sum(header.tensors[n].n_bytes for n in chosen)
    done = 0

    def one(name: str) -> str:
        return hashlib.sha256(header.tensor_bytes(name).data).hexdigest()

    out: dict[str, str] = {}
    with ThreadPoolExecutor(hash_threads(), thread_name_prefix="sha256") as pool:
        for name, digest in zip(chosen, pool.map(one, chosen), strict=True):
            out[name] = digest
            done += header.tensors[name].n_bytes
            if progress is not None:
                progress(done, total)
    return out


def content_key(header: GgufHeader, tensor_hashes: Mapping[str, str]) -> str:
    """The content key of the source of ``header`` whose tensors hash to
    ``tensor_hashes`` (every tensor's, by name): ``sha256:<64 hex digits>``."""
    h = hashlib.sha256(_LABEL)
    for key in sorted(header.keys()):
        if not key.startswith(CUT_KEY_PREFIXES):
            raw = header.field_bytes(key)
            h.update(len(raw).to_bytes(8, "little") + raw)
    h.update(b"\x00tensors\x00")
    for name in sorted(header.tensors):
        info = header.tensors[name]
        h.update(f"{name}\x00{info.ggml_type}\x00{list(info.shape)}\x00".encode())
        h.update(bytes.fromhex(tensor_hashes[name]))
    return KEY_PREFIX + h.hexdigest()


def source_content(header: GgufHeader, *, progress: HashProgress | None = None) -> SourceContent:
    """Hash every tensor of ``header``'s source and key it."""
    hashes = tensor_sha256(header, progress=progress)
    return SourceContent(content_key(header, hashes), hashes)
