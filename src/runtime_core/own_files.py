"""Files a user names for this process to write (a stage's log, a trace), opened with
the care a shared folder asks for: ``/tmp`` (mode 1777) lets anyone put something at a
name first.

- A symbolic link there would have this process write into the file it points to
  (another user's, or root's): it is not followed, unless it is this user's or root's
  and ``devices`` allows it (``/dev/stderr`` is root's link to a descriptor).
- A FIFO would hold the open until someone reads it (a run, and ``serve`` with it,
  hung): the open does not wait, and a FIFO with a reader is refused once open.
- Another user's file would receive what is written: a regular file must be this
  user's, and have no other name (a hard link planted at the name, where the system
  lets a user link another's file, would reach a file of root's). A character device
  (``/dev/null``, ``/dev/full``), which no unprivileged user can make, is written to
  where ``devices`` allows it.
- A folder on the way to the name that is another user's symbolic link (``/tmp/x``
  planted in a sticky ``/tmp`` where the system follows any link there) would have
  this process write wherever that user points it: refused, naming the link and its
  owner; a link of this user's or of root's (``/tmp`` itself, on some systems) is
  followed.

Anything else is refused, naming the path and what is there (``FileRefused``); a file
made here is mode 0600.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_NONBLOCK | os.O_CLOEXEC
#: Links followed on the way to a name before it counts as a loop (Linux's own bound).
_MAX_LINKS = 40


class FileRefused(OSError):
    """What lies at a path this process was to write is not a file it may write."""


def describe(path: Path | str) -> str:
    """What is at ``path``, for a message: its type, owner and mode."""
    try:
        return describe_stat(os.lstat(path))
    except OSError as exc:
        return f"unreadable ({exc.strerror})"


def describe_stat(st: os.stat_result) -> str:
    kinds = (
        (stat.S_ISLNK, "a symbolic link"),
        (stat.S_ISDIR, "a folder"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISREG, "a file"),
    )
    kind = next((name for test, name in kinds if test(st.st_mode)), "a special file")
    return f"{kind} of uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):04o}"


def _follows(path: Path, devices: bool) -> bool:
    """Whether the open may follow a link at ``path``: this user's or root's, where
    ``devices`` allows it."""
    if not devices:
        return False
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISLNK(st.st_mode) and _trusted(st)


def _trusted(st: os.stat_result) -> bool:
    """Whether a link is this user's or root's, whose target the open may follow."""
    return st.st_uid in (os.geteuid(), 0)


def _strangers_link(folder: Path) -> tuple[Path, os.stat_result] | None:
    """The first symbolic link of another user (neither this user's nor root's) that
    reaching ``folder`` goes through, and its ``lstat``; ``None`` if none. Each link of
    this user's or root's is followed as the system would, component by component;
    what is missing or unreadable ends the walk (the open then says what is wrong)."""
    here = Path(os.getcwd()) if not folder.is_absolute() else Path(folder.anchor)
    pending = list(reversed(folder.parts[1:] if folder.is_absolute() else folder.parts))
    links = 0
    while pending:
        part = pending.pop()
        if part == "..":
            here = here.parent
            continue
        candidate = here / part
        try:
            st = os.lstat(candidate)
            if not stat.S_ISLNK(st.st_mode):
                here = candidate
                continue
            if not _trusted(st):
                return candidate, st
            links += 1
            target = Path(os.readlink(candidate))
        except OSError:
            return None
        if links > _MAX_LINKS:
            return None
        if target.is_absolute():
            here = Path(target.anchor)
            pending.extend(reversed(target.parts[1:]))
        else:
            pending.extend(reversed(target.parts))
    return None


def open_own_file(
    path: Path,
    what: str,
    *,
    append: bool = False,
    devices: bool = False,
    refused: type[FileRefused] = FileRefused,
) -> int:
    """A blocking descriptor writing ``path`` (``what`` it is, for the message),
    emptied unless ``append``: a regular file of this user's (made, mode 0600, where
    nothing is there), or with ``devices`` a character device; ``refused`` (a
    ``FileRefused``) naming what is there otherwise."""
    flags = _FLAGS | (os.O_APPEND if append else 0)
    through = _strangers_link(path.parent)
    if through is not None:
        link, st = through
        raise refused(
            errno.EPERM,
            f"{path}: the folder {link} on its way is {describe_stat(st)} "
            f"(uid {os.geteuid()} follows only its own links and root's): "
            f"{_allowed(what, devices)}",
        )
    if not _follows(path, devices):
        flags |= os.O_NOFOLLOW
    try:
        fd = os.open(path, flags, 0o600)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENXIO, errno.EISDIR) or (
            exc.errno == errno.EACCES and os.path.islink(path)
        ):  # ELOOP: a symbolic link (EACCES: creating through one, in a sticky
            # folder); ENXIO: a FIFO no one reads; EISDIR: a folder
            raise refused(
                exc.errno, f"{path} is {describe(path)}: {_allowed(what, devices)}"
            ) from None
        raise
    try:
        st = os.fstat(fd)
        own = stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid()
        if not (own or (devices and stat.S_ISCHR(st.st_mode))):
            raise refused(
                errno.EPERM,
                f"{path} is {describe_stat(st)}: {_allowed(what, devices)} (uid {os.geteuid()})",
            )
        if own and st.st_nlink > 1:  # another name reaches the same file: a planted link
            raise refused(
                errno.EPERM,
                f"{path} is {describe_stat(st)}, with {st.st_nlink} names (hard links): "
                f"{what} goes only to a file that no other name reaches",
            )
        os.set_blocking(fd, True)
        if not append and stat.S_ISREG(st.st_mode):
            os.ftruncate(fd, 0)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _allowed(what: str, devices: bool) -> str:
    return f"{what} goes to a file of this user's{' or a device' if devices else ''} only"
