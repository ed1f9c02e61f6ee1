"""A file written whole (``split``'s shards and manifest): through a partial file of a
fresh name of its own in the target's folder, renamed into place once complete.

The partial file is made with ``O_CREAT | O_EXCL | O_NOFOLLOW`` under a random name: a
fixed name (``NAME.partial``) let a symlink planted there (another user's, in a shared
folder) be written through, and let two writers of one target write into one file. Its
mode is what the umask leaves of 0666, as ``open(path, "wb")`` makes it. The partial
file is removed on any failure, and nothing is then left at the target.

A writer that dies (SIGKILL, a lost machine) cannot remove it: the next writer of the
same target does. Each writer holds an exclusive ``flock`` on its partial file from
making it until it is renamed into place (the kernel lets go when the writer dies, on
whatever host it ran), and a writer first removes each ``NAME.<16 hex>.partial`` of this
user whose lock it can take: never a live writer's. One that a sweep removed between
its making and its lock (no name left to it) is given up for a fresh name. A file
system without locks keeps what dead writers left, as before.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import re
import secrets
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | getattr(os, "O_NOFOLLOW", 0)
#: Random names tried before giving up (each a 64-bit token: a clash is a planted file).
_TRIES = 16
#: What follows the target's name in the name of one of its partial files.
_PARTIAL_TAIL = re.compile(r"\.[0-9a-f]{16}\.partial")


@contextlib.contextmanager
def whole_file(target: str | os.PathLike[str], size: int | None = None) -> Iterator[BinaryIO]:
    """A binary file to write ``target``'s bytes into; on leaving the block without
    an error it is flushed, synced and renamed to ``target``. ``size``: the bytes the
    file must then hold (a shorter file is ``OSError`` ENOSPC, not renamed). An
    ``OSError`` names ``target`` and the bytes its file system has free."""
    target = Path(target)
    _sweep(target)
    out, partial = _create(target)
    try:
        with out:  # open, so locked, until renamed: no sweep takes it
            yield out
            out.flush()
            os.fsync(out.fileno())
            held = os.fstat(out.fileno()).st_size
            if size is not None and held != size:
                raise OSError(errno.ENOSPC, f"{held} of its {size} bytes written")
            _rename(partial, target)
    except BaseException as exc:
        error = _write_error(target, exc) if isinstance(exc, OSError) else None
        with contextlib.suppress(OSError):
            partial.unlink()
        if error is not None:
            raise error from exc
        raise


def _create(target: Path) -> tuple[BinaryIO, Path]:
    for _ in range(_TRIES):
        partial = target.with_name(f"{target.name}.{secrets.token_hex(8)}.partial")
        try:
            fd = os.open(partial, _FLAGS, 0o666)
        except FileExistsError:
            continue
        except OSError as exc:
            raise _write_error(target, exc) from exc
        if not _hold(fd):
            os.close(fd)
            continue
        return os.fdopen(fd, "wb"), partial
    raise _write_error(target, FileExistsError(errno.EEXIST, "no fresh partial file name"))


def _hold(fd: int) -> bool:
    """Lock the partial file just made (``fd``) for as long as it is open; ``False``
    where a sweep removed it before the lock was taken (its name gone)."""
    with contextlib.suppress(OSError):  # no locks here: no sweep can take it either
        fcntl.flock(fd, fcntl.LOCK_EX)
    return os.fstat(fd).st_nlink > 0


def _sweep(target: Path) -> None:
    """Remove the partial files of ``target`` that writers no longer running left: those
    of this user whose lock no process holds."""
    try:
        names = os.listdir(target.parent)
    except OSError:
        return
    for name in names:
        tail = name[len(target.name) :]
        if name.startswith(target.name) and _PARTIAL_TAIL.fullmatch(tail):
            _remove_unheld(target.parent / name)


def _remove_unheld(path: Path) -> None:
    """Remove ``path`` if it is a regular file of this user that no process holds locked
    (a link, another user's file or a held one is left)."""
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | getattr(os, "O_NOFOLLOW", 0)
    try:
        fd = os.open(path, flags)
    except OSError:
        return
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
            return
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # OSError: its writer runs
        if os.path.samestat(os.lstat(path), st):  # not renamed into place since
            os.unlink(path)
    except OSError:
        return
    finally:
        os.close(fd)


def _rename(partial: Path, target: Path) -> None:
    if target.is_dir() and not target.is_symlink():
        raise IsADirectoryError(errno.EISDIR, "a folder of that name is in the way")
    os.replace(partial, target)


def _write_error(target: Path, exc: OSError) -> OSError:
    """``exc`` (writing ``target`` failing) naming the file and, for a file system that
    is full, the bytes it has free."""
    room = ""
    if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, None):
        try:
            stat = os.statvfs(target.parent)
            room = f"; its file system has {stat.f_bavail * stat.f_frsize} bytes free"
        except OSError:
            pass
    message = f"writing {str(target)!r}: {exc.strerror or exc}{room}"
    return OSError(exc.errno, message) if exc.errno is not None else OSError(message)
