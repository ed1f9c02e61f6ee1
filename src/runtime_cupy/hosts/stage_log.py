"""A stage's log file in the folder a user names (``--log-dir``), opened with the care
the edges' names take (``process.names``): the folder may be shared (``/tmp``, mode
1777), and whoever else can write in it may have put something at ``stage-<i>.log``
first. So the file is opened for appending without following a symbolic link (a link
to another file, another user's or root's, would have this process write into it) and
without waiting (a FIFO there would hold the open until someone reads it: the chain's
start, and ``serve`` with it, would hang), and it must be a regular file of this user's
(another user's file would receive this run's log). Anything else is refused, naming
the path and what is there (``StageLogRefused``, by ``runtime_core.own_files``); a
file of this user's is appended to, as before. Made here, it is mode 0600.
"""

from __future__ import annotations

from pathlib import Path

from runtime_core.own_files import FileRefused, open_own_file


class StageLogRefused(FileRefused):
    """What lies at a stage's log path is not a file this process may append to."""


def open_stage_log(path: Path) -> int:
    """A descriptor appending to the regular file ``path`` of this user's (made, mode
    0600, where nothing is there); ``StageLogRefused`` naming what is there otherwise."""
    return open_own_file(path, "a stage's log", append=True, refused=StageLogRefused)
