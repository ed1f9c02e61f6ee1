"""A host's cache of model slices, where users expect it:
``$GGUF_PIPELINE_CACHE``, else ``$XDG_CACHE_HOME/gguf-pipeline``, else
``~/.cache/gguf-pipeline``.

::

    <cache>/slices/<key>/<parts>/      one entry: a shard collection of one shard
        manifest.json                  (runplan.shards), read as any manifest is
        <model>.<parts>.gguf
    <cache>/tmp/                       entries being written (never read as entries)
    <cache>/locks/<key>.lock           held (flock) while a slice of that source is fetched
    <cache>/digests/<paths>.json       what hashing a local file found (``digests``)
    <cache>/transfers.jsonl            a line per slice resolved (``transfer_log``)

``<key>`` is the first 32 hex digits of the source's content key (``runplan.content``),
``<parts>`` what the slice holds (``SliceParts.label``: ``L0-9.embd``). An entry is
made in ``tmp/`` and renamed into place only once complete and verified: whatever a
fetch that broke off, was killed or hit a full disk left behind lies in ``tmp/``, is
never taken for an entry, and is removed by the next fetch of that source (whose lock
says no one else writes it). An entry is removed by renaming it into ``tmp/`` as
``gone-*`` first; what a removal killed part-way left there goes at the next fetch of
any source.

The cache is used only where it is this user's alone (``private_root``): whoever can
write in it could hand a stage other weights.

Least recently used entries go first when the cache would grow past its limit
(``$GGUF_PIPELINE_CACHE_LIMIT``, ``50GiB`` style; none by default): every use of an
entry touches its manifest; the entries a new one copies tensors from are kept while it
comes in, and go after it where both do not fit. The transfer log, at most 1 MiB, is
not counted. ``python -m runtime_cupy cache list|clear``
(``cli.cache``) shows and empties it.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import secrets
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

from attrs import frozen

from runplan.arguments import parse_size
from runplan.shards import MANIFEST_NAME, ManifestError, ShardManifest, SliceParts, read_manifest
from runtime_cupy.slices.private_root import make_root, root_problem
from runtime_cupy.slices.transfer_log import TRANSFER_LOG

CACHE_VARIABLE = "GGUF_PIPELINE_CACHE"
LIMIT_VARIABLE = "GGUF_PIPELINE_CACHE_LIMIT"
_KEY_DIGITS = 32
#: The names in ``tmp/`` of entries being removed (renamed there first, then removed).
_GONE = "gone-"


class CacheError(OSError):
    """The cache cannot be used: a limit that is not a size, a slice bigger than the
    limit, a folder that cannot be made."""


def default_root() -> Path:
    """Where the cache lives on this host (the variables above, then ``~/.cache``)."""
    chosen = os.environ.get(CACHE_VARIABLE)
    if chosen:
        return Path(chosen)
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg) if xdg else Path.home() / ".cache"
    return base / "gguf-pipeline"


def default_limit() -> int | None:
    """The cache's size limit in bytes (``$GGUF_PIPELINE_CACHE_LIMIT``), ``None``: none."""
    text = os.environ.get(LIMIT_VARIABLE, "").strip()
    if not text:
        return None
    try:
        return parse_size(text)
    except Exception:  # argparse's ArgumentTypeError, with the text
        raise CacheError(
            f"{LIMIT_VARIABLE}={text!r} is not a size (write 50GiB, 200GB, ...)"
        ) from None


def key_folder(source_key: str) -> str:
    """The folder name of a source key (``sha256:<hex>``)."""
    digits = source_key.split(":", 1)[-1]
    if len(digits) < _KEY_DIGITS or any(c not in "0123456789abcdef" for c in digits):
        raise CacheError(f"not a source content key: {source_key!r}")
    return digits[:_KEY_DIGITS]


@frozen
class CacheEntry:
    """One complete entry: a slice of the source ``source`` holding ``parts``."""

    path: Path  # the entry's folder (its manifest names its shard)
    source: str
    model_id: str
    parts: SliceParts
    shard: Path
    bytes: int  # on disk
    last_used: float  # seconds since the epoch

    @property
    def manifest(self) -> Path:
        return self.path / MANIFEST_NAME


