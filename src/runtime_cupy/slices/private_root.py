"""Whether a slice cache's folder is this user's alone, as ssh asks of ``~/.ssh``.

What lies in the cache is trusted as far as its hashes go: an entry's tensors hash to
the SHA-256 its own header holds, a digest record says which files were found to hold
which slice. Whoever can write in the cache can therefore hand a stage other weights
(an entry under the source's content key, hashes and all), make it trust a file it
never checked, or plant a symbolic link where the cache writes (``transfers.jsonl``)
and have this user's processes write through it. So the cache is used only where no
other user can write: the folder itself this user's, closed to writing by group and
others (one it makes is mode 0700); every folder above it root's or this user's, and
writable by others only with the sticky bit (``/tmp``); every symbolic link on the way
root's or this user's. Anything else is refused, naming the path, its owner and mode.
"""

from __future__ import annotations

import contextlib
import os
import stat
from pathlib import Path

from runtime_core.own_files import describe


def _above_problem(path: Path, st: os.stat_result) -> str | None:
    """What is wrong with ``path`` (``st``) as a folder or link above the cache."""
    trusted = (0, os.geteuid())
    if st.st_uid not in trusted:
        return f"{path}, on the way to the cache, is {describe(path)}: another user's"
    open_to_others = stat.S_IMODE(st.st_mode) & 0o022
    if stat.S_ISDIR(st.st_mode) and open_to_others and not st.st_mode & stat.S_ISVTX:
        return (
            f"{path}, a folder above the cache, is {describe(path)}: another user could "
            "replace what is in it"
        )
    return None


def root_problem(root: Path) -> str | None:
    """``None`` when the folder ``root`` (which exists) is this user's alone, and so is
    the way to it; else what is wrong, naming the path, its owner and mode."""
    named = Path(os.path.abspath(root))
    real = Path(os.path.realpath(named))
    try:
        for path in named.parents:  # the way as named: its links, its folders
            problem = _above_problem(path, os.lstat(path))
            if problem is not None:
                return problem
        st = os.lstat(named)
        if stat.S_ISLNK(st.st_mode) and st.st_uid not in (0, os.geteuid()):
            return f"the cache {named} is {describe(named)}: another user's link"
        for path in real.parents:  # the way as it is
            problem = _above_problem(path, os.stat(path))
            if problem is not None:
                return problem
        st = os.stat(real)
    except OSError as exc:
        return f"the cache folder {named} cannot be looked at: {exc.strerror or exc}"
    if not stat.S_ISDIR(st.st_mode):
        return f"the cache {real} is {describe(real)}, not a folder"
    if st.st_uid != os.geteuid() or stat.S_IMODE(st.st_mode) & 0o022:
        return (
            f"the cache folder {real} is {describe(real)}, not this user's alone "
            f"(uid {os.geteuid()}): another user could write in it"
        )
    return None


def make_root(root: Path) -> None:
    """Make the cache folder ``root`` and the folders above it that are not there, mode
    0700 (whatever the umask); ``OSError`` if one cannot be made."""
    missing = []
    path = Path(os.path.abspath(root))
    while not os.path.lexists(path):
        missing.append(path)
        path = path.parent
    for folder in reversed(missing):
        with contextlib.suppress(FileExistsError):  # made meanwhile: checked as any other
            os.mkdir(folder, 0o700)
            os.chmod(folder, 0o700)  # past the umask
