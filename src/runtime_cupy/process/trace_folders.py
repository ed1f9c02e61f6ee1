"""The folders a launcher makes in the temp folder (``names.temp_root``, as the edge
folders) for its stages' traces (``tracing.TRACE_FOLDER_PREFIX``), and the freeing of
those a killed launcher left.

A launcher removes a stage's folder once it has read the stage's trace, and a stage
whose launcher is gone removes its own (``TraceLog.discard``). Where both were killed
at once (a ``kill -9`` of every process of the run, the OOM killer), no one was left to,
and the folders stayed for good. So the launcher holds an exclusive ``flock`` on a file
in each folder (``tracing.TRACE_FOLDER_LOCK``, renamed into place only once locked,
so a folder whose lock file is there is locked until its launcher lets go or dies),
and before it starts a stage of this host (traced or not) it frees every such folder
whose lock it takes without waiting: no launcher holds it. A folder without that file
(one being made, or made by an earlier version), a link, or another user's is left as
it is. A run with another temp folder frees none of this one's."""

from __future__ import annotations

import fcntl
import os
import shutil
import stat
import tempfile
from pathlib import Path

from runtime_cupy.process.names import remove_own_folder, temp_root
from runtime_cupy.process.tracing import TRACE_FOLDER_LOCK, TRACE_FOLDER_PREFIX

_OPEN = os.O_CLOEXEC | os.O_NOFOLLOW


class TraceFolder:
    """A stage's trace folder, held by this process until ``remove``."""

    def __init__(self, path: Path, fd: int) -> None:
        self.path = path
        self._fd = fd

    @classmethod
    def make(cls, root: Path | None = None) -> TraceFolder:
        """Free the trace folders in ``root`` (``temp_root`` by default) that no
        launcher holds, then make one and hold it."""
        root = temp_root() if root is None else root
        sweep(root)
        path = Path(tempfile.mkdtemp(prefix=TRACE_FOLDER_PREFIX, dir=root))
        fd = -1
        try:
            making = path / f"{TRACE_FOLDER_LOCK}.new"
            fd = os.open(making, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _OPEN, 0o600)
            fcntl.flock(fd, fcntl.LOCK_EX)
            os.rename(making, path / TRACE_FOLDER_LOCK)
        except BaseException:
            if fd >= 0:
                os.close(fd)
            shutil.rmtree(path, ignore_errors=True)
            raise
        return cls(path, fd)

    def remove(self) -> None:
        """Remove the folder and what is in it, and let go of it. Idempotent."""
        fd, self._fd = self._fd, -1
        if fd < 0:
            return
        try:
            shutil.rmtree(self.path, ignore_errors=True)
        finally:
            os.close(fd)


def sweep(root: Path | None = None) -> int:
    """Remove the trace folders in ``root`` (``temp_root`` by default) that no
    launcher holds; how many."""
    root = temp_root() if root is None else root
    try:
        names = [n for n in os.listdir(root) if n.startswith(TRACE_FOLDER_PREFIX)]
    except OSError:
        return 0
    freed = 0
    for name in names:
        folder = root / name
        try:
            st = os.lstat(folder)
        except OSError:
            continue
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
            continue  # a link, or another user's: left
        try:
            fd = os.open(folder / TRACE_FOLDER_LOCK, os.O_RDONLY | _OPEN)
        except OSError:  # no lock file: being made, or made by an earlier version
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # held (EWOULDBLOCK): its launcher lives
            os.close(fd)
            continue
        try:
            remove_own_folder(folder, "a stage's trace that no launcher holds")
            freed += 1
        finally:
            os.close(fd)
    return freed