class SliceCache:
    """The slice cache at ``root`` (default: ``default_root()``) with ``limit`` bytes at
    most (default: ``default_limit()``)."""

    def __init__(self, root: Path | None = None, limit: int | None = -1) -> None:
        self.root = Path(root) if root is not None else default_root()
        self.limit = default_limit() if limit == -1 else limit
        self._private = False

    # -- layout ----------------------------------------------------------------------
    def private_root(self) -> Path:
        """``root``, made (mode 0700) if it is not there, once found to be this user's
        alone (``private_root``); ``CacheError`` naming why not. Every path of the cache
        is taken through it."""
        if not self._private:
            try:
                make_root(self.root)
            except OSError as exc:
                raise CacheError(
                    f"cannot make the cache folder {self.root}: {exc.strerror or exc}"
                ) from exc
            problem = root_problem(self.root)
            if problem is not None:
                raise CacheError(f"{problem}; the cache is not used ({CACHE_VARIABLE})")
            self._private = True
        return self.root

    @property
    def slices(self) -> Path:
        return self.private_root() / "slices"

    @property
    def tmp(self) -> Path:
        return self.private_root() / "tmp"

    @property
    def digests(self) -> Path:
        return self.private_root() / "digests"

    @property
    def locks(self) -> Path:
        return self.private_root() / "locks"

    def folder(self, name: Path) -> Path:
        try:
            name.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise CacheError(f"cannot make the cache folder {name}: {exc.strerror}") from exc
        return name

    def entry_path(self, source_key: str, parts: SliceParts) -> Path:
        return self.slices / key_folder(source_key) / parts.label()

    # -- entries ---------------------------------------------------------------------
    def entry(self, source_key: str, parts: SliceParts) -> CacheEntry | None:
        """The complete entry of that slice, or ``None``."""
        entry = self._read_entry(self.entry_path(source_key, parts))
        return entry if entry is not None and entry.source == source_key else None

    def entries(self, source_key: str | None = None) -> list[CacheEntry]:
        """Every complete entry (of one source), least recently used first."""
        read = map(self._read_entry, self._entry_folders(source_key))
        out = [e for e in read if e and (source_key is None or e.source == source_key)]
        return sorted(out, key=lambda e: e.last_used)

    def damaged(self) -> list[tuple[Path, int]]:
        """The entry folders that are no entry (a manifest that does not read, or that
        says another source or other parts than the folder's names), and their bytes:
        never used, shown by ``cache list``, removed by ``clear`` and first to go when
        room is made."""
        return [
            (path, _tree_size(path))
            for path in self._entry_folders()
            if self._read_entry(path) is None and not _unreadable_now(path / MANIFEST_NAME)
        ]

    def _entry_folders(self, source_key: str | None = None) -> list[Path]:
        keys = [key_folder(source_key)] if source_key else _names(self.slices)
        return [self.slices / key / label for key in keys for label in _names(self.slices / key)]

    def _read_entry(self, path: Path) -> CacheEntry | None:
        """The entry in ``path`` (``slices/<key>/<parts>``), or ``None`` where it is
        incomplete or damaged: its manifest must read, name one shard, and say the
        source and parts that the folder's names say (an entry moved or edited by hand
        would otherwise serve other parts, or another model's, as these)."""
        manifest_file = path / MANIFEST_NAME
        try:
            manifest: ShardManifest = read_manifest(manifest_file)
            used = manifest_file.stat().st_mtime
            key = key_folder(manifest.source)
        except (ManifestError, CacheError, OSError):
            return None
        if len(manifest.shards) != 1 or key != path.parent.name:
            return None
        shard = manifest.shards[0]
        if shard.parts.label() != path.name:
            return None
        size = _tree_size(path)
        return CacheEntry(
            path, manifest.source, manifest.model_id, shard.parts, path / shard.file, size, used
        )

    def partial_bytes(self) -> int:
        """The bytes in ``tmp/``: fetches running, or left by ones that broke off (the
        next fetch of their source, or ``clear``, removes those)."""
        return _tree_size(self.tmp)

    def touch(self, entry: CacheEntry) -> None:
        """Mark an entry used now (least-recently-used order)."""
        with contextlib.suppress(OSError):
            os.utime(entry.manifest)

    def total_bytes(self) -> int:
        return sum(e.bytes for e in self.entries())

    def make_room(self, incoming: int, keep: tuple[CacheEntry, ...] = ()) -> list[CacheEntry]:
        """Remove least recently used entries (not those in ``keep``) until ``incoming``
        more bytes fit the limit; the entries removed. ``CacheError`` if the slice alone
        is bigger than the limit."""
        if self.limit is None:
            return []
        if incoming > self.limit:
            raise CacheError(
                f"a slice of {incoming} bytes does not fit the cache's limit of "
                f"{self.limit} bytes ({LIMIT_VARIABLE})"
            )
        for path, _ in self.damaged():  # no use to anyone, and not counted below
            self._remove_folder(path)
        removed = []
        entries = self.entries()
        total = sum(e.bytes for e in entries)
        kept = {e.path for e in keep}
        for entry in entries:
            if total + incoming <= self.limit:
                break
            if entry.path in kept:
                continue
            self.remove(entry)
            removed.append(entry)
            total -= entry.bytes
        return removed

    def remove(self, entry: CacheEntry) -> None:
        """Remove an entry (a stage that maps its file keeps reading it: the file goes
        when the last mapping does)."""
        self._remove_folder(entry.path)

    def _remove_folder(self, path: Path) -> None:
        if not path.is_dir() or path.is_symlink():  # not of our making: a stray name
            with contextlib.suppress(OSError):
                path.unlink()
            return
        doomed = self.tmp / f"{_GONE}{secrets.token_hex(6)}"
        try:
            self.folder(self.tmp)
            os.rename(path, doomed)  # no half-removed entry is ever seen
        except OSError:
            return
        shutil.rmtree(doomed, ignore_errors=True)

    def clear(self) -> tuple[int, int]:
        """Remove every entry (damaged ones too), what fetches no longer running left
        in ``tmp/``, and the transfer log; the entries and bytes removed."""
        count = size = 0
        for entry in self.entries():
            self.remove(entry)
            count += 1
            size += entry.bytes
        for path, n in self.damaged():
            self._remove_folder(path)
            count += 1
            size += n
        for key in _names(self.slices):
            with contextlib.suppress(OSError):
                (self.slices / key).rmdir()
        for name in _names(self.tmp):
            key = name.split(".", 1)[0]
            with self.try_lock(key) as held:
                if held or name.startswith(_GONE):
                    shutil.rmtree(self.tmp / name, ignore_errors=True)
        with contextlib.suppress(FileNotFoundError):
            (self.private_root() / TRANSFER_LOG).unlink()
        return count, size

    # -- writing ---------------------------------------------------------------------
    def new_partial(self, source_key: str, parts: SliceParts) -> Path:
        """A fresh folder in ``tmp/`` for an entry being written."""
        name = f"{key_folder(source_key)}.{parts.label()}.{os.getpid()}.{secrets.token_hex(4)}"
        path = self.folder(self.tmp) / name
        path.mkdir()
        return path

    def remove_stale(self, source_key: str) -> None:
        """Remove what earlier fetches of this source left in ``tmp/`` (call with the
        source's lock held: no one else writes there), and what removals killed
        part-way left (``gone-*``: only ever removed, by whoever moved it there, and a
        second removal beside the first harms neither)."""
        prefix = key_folder(source_key) + "."
        for name in _names(self.tmp):
            if name.startswith((prefix, _GONE)):
                shutil.rmtree(self.tmp / name, ignore_errors=True)

    def commit(self, partial: Path, source_key: str, parts: SliceParts) -> Path:
        """Rename a complete, verified entry into place (replacing an older one)."""
        target = self.entry_path(source_key, parts)
        self.folder(target.parent)
        if target.exists():
            doomed = self.tmp / f"{_GONE}{secrets.token_hex(6)}"
            os.rename(target, doomed)
            shutil.rmtree(doomed, ignore_errors=True)
        os.rename(partial, target)
        return target

    # -- locks -----------------------------------------------------------------------
    @contextlib.contextmanager
    def lock(self, source_key: str, timeout_s: float | None = None) -> Iterator[None]:
        """Hold the lock of a source's slices (one fetch of a source at a time on this
        host: a second stage waits, then finds what the first brought). The kernel
        releases it when the process dies. ``CacheError`` naming the lock file where it
        cannot be made or opened (a file system out of inodes, say)."""
        path = self.folder(self.locks) / f"{key_folder(source_key)}.lock"
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            raise CacheError(f"cannot make the lock file {path}: {exc.strerror}") from exc
        try:
            deadline = None if timeout_s is None else time.monotonic() + timeout_s
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | (fcntl.LOCK_NB if deadline else 0))
                    break
                except BlockingIOError:
                    if deadline is not None and time.monotonic() > deadline:
                        raise CacheError(
                            f"another process has held {path} for {timeout_s:.0f} s"
                        ) from None
                    time.sleep(0.05)
            yield
        finally:
            os.close(fd)

    @contextlib.contextmanager
    def try_lock(self, key: str) -> Iterator[bool]:
        """The lock of key folder ``key`` if free now: whether it is held."""
        path = self.locks / f"{key}.lock"
        try:
            fd = os.open(path, os.O_RDWR)
        except OSError:
            yield True  # never locked: no fetch of it runs
            return
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                yield False
                return
            yield True
        finally:
            os.close(fd)


def _names(folder: Path) -> list[str]:
    try:
        return sorted(os.listdir(folder))
    except OSError:
        return []


def _size(path: Path) -> int:
    try:
        return path.lstat().st_size
    except OSError:
        return 0


def _tree_size(path: Path) -> int:
    """The bytes of the files under ``path`` (links not followed), or of ``path``."""
    if not path.is_dir() or path.is_symlink():
        return _size(path)
    total = 0
    for folder, _, files in os.walk(path):
        total += sum(_size(Path(folder) / name) for name in files)
    return total


def _unreadable_now(manifest: Path) -> bool:
    """Whether ``manifest`` is there but cannot be opened now (no descriptor left, a
    permission): not taken for damage, which would remove a sound entry."""
    try:
        with open(manifest, "rb"):
            return False
    except (FileNotFoundError, NotADirectoryError):  # no manifest: damaged, or a stray file
        return False
    except OSError:
        return True
