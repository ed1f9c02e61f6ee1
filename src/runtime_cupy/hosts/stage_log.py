"""A stage's log file in the folder a user names (``--log-dir``), opened with the care
the edges' names take (``process.names``): the folder may be shared (``/tmp``, mode
1777), and whoever else can write in it may have put something at ``stage-<i>.log``
first. So the file is opened for appending without following a symbolic link (a link
to another file, another user's or root's, would have this process write into it) and
without waiting (a FIFO there would hold the open until someone reads it: the chain's
start, and ``serve`` with it, would hang), and it must be a regular file of this user's
(another user's file would receive this run's log). Anything else is refused, naming
the path and what is there (``StageLogRefused``); a file of this user's is appended to,
as before. Made here, it is mode 0600.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

from runtime_cupy.process.names import describe

_FLAGS = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


class StageLogRefused(OSError):
    """What lies at a stage's log path is not a file this process may append to."""


def open_stage_log(path: Path) -> int:
    """A descriptor appending to the regular file ``path`` of this user's (made, mode
    0600, where nothing is there); ``StageLogRefused`` naming what is there otherwise."""
    try:
        fd = os.open(path, _FLAGS, 0o600)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENXIO, errno.EISDIR):
            # ELOOP: a symbolic link; ENXIO: a FIFO no one reads; EISDIR: a folder
            raise StageLogRefused(
                exc.errno, f"{path} is {describe(path)}: a stage's log goes to a file only"
            ) from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
            raise StageLogRefused(
                errno.EPERM,
                f"{path} is {describe(path)}: a stage's log goes to a file of this user's "
                f"(uid {os.geteuid()}) only",
            )
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd
