"""A stage's side of slice transfer: where its slice of the plan's source comes from,
on a host that may not have the model (``SliceFetcher.resolve``).

In order:

1. **The cache** (``cache.SliceCache``): a complete entry of this source's content key
   and these parts, found whole (``verify``: every tensor's SHA-256, remembered by the
   file's identity; an entry that is not is removed and the slice received again).
   Nothing travels; no connection is made.
2. **A file at the plan's path** that this host already found to hold the slice
   (``digests``): used as it is. Nothing travels either.
3. Else, holding the source's lock (a second stage of this host waits, then finds what
   the first brought), it connects to the orchestrator's slice server and receives the
   slice's header. A file at the plan's path whose metadata (as stored) and slice
   tensors' SHA-256 match is used as it is (and remembered). Otherwise the stage asks
   for the tensors that no complete entry of the same source on this host already holds
   (those it copies), receives them into a new entry in the cache's ``tmp/``, checks
   every tensor's SHA-256 against the header's (the sender computed them from its file),
   and renames the entry into place: only a complete, verified entry is ever used.

Received bytes go straight from the socket into the entry's memory-mapped file
(encrypted, each chunk is decrypted where it landed; space for each tensor reserved
first, so a full disk is an error naming that tensor, not a fault in the middle of a
copy); tensors are hashed on other threads while the next ones arrive. Any failure
(the connection broke off, a hash differs, a chunk fails its seal, the disk is full,
the server sends the slice with another protection than the stage asked for) is a
``SliceTransferFailed`` naming this host, the tensor and the cause, which the stage
reports as its setup fault; what was written is removed.

Each fetch appends one line to ``<cache>/transfers.jsonl`` (``transfer_log``, kept
small): what came from where, how many bytes this host read from the socket, and
whether it asked for them encrypted.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import logging
import mmap
import os
import shutil
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from attrs import frozen

from runplan import GgufSource
from runplan.content import hash_threads
from runplan.gguf_error import GgufError
from runplan.gguf_files import metadata_difference
from runplan.gguf_header import GgufHeader
from runplan.picklable_error import PicklableError
from runplan.shards import (
    MANIFEST_NAME,
    ShardEntry,
    ShardKeys,
    ShardManifest,
    SliceParts,
    manifest_json,
    slice_tensor_names,
)
from runtime_core.threads import ThreadUnavailable, is_thread_refused, thread_refused
from runtime_core.workers.interface import WorkerError
from runtime_cupy.edges.tcp_seal import protection_for
from runtime_cupy.slices import transfer_log
from runtime_cupy.slices.cache import CacheEntry, CacheError, SliceCache
from runtime_cupy.slices.digests import DigestStore, hashes_match
from runtime_cupy.slices.protocol import (
    HEADER_WAIT_S,
    STALL_S,
    Link,
    TransferError,
    open_as_stage,
)
from runtime_cupy.slices.stage_frames import SliceRequest
from runtime_cupy.slices.verify import entry_problem, header_problem, remember_sound

log = logging.getLogger("runtime_cupy.slices")

#: The most bytes a slice's header may take: its metadata (a vocabulary of 256k tokens
#: with their merges is some 10 MiB) and tensor infos.
MAX_HEADER_BYTES = 1 << 30
#: Bytes received between looks at the hashes of tensors already in.
CHUNK = 8 << 20


class SliceTransferFailed(WorkerError):
    """A stage's slice could not be brought to its host: names the host, the tensor (or
    the header, or the connection) and the cause."""


@frozen
class SliceOrigin:
    """Where a stage on another host gets its slice: the slice server's ``host:port``
    and the content key of the plan's source (``runplan.content``)."""

    address: str
    source_key: str


class _Failed(PicklableError, Exception):
    """Internal: what failed (``where``: a tensor, the header ...) and why."""

    def __init__(self, where: str, cause: str) -> None:
        self.where, self.cause = where, cause
        super().__init__(f"{where}: {cause}")


