"""Whether a slice file holds what it says: the slice header a stage received, and a
cache entry before a stage binds it.

A cache entry is made only once complete and verified (``fetch``), but what lies on a
disk can change after: a crash of the host or of its file system, a disk that went bad,
a hand that truncated or edited the file. An entry is therefore checked before it is
used: its header is the slice's (its blocks, embedding and head, its source's content
key, a SHA-256 per tensor) and every tensor's bytes hash to the header's SHA-256. The
verdict is remembered by the shard file's identity (path, device, inode, size,
modification time: ``digests``), as the fetch that made the entry remembers it, so an
entry is hashed again only when its file changed; an entry that fails is not used.

An entry that cannot be read *now* (no descriptor left, no memory, no permission) says
nothing of its file: that is ``EntryUnreadable``, never a verdict, so that a sound
entry is not taken for damage and removed.
"""

from __future__ import annotations

import contextlib
import errno

from runplan.content import tensor_sha256
from runplan.gguf_error import GgufError
from runplan.gguf_header import GgufHeader
from runplan.resource_limits import EXHAUSTED
from runplan.shards import ShardKeys, SliceParts, model_id_problem, slice_tensor_names
from runtime_cupy.slices.cache import CacheEntry, CacheError
from runtime_cupy.slices.digests import DigestStore, hashes_match


def header_problem(header: GgufHeader, parts: SliceParts, source_key: str) -> str | None:
    """``None`` when ``header`` is a slice header of ``parts`` of the source
    ``source_key`` with a SHA-256 for each of its tensors; else what is wrong."""
    checks = (
        (ShardKeys.LAYER_START, header.integer(ShardKeys.LAYER_START), parts.layer_start),
        (ShardKeys.LAYER_END, header.integer(ShardKeys.LAYER_END), parts.layer_end_exclusive),
        (ShardKeys.EMBEDDING, header.boolean(ShardKeys.EMBEDDING, False), parts.embedding),
        (ShardKeys.OUTPUT, header.boolean(ShardKeys.OUTPUT, False), parts.output),
        (ShardKeys.SOURCE, header.string(ShardKeys.SOURCE, ""), source_key),
    )
    for key, got, want in checks:
        if got != want:
            return f"{key} is {got!r}, this stage asked for {want!r}"
    model_id = header.string(ShardKeys.MODEL_ID, "model")
    problem = model_id_problem(model_id)
    if problem is not None:  # the entry's file is named after it
        return f"{ShardKeys.MODEL_ID} {model_id!r} cannot name a file: {problem}"
    names = tuple(header.tensors)
    if slice_tensor_names(names, parts) != names:
        return "it names tensors that are not this stage's"
    if header.array_length(ShardKeys.TENSOR_SHA256) != len(names):
        return "it does not hold a SHA-256 for every tensor"
    return None


#: Errors of a read that say nothing of the file read: the process or host ran out of
#: something, or may not read it now.
NOT_NOW = EXHAUSTED | {errno.EAGAIN, errno.EINTR, errno.EACCES, errno.EPERM}


class EntryUnreadable(CacheError):
    """A cache entry that cannot be read now: whether it is whole is not known, so it
    is kept (the stage's fetch fails, naming why)."""


def _not_now(exc: BaseException) -> OSError | None:
    """The error in ``exc``'s chain (its causes) that says the read failed for now."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno in NOT_NOW:
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


def _mark(entry: CacheEntry) -> str:
    return f"entry|{entry.source}|{entry.parts.label()}"


def entry_problem(entry: CacheEntry, digests: DigestStore, *, hash_now: bool = True) -> str | None:
    """``None`` when ``entry`` holds its slice whole (found so before, or hashed now);
    else what is wrong with it. ``hash_now=False``: only what is known without hashing
    (an entry not yet found sound is then ``"not verified yet"``). ``EntryUnreadable``
    when it cannot be read now (``NOT_NOW``)."""
    try:
        header = GgufHeader.read(entry.shard)
        if digests.verified(header, _mark(entry)):
            return None
        if not hash_now:
            return "not verified yet"
        problem = header_problem(header, entry.parts, entry.source)
        if problem is not None:
            return f"its header: {problem}"
        expected = dict(zip(header.tensors, header.strings(ShardKeys.TENSOR_SHA256), strict=True))
        bad = hashes_match(tensor_sha256(header), expected)
    except (GgufError, ValueError, OSError) as exc:
        now = _not_now(exc)
        if now is not None:
            raise EntryUnreadable(
                f"cannot read the cache entry {entry.path} now: {now.strerror or now}"
            ) from exc
        if isinstance(exc, OSError):
            return f"{entry.shard}: {exc.strerror or exc}"
        return str(exc)
    if bad is not None:
        return f"tensor {bad}: its bytes do not hash to the SHA-256 its header holds"
    digests.mark_verified(header, _mark(entry))
    return None


def remember_sound(entry: CacheEntry, digests: DigestStore) -> None:
    """Remember that ``entry`` (just made from verified tensors) holds its slice."""
    with contextlib.suppress(GgufError, OSError):  # else it is hashed at its first use
        digests.mark_verified(GgufHeader.read(entry.shard), _mark(entry))
