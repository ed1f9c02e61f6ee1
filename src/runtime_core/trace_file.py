"""The ``--trace`` file of a run (``python -m runtime_cupy``, ``python -m runtime_sim
run``): written once the run has its result, never through what another user put at
its name since the command line was read (``own_files``), and, where it cannot be
written (a full disk, a link planted meanwhile), one line saying why instead of a
traceback, nothing half-written left. Each command line prints that line and its
error (``TraceNotWritten``) its own way, after the run's result."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from runtime_core.own_files import open_own_file


def write_trace(path: Path, text: str) -> str | None:
    """``text`` in ``path``: ``None`` once written; else the one line saying why not
    (``cannot write the trace to PATH: ...``), and nothing half-written left there
    (what was there stays if the file cannot be opened; a device named stays)."""
    try:  # a file of this user's or a device (``own_files``: not another's link or FIFO)
        out = os.fdopen(open_own_file(path, "the trace", devices=True), "w")
    except OSError as exc:
        return _not_written(path, exc)
    try:
        with out:
            out.write(text)
    except OSError as exc:
        if path.is_file():  # a file half-written (not a device named: /dev/full)
            with contextlib.suppress(OSError):
                path.unlink()
        return _not_written(path, exc)
    return None


def _not_written(path: Path, exc: OSError) -> str:
    return f"cannot write the trace to {path}: {exc.strerror or exc}"