class SliceFetcher:
    """Resolves stage ``stage_index``'s source (its slice key ``key``) from ``origin``
    into ``cache`` (default: this host's); ``encrypt``: the slice travels encrypted (the
    stage's ``--encrypt-edges``; the server must send it so, or the fetch is refused)."""

    def __init__(
        self,
        origin: SliceOrigin,
        stage_index: int,
        key: bytes,
        cache: SliceCache | None = None,
        *,
        encrypt: bool = False,
        header_wait_s: float = HEADER_WAIT_S,
        stall_s: float = STALL_S,
    ) -> None:
        self.origin = origin
        self.stage_index = stage_index
        self.key = key
        self.encrypt = encrypt
        # how long the stage waits for the server's first frame, then for each next byte
        self.header_wait_s, self.stall_s = header_wait_s, stall_s
        self.cache = cache or SliceCache()
        self.last: dict[str, Any] = {}  # what the last resolve did (its transfers.jsonl line)

    @property
    def digests(self) -> DigestStore:
        """This host's digest records (in the cache: ``CacheError`` if it is not private)."""
        return DigestStore(self.cache.digests)

    # -- the three ways ------------------------------------------------------------------
    def resolve(self, source: GgufSource, parts: SliceParts) -> GgufSource:
        """The source the stage binds: a cache entry, or the file at the plan's path."""
        began = time.monotonic()
        source_key = self.origin.source_key
        mark = f"{source_key}|{parts.label()}"
        try:
            entry = self.cache.entry(source_key, parts)
            if entry is not None and entry_problem(entry, self.digests, hash_now=False) is None:
                return self._use(entry, "cache", began)
            local = self._local(source, parts)
            if local is not None and self.digests.verified(local, mark):
                self._record("local", parts, began, path=source.paths[0])
                return source
            with self.cache.lock(source_key):
                entry = self._sound(self.cache.entry(source_key, parts))  # another stage's?
                if entry is not None:
                    return self._use(entry, "cache", began)
                return self._fetch(source, parts, local, mark, began)
        except CacheError as exc:
            raise self._failure(parts, "the cache", str(exc), began) from exc
        except RuntimeError as exc:  # no thread left to hash an entry with
            why = _no_thread(exc)
            if why is None:
                raise
            raise self._failure(parts, "the cache", why, began) from exc

    def _sound(self, entry: CacheEntry | None) -> CacheEntry | None:
        """``entry`` if it holds its slice whole (``verify``), else ``None``: an entry
        that does not is removed (call with the source's lock held); one that cannot be
        read now is kept (``verify.EntryUnreadable``, a ``CacheError``)."""
        if entry is None:
            return None
        problem = entry_problem(entry, self.digests)
        if problem is None:
            return entry
        log.warning("the cache entry %s is damaged (%s): removing it", entry.path, problem)
        self.cache.remove(entry)
        return None

    def _use(self, entry: CacheEntry, how: str, began: float) -> GgufSource:
        self.cache.touch(entry)
        self._record(how, entry.parts, began, path=str(entry.path))
        log.info("slice %s from the cache: %s", entry.parts.label(), entry.path)
        return GgufSource((str(entry.path),))

    def _local(self, source: GgufSource, parts: SliceParts) -> GgufHeader | None:
        """What this host has at the plan's path (of a shard manifest, the shards these
        parts need), or ``None``."""
        if not source.paths or not all(os.path.exists(p) for p in source.paths):
            return None
        try:
            return GgufHeader.read(source.paths[0], parts)
        except GgufError as exc:
            log.warning("the file at the plan's path cannot be read (%s): receiving", exc)
            return None

    # -- a transfer ----------------------------------------------------------------------
    def _fetch(
        self,
        source: GgufSource,
        parts: SliceParts,
        local: GgufHeader | None,
        mark: str,
        began: float,
    ) -> GgufSource:
        source_key = self.origin.source_key
        self.cache.remove_stale(source_key)
        link: Link | None = None
        partial: Path | None = None
        where = "the file at the plan's path"
        try:
            self._hash_ahead(source_key, parts, local)
            where = "the connection"
            link = open_as_stage(
                self.origin.address,
                self.stage_index,
                self.key,
                protection=protection_for(self.encrypt),
                header_wait_s=self.header_wait_s,
            )
            link.send(SliceRequest(tuple(source.paths), source_key, parts).frame())
            where = "the header"
            info = link.receive()
            link.bound_silence(self.stall_s)  # the bytes flow now: a stall ends the fetch
            partial = self.cache.new_partial(source_key, parts)
            sent = self._receive_header(link, info, partial, parts)
            names = tuple(sent.tensors)
            expected = dict(zip(names, sent.strings(ShardKeys.TENSOR_SHA256), strict=True))
            if local is not None and self._local_matches(local, sent, expected):
                self.digests.mark_verified(local, mark)
                link.send({"tensors": []})
                link.send({"ok": True, "bytes": link.received, "local": True})
                self._record("local", parts, began, path=source.paths[0], link=link)
                return source
            where = "the cache"
            donors = dict(self._donors(source_key, parts, names, expected))
            wanted = [n for n in names if n not in donors]
            self.cache.make_room(int(info["file_bytes"]), tuple(e for _, e in donors.values()))
            self._check_room(partial, sent)
            where = "the tensors"
            link.send({"tensors": wanted})
            timing = self._receive_tensors(link, sent, partial, expected, donors)
            where = "the entry"
            self._finish(partial, sent, parts)
            entry_path = self.cache.commit(partial, source_key, parts)
            partial = None
            made = self.cache.entry(source_key, parts)
            if made is not None:
                remember_sound(made, self.digests)
            # The entries it copied from were kept while it came in: now they go, least
            # recently used first, where the cache is over its limit with the new entry.
            self.cache.make_room(0, (made,) if made is not None else ())
            link.send({"ok": True, "bytes": link.received})
            self._record(
                "received",
                parts,
                began,
                path=str(entry_path),
                link=link,
                header_bytes=int(info["header_bytes"]),
                tensor_bytes_copied=sum(sent.tensors[n].n_bytes for n in donors),
                **timing,
            )
            return GgufSource((str(entry_path),))
        except _Failed as exc:
            raise self._failure(parts, exc.where, exc.cause, began, link) from exc
        except (TransferError, OSError, GgufError, ValueError, KeyError) as exc:
            raise self._failure(parts, where, _cause(exc, self.cache.root), began, link) from exc
        except RuntimeError as exc:  # no thread left to hash with
            why = _no_thread(exc)
            if why is None:
                raise
            raise self._failure(parts, where, why, began, link) from exc
        finally:
            if link is not None:  # first: its descriptor may be the one the removal needs
                link.close()
            if partial is not None:
                _remove_partial(partial)

    def _check_room(self, partial: Path, sent: GgufHeader) -> None:
        """The slice's tensors fit the free space of the cache's disk, before a byte of
        them travels (a full disk was found a tensor in, the bytes before it sent for
        nothing); ``_Failed`` naming the folder, the bytes needed and those free. (Room
        found here can still be taken by another writer: a full disk later is named as
        it comes.)"""
        need = sum(info.n_bytes for info in sent.tensors.values())
        disk = os.statvfs(partial)
        free = disk.f_bavail * disk.f_frsize
        if need > free:
            raise _Failed(
                "the cache",
                f"the slice's tensors need {need} bytes on the disk of the cache "
                f"{self.cache.root}, {free} are free",
            )

    def _hash_ahead(self, source_key: str, parts: SliceParts, local: GgufHeader | None) -> None:
        """Hash, before the server is asked, what the answer to its header needs: the
        slice's tensors in the file at the plan's path and the other entries of the
        source that may lend tensors (their verdicts are then remembered). The server
        waits ``server.FRAME_WAIT_S`` for that answer; a big slice on a slow disk took
        longer, and the server's error was then read as tensor bytes."""
        if local is not None:
            self.digests.tensor_hashes(local, slice_tensor_names(local.tensors, parts))
        for entry in self.cache.entries(source_key):
            if entry.parts != parts:
                self._sound(entry)

    def _receive_header(
        self, link: Link, info: dict[str, Any], partial: Path, parts: SliceParts
    ) -> GgufHeader:
        size, file_bytes = int(info["header_bytes"]), int(info["file_bytes"])
        if not 0 < size <= min(file_bytes, MAX_HEADER_BYTES):
            raise _Failed(
                "the header",
                f"the sender announced {size} bytes of it, of a file of {file_bytes} (at most "
                f"{MAX_HEADER_BYTES} are taken)",
            )  # (memory for it is taken before a byte arrives)
        data = link.recv_bytes(size)
        if hashlib.sha256(data).hexdigest() != info["header_sha256"]:
            raise _Failed("the header", "its SHA-256 is not the one the sender announced")
        path = partial / "slice.gguf"
        with open(path, "wb") as f:
            f.write(data)
            f.truncate(file_bytes)
        sent = GgufHeader.read(path)
        problem = header_problem(sent, parts, self.origin.source_key)
        if problem is not None:
            raise _Failed("the header", problem)
        return sent

    def _local_matches(self, local: GgufHeader, sent: GgufHeader, expected: dict[str, str]) -> bool:
        path = local.source_paths[0]
        difference = metadata_difference(local, path, sent, "the slice's header")
        differs = None if difference is None else difference[0]
        if differs is None:
            missing = [n for n in expected if n not in local.tensors]
            if missing:
                differs = f"tensor {missing[0]} (missing)"
            else:
                bad = hashes_match(self.digests.tensor_hashes(local, expected), expected)
                differs = None if bad is None else f"tensor {bad}"
        else:
            differs = f"key {differs}"
        if differs is None:
            log.info("the file at %s holds this slice of the plan's source: using it", path)
            return True
        log.warning("the file at %s differs from the plan's source (%s): receiving", path, differs)
        return False

    def _donors(
        self, source_key: str, parts: SliceParts, names: tuple[str, ...], expected: dict[str, str]
    ) -> Iterator[tuple[str, tuple[GgufHeader, CacheEntry]]]:
        """Tensors of this slice that another complete entry of the source holds (the
        most recently used first: the least likely to be evicted to make room)."""
        found: set[str] = set()
        for entry in reversed(self.cache.entries(source_key)):
            if entry.parts == parts or self._sound(entry) is None:
                continue
            try:
                header = GgufHeader.read(entry.shard)
                hashes = dict(
                    zip(header.tensors, header.strings(ShardKeys.TENSOR_SHA256), strict=True)
                )
            except (GgufError, ValueError):
                continue
            for name in names:
                if name not in found and hashes.get(name) == expected[name]:
                    found.add(name)
                    yield name, (header, entry)

    def _receive_tensors(
        self,
        link: Link,
        sent: GgufHeader,
        partial: Path,
        expected: dict[str, str],
        donors: dict[str, tuple[GgufHeader, CacheEntry]],
    ) -> dict[str, Any]:
        """Every tensor into the entry's file, each hashed; the bytes received and where
        the time went (receiving, then waiting for the last hashes, then the disk)."""
        path = partial / "slice.gguf"
        fd = os.open(path, os.O_RDWR)
        received = 0
        began = time.monotonic()
        try:
            size = os.fstat(fd).st_size
            mapped = mmap.mmap(fd, size)
            hashes: list[tuple[str, Future[str]]] = []
            with ThreadPoolExecutor(hash_threads(), thread_name_prefix="sha256") as pool:
                try:
                    for name, info in sent.tensors.items():
                        _check_hashes(hashes, expected, done_only=True)
                        try:
                            os.posix_fallocate(fd, info.offset, info.n_bytes)
                        except OSError as exc:
                            raise _Failed(f"tensor {name}", _cause(exc, self.cache.root)) from exc
                        with (
                            memoryview(mapped) as whole,
                            whole[info.offset : info.offset + info.n_bytes] as view,
                        ):
                            donor = donors.get(name)
                            if donor is not None:
                                view[:] = donor[0].tensor_bytes(name).data
                            else:
                                for start in range(0, len(view), CHUNK):
                                    try:
                                        with view[start : start + CHUNK] as piece:
                                            received += link.recv_bytes_into(piece)
                                    except TransferError as exc:
                                        raise _Failed(
                                            f"tensor {name}",
                                            f"{exc} (at byte {start} of its {info.n_bytes})",
                                        ) from exc
                        hashes.append(
                            (name, pool.submit(_sha256, mapped, info.offset, info.n_bytes))
                        )
                    received_at = time.monotonic()
                    _check_hashes(hashes, expected, done_only=False)
                    hashed_at = time.monotonic()
                finally:
                    for _, future in hashes:
                        future.cancel()
            mapped.flush()
            mapped.close()
            os.fsync(fd)
        finally:
            os.close(fd)
        return {
            "tensor_bytes_received": received,
            "receive_s": round(received_at - began, 6),
            "hash_wait_s": round(hashed_at - received_at, 6),
            "sync_s": round(time.monotonic() - hashed_at, 6),
        }

    def _finish(self, partial: Path, sent: GgufHeader, parts: SliceParts) -> None:
        """Name the entry's file and write its manifest (the entry is whole after)."""
        model_id = sent.string(ShardKeys.MODEL_ID, "model")
        arch = sent.string("general.architecture")
        name = f"{model_id}.{parts.label()}.gguf"
        os.rename(partial / "slice.gguf", partial / name)
        tensor_bytes = sum(i.n_bytes for i in sent.tensors.values())
        manifest = ShardManifest(
            model_id=model_id,
            source=self.origin.source_key,
            block_count=sent.integer(f"{arch}.block_count"),
            shards=(ShardEntry(name, parts, tensor_bytes),),
        )
        with open(partial / MANIFEST_NAME, "w") as f:
            f.write(manifest_json(manifest))
            f.flush()
            os.fsync(f.fileno())
        GgufHeader.read(partial, parts)  # reads as an entry: the manifest names its shard

    # -- reports -------------------------------------------------------------------------
    def _host(self, link: Link | None) -> str:
        if link is not None:
            with contextlib.suppress(OSError):
                return str(link.sock.getsockname()[0])
        return os.uname().nodename

    def _failure(
        self,
        parts: SliceParts,
        where: str,
        cause: str,
        began: float,
        link: Link | None = None,
    ) -> SliceTransferFailed:
        host = self._host(link)
        message = (
            f"slice {parts.describe()} from {self.origin.address} to host {host}: "
            f"{where}: {cause}; no cache entry was made"
        )
        if link is not None:
            with contextlib.suppress(OSError, TransferError):
                link.send({"ok": False, "error": f"{where}: {cause}"})
        self._record("failed", parts, began, link=link, error=message)
        return SliceTransferFailed(message)

    def _record(
        self,
        outcome: str,
        parts: SliceParts,
        began: float,
        *,
        link: Link | None = None,
        **fields: Any,
    ) -> None:
        line = {
            "time": time.time(),
            "outcome": outcome,
            "source": self.origin.source_key,
            "server": self.origin.address,
            "stage_index": self.stage_index,
            "parts": parts.label(),
            "host": self._host(link),
            "socket_bytes": link.received if link is not None else 0,
            "encrypted": self.encrypt,
            "seconds": round(time.monotonic() - began, 6),
            **fields,
        }
        self.last = line
        with contextlib.suppress(OSError):
            transfer_log.append(self.cache.private_root(), line)


