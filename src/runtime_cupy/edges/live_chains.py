"""The live chains of this user on this host: a registry from which a process starting
a chain's links frees what an earlier chain left when every process of it on the host
was killed at once.

Why. A chain's names on a host (its rings' segments ``/gpp-<segment tag>``, its edge
folders ``<tmp>/gpp-<folder tag>/`` with their FIFOs and address files) are freed by its processes
as they end: the orchestrator's close, a stopping stage its own hop, a stage whose
orchestrator is gone every hop (``process.stage_loss``). When every process of the
chain on the host is SIGKILLed at once (``kill -9`` of its process group, the OOM
killer), no one is left to free them, and no later run can name them: each chain has a
fresh secret, so a fresh id. A blind sweep of the ``gpp-*`` names that no process maps
is no answer: a consumer's segment exists unmapped while its pages are reserved.

The registry. A folder of this user's alone, ``<tmp>/gpp-chains-<uid>-<host>/`` (mode
0700, made where missing, removed once empty; one there that is a link, another user's
or open to others is refused, logged, and the chain runs without the registry), holds
one entry file per chain (mode 0600, named by 32 hex digits of a labelled SHA-256 of
the chain's id, which the entry never holds) listing the names that the chain's
processes make on this host, one hop a line: its ring's segment name (``shm``), a
space, and the absolute path of its edge folder (a line that is a path alone, as
earlier versions wrote it, names a folder whose segment has its name). Each process of
the chain that makes a name (a stage its inbound hop's, the orchestrator token-out's:
``links.ProcessLinks``) first opens the entry, takes a shared ``flock`` on it, checks
that what it locked is still the entry (a sweep may have removed it in between: then
it opens a fresh one), appends its hop's line, and only then makes the names: no name
of a chain exists that its entry does not list under a lock. It holds the lock until
it lets go of its links (``ProcessLinks.detach``; a stage leaving through its watchdog,
``release_entry``) or dies: the kernel lets go of a killed process's locks.

The sweep. Before taking its own entry a process sweeps the registry: an entry whose
exclusive lock it takes without waiting has no holder left, so every process of its
chain on this host is gone (or has not made a name yet: it takes the entry afresh). It
removes the names the entry lists (only ``gpp-`` and 24 base-32 digits, only this
user's: another user's segment or folder is left and logged, as every cleanup leaves
it), then the entry. An entry that is not a regular file of this user's closed to
others (a link, another user's file) is refused, logged, never read or followed. The
process that lets go of an entry last (the exclusive lock free when it lets go) frees
it alike, and the registry folder if no entry is left in it (a process that opened the
folder meanwhile finds it gone when it makes its entry, and makes it afresh). Where
``flock`` fails (a file system without locks) there is no registry, since every entry
would look dead.

A registry belongs to one temp folder (``names.temp_root``, as the edge folders do): a
run with another ``TMPDIR`` sweeps another registry.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import re
import socket
from pathlib import Path

from runtime_core.own_files import describe
from runtime_cupy.edges.shm import unlink_segment
from runtime_cupy.process.names import (
    PREFIX,
    TAG_DIGITS,
    NotPrivate,
    check_stat,
    remove_own_folder,
    temp_root,
)

log = logging.getLogger("runtime_cupy.edges.live_chains")

_ENTRY_LABEL = b"gguf-pipeline/live-chain/1\x00"
#: An entry's name: 32 hex digits (128 bits) of a labelled hash of its chain's id.
ENTRY_NAME = re.compile(r"[0-9a-f]{32}")
#: A name an entry may list: an edge folder's, or its ring segment's.
EDGE_NAME = re.compile(re.escape(PREFIX) + f"[a-z2-7]{{{TAG_DIGITS}}}")
#: How often a process opens its entry afresh when a sweep removed it under its lock.
TRIES = 8
#: The most of an entry a sweep reads (a chain lists a line per hop it makes here).
MOST_BYTES = 1 << 20
_OPEN = os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK


def registry_dir() -> Path:
    """This user's registry of live chains on this host, in the temp folder."""
    host = re.sub(r"[^A-Za-z0-9.-]", "_", socket.gethostname())[:64] or "host"
    return temp_root() / f"{PREFIX}chains-{os.geteuid()}-{host}"


