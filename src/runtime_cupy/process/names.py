"""Names of a run's resources on one host, derived from ``(run_id, edge_id)`` alone
(EDGES_AND_WORKERS.md §3), so that whoever tears a run down finds and frees all of
them, also what a killed process made.

``<tag>`` is the first 12 hex digits of the SHA-256 of the run id: names stay short (a
shared-memory name is at most 31 bytes on macOS) and every resource of one run shares
the prefix ``gpp-<tag>``. The run folder ``<tmp>/gpp-<tag>/`` holds the run's files on
this host (the FIFOs of shared-memory edges, the local rendezvous of TCP edges); it is
made by whoever needs it first and removed, once empty, by whoever frees its last file.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

#: The prefix of every shared-memory segment and run folder of this runtime.
PREFIX = "gpp-"
#: How often making a file retries when the run folder vanished under it.
_MAKE_ATTEMPTS = 100

T = TypeVar("T")


def run_tag(run_id: str) -> str:
    """12 hex digits that stand for ``run_id`` in resource names."""
    return hashlib.sha256(run_id.encode("utf-8")).hexdigest()[:12]


def run_dir(run_id: str) -> Path:
    """The folder that holds a run's files on this host."""
    return Path(tempfile.gettempdir()) / f"{PREFIX}{run_tag(run_id)}"


def in_run_dir(run_id: str, make: Callable[[Path], T]) -> T:
    """``make(folder)`` with the run folder present. Another process may remove the
    folder once it is empty (``remove_run_dir``), between this ``mkdir`` and the file
    ``make`` creates in it: then ``make`` raises ``FileNotFoundError`` and runs again
    in a folder made anew. A folder holding a file is never removed, so once ``make``
    succeeded its file stays."""
    folder = run_dir(run_id)
    for _ in range(_MAKE_ATTEMPTS - 1):
        folder.mkdir(mode=0o700, exist_ok=True)
        try:
            return make(folder)
        except FileNotFoundError:
            continue  # the folder went between mkdir and make: again
    folder.mkdir(mode=0o700, exist_ok=True)
    return make(folder)


def remove_run_dir(run_id: str) -> None:
    """Remove the run's folder if it is empty (a process may still own files in it;
    whoever removes the last one removes the folder)."""
    with contextlib.suppress(FileNotFoundError, OSError):
        os.rmdir(run_dir(run_id))