def _sha256(mapped: mmap.mmap, offset: int, size: int) -> str:
    with memoryview(mapped) as whole, whole[offset : offset + size] as view:
        return hashlib.sha256(view).hexdigest()


def _check_hashes(
    hashes: list[tuple[str, Future[str]]], expected: dict[str, str], *, done_only: bool
) -> None:
    """``_Failed`` for the first tensor whose hash is in and wrong; those checked (and
    right) leave ``hashes``."""
    waiting = []
    for name, future in hashes:
        if done_only and not future.done():
            waiting.append((name, future))
            continue
        got = future.result()
        if got != expected[name]:
            raise _Failed(
                f"tensor {name}",
                f"its SHA-256 is {got}, the sender's is {expected[name]} (damaged in flight)",
            )
    hashes[:] = waiting


def _cause(exc: BaseException, cache: Path) -> str:
    """What ``exc`` says went wrong; a full disk names the ``cache`` folder (the file it
    met is a partial entry's, gone once the fetch has failed)."""
    if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
        return f"no space left on the disk of the cache {cache}"
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    return str(exc) or type(exc).__name__


def _no_thread(exc: RuntimeError) -> str | None:
    """Why ``exc`` ended a fetch where it is a thread the host refused
    (``runtime_core.threads``); ``None`` for any other ``RuntimeError`` (a defect, or a
    fetch's own ``SliceTransferFailed``: raised as it is)."""
    if isinstance(exc, ThreadUnavailable):
        return str(exc)
    if not is_thread_refused(exc):
        return None
    return thread_refused("no thread left to hash the tensors", exc)


def _remove_partial(partial: Path) -> None:
    """Remove what a failed fetch wrote; where that fails too (no descriptor left), say
    so: the next fetch of the source removes it (``SliceCache.remove_stale``)."""
    try:
        shutil.rmtree(partial)
    except FileNotFoundError:
        pass
    except OSError as exc:
        log.warning(
            "could not remove the partial entry %s (%s): the next fetch of this source does",
            partial,
            exc.strerror or exc,
        )