def entry_name(chain_id: str) -> str:
    """The name of chain ``chain_id``'s entry (its id is not in it)."""
    return hashlib.sha256(_ENTRY_LABEL + chain_id.encode("utf-8")).hexdigest()[:32]


class LiveChain:
    """This process's hold on its chain's entry (``hold``), until ``release``."""

    def __init__(self, folder: Path, name: str, fd: int) -> None:
        self._folder = folder
        self._name = name
        self._fd = fd  # only the entry stays open: the registry is opened again to free it

    @classmethod
    def hold(cls, chain_id: str, segment: str, edge_folder: Path) -> LiveChain | None:
        """Sweep the registry, then hold chain ``chain_id``'s entry with a hop's names
        listed in it (``segment``, a ring's shared-memory name, and ``edge_folder``, that
        this process is about to make); ``None``, logged, where there is no registry to
        hold."""
        if not EDGE_NAME.fullmatch(segment):
            raise ValueError(f"{segment!r} is not an edge's segment name")
        if not edge_folder.is_absolute() or not EDGE_NAME.fullmatch(edge_folder.name):
            raise ValueError(f"{edge_folder} is not an edge folder")
        line = segment.encode("ascii") + b" " + os.fsencode(edge_folder) + b"\n"
        folder, name = registry_dir(), entry_name(chain_id)
        why = f"its entry was removed under each of {TRIES} tries"
        for _ in range(TRIES):
            registry = _open_registry(folder)
            if registry is None:
                return None
            try:
                _sweep(registry)
                fd = _take(registry, folder / name)
                if fd is not None:  # else swept between its opening and its lock
                    try:
                        os.write(fd, line)
                    except BaseException:
                        os.close(fd)
                        raise
                    return cls(folder, name, fd)
            except FileNotFoundError:  # the registry went as it emptied: made afresh
                pass
            except OSError as exc:
                why = exc.strerror or str(exc)
                break
            finally:
                os.close(registry)
        log.warning(
            "no entry in the registry of live chains %s: %s (what this chain makes here "
            "stays if all its processes on this host are killed at once)",
            folder,
            why,
        )
        return None

    def release(self) -> None:
        """Let go of the entry; the last of its holders frees what it lists, and it,
        and the registry if no other entry is left. Idempotent."""
        fd, self._fd = self._fd, -1
        if fd < 0:
            return
        registry = None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # OSError: still held
            registry = _open_registry(self._folder, make=False)
            if registry is not None and _free(registry, self._name, fd):
                _remove_if_empty(self._folder, registry)
        except OSError:
            pass
        finally:
            os.close(fd)
            if registry is not None:
                os.close(registry)


def sweep() -> int:
    """Free the entries of the registry that no process holds, and what they list (and
    the registry, if no entry is left); how many were freed."""
    folder = registry_dir()
    registry = _open_registry(folder)
    if registry is None:
        return 0
    try:
        freed = _sweep(registry)
        _remove_if_empty(folder, registry)
        return freed
    finally:
        os.close(registry)


def _open_registry(folder: Path, make: bool = True) -> int | None:
    """The registry ``folder``, open (``make``: made mode 0700 where missing); ``None``,
    logged, where it is not this user's alone or cannot be made."""
    try:
        if make:
            os.mkdir(folder, 0o700)
    except FileExistsError:
        pass
    except OSError as exc:
        log.warning("no registry of live chains at %s: %s", folder, exc.strerror or exc)
        return None
    try:
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | _OPEN)
    except OSError:  # a link (ELOOP), or not a folder
        log.warning("the registry of live chains %s is %s: refused", folder, describe(folder))
        return None
    return _private(fd, folder, "folder", "the registry of live chains:")


def _take(registry: int, path: Path) -> int | None:
    """Entry ``path`` of the registry (open as ``registry``), opened (made where
    missing) and held with a shared lock; ``None`` where a sweep removed it before the
    lock was taken; ``FileNotFoundError`` where the registry itself is gone."""
    fd = os.open(path.name, os.O_RDWR | os.O_CREAT | os.O_APPEND | _OPEN, 0o600, dir_fd=registry)
    try:
        check_stat(os.fstat(fd), path, "file")
        fcntl.flock(fd, fcntl.LOCK_SH)  # waits only while a sweep frees it
        if _still_there(registry, path.name, fd):
            return fd
    except BaseException:
        os.close(fd)
        raise
    os.close(fd)
    return None


def _remove_if_empty(folder: Path, registry: int) -> None:
    """Remove the registry ``folder`` (open as ``registry``) if no entry is left in it;
    a process that opens it meanwhile makes it afresh."""
    try:
        if os.path.samestat(os.lstat(folder), os.fstat(registry)):
            os.rmdir(folder)
    except OSError:  # another entry is in it (ENOTEMPTY), or it is gone
        pass


def _sweep(registry: int) -> int:
    try:
        names = os.listdir(registry)
    except OSError:
        return 0
    freed = 0
    for name in names:
        if not ENTRY_NAME.fullmatch(name):
            continue
        fd = _open_entry(registry, name)
        if fd is None:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            freed += _free(registry, name, fd)
        except OSError:  # held (EWOULDBLOCK): a process of its chain lives
            continue
        finally:
            os.close(fd)
    return freed


def _open_entry(registry: int, name: str) -> int | None:
    """Entry ``name``, open, if it is a regular file of this user's closed to others;
    else ``None``, logged (a link is not followed)."""
    path = registry_dir() / name
    try:
        fd = os.open(name, os.O_RDONLY | _OPEN, dir_fd=registry)
    except FileNotFoundError:
        return None
    except OSError:
        log.warning("the entry %s of live chains is %s: refused", path, describe(path))
        return None
    return _private(fd, path, "file", "the entry of live chains")


def _private(fd: int, path: Path, kind: str, what: str) -> int | None:
    """``fd`` (``path``, a ``kind``) if it is this user's closed to others; else
    closed, logged after ``what``, and ``None``."""
    try:
        check_stat(os.fstat(fd), path, kind)
    except NotPrivate as exc:
        os.close(fd)
        log.warning("%s %s", what, exc)
        return None
    return fd


def _still_there(registry: int, name: str, fd: int) -> bool:
    """Whether ``fd`` is still the file the registry names ``name``."""
    try:
        st = os.stat(name, dir_fd=registry, follow_symlinks=False)
    except FileNotFoundError:
        return False
    return os.path.samestat(st, os.fstat(fd))


def _free(registry: int, name: str, fd: int) -> int:
    """Remove what entry ``name`` (``fd``, locked exclusively) lists, then the entry:
    1, or 0 where it is gone already (another sweep freed it first)."""
    if not _still_there(registry, name, fd):
        return 0
    data = os.pread(fd, MOST_BYTES, 0)
    for line in data.split(b"\n")[:-1]:  # a line without its end was never whole
        _remove_names(os.fsdecode(line), name)
    os.unlink(name, dir_fd=registry)
    return 1


def _remove_names(line: str, entry: str) -> None:
    """Remove the segment and the folder named by ``line`` of ``entry``: ``<segment>
    <folder>``, or ``<folder>`` alone (an earlier version's: its segment has its name)."""
    if line.startswith("/"):
        segment, path = Path(line).name, line
    else:
        segment, _, path = line.partition(" ")
    folder = Path(path)
    if not folder.is_absolute() or not EDGE_NAME.fullmatch(folder.name):
        log.warning("the entry %s of live chains lists %r, no edge folder: left", entry, line)
        return
    if not EDGE_NAME.fullmatch(segment):
        log.warning("the entry %s of live chains lists %r, no segment name: left", entry, line)
        return
    unlink_segment(segment)
    remove_own_folder(folder, "a chain no process holds")
