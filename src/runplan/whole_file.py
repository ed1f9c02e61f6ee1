"""A file written whole (``split``'s shards and manifest): through a partial file of a
fresh name of its own in the target's folder, renamed into place once complete.

The partial file is made with ``O_CREAT | O_EXCL | O_NOFOLLOW`` under a random name: a
fixed name (``NAME.partial``) let a symlink planted there (another user's, in a shared
folder) be written through, and let two writers of one target write into one file. Its
mode is what the umask leaves of 0666, as ``open(path, "wb")`` makes it. The partial
file is removed on any failure, and nothing is then left at the target.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | getattr(os, "O_NOFOLLOW", 0)
#: Random names tried before giving up (each a 64-bit token: a clash is a planted file).
_TRIES = 16


@contextlib.contextmanager
def whole_file(target: str | os.PathLike[str], size: int | None = None) -> Iterator[BinaryIO]:
    """A binary file to write ``target``'s bytes into; on leaving the block without
    an error it is flushed, synced and renamed to ``target``. ``size``: the bytes the
    file must then hold (a shorter file is ``OSError`` ENOSPC, not renamed). An
    ``OSError`` names ``target`` and the bytes its file system has free."""
    target = Path(target)
    out, partial = _create(target)
    try:
        with out:
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
        return os.fdopen(fd, "wb"), partial
    raise _write_error(target, FileExistsError(errno.EEXIST, "no fresh partial file name"))


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
