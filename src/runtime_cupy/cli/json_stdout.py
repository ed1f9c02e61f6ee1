"""Standard output for ``--json``: exactly the command's JSON, whoever else writes.

While a ``--json`` command runs (``json_stdout(True)``), ``sys.stdout`` and file
descriptor 1 point at standard error, so that what others write there goes to standard
error: Ray's driver printing its workers' and raylets' lines (``(raylet) Raylet is
terminated ...`` when a node dies), a library's ``print``, a child process's output.
The command writes its JSON with ``write_json``, to the standard output it was given.
Where standard output has no descriptor of its own (captured by a test), nothing is
moved and ``write_json`` writes to ``sys.stdout``.
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
from collections.abc import Iterator
from typing import Any, TextIO

from runplan.json_errors import print_json

_out: TextIO | None = None  # the given standard output, while a --json command runs


@contextlib.contextmanager
def json_stdout(active: bool) -> Iterator[None]:
    """For the ``with`` block, when ``active``: standard output (``sys.stdout`` and
    descriptor 1) is standard error, and ``write_json`` writes to the real one. Both are
    given back at the block's end whatever happened (a reader gone: its broken pipe is
    the command's to meet in ``write_json``, never the restore's)."""
    global _out
    if not active or _out is not None:
        yield
        return
    try:
        sys.stdout.fileno()
    except (AttributeError, OSError, io.UnsupportedOperation):
        yield  # captured streams: nothing at the descriptors' level to move
        return
    with contextlib.suppress(OSError, ValueError):
        sys.stdout.flush()
    saved = os.dup(1)
    real = open(saved, "w", encoding="utf-8", closefd=False)  # noqa: SIM115
    previous = sys.stdout
    try:
        os.dup2(2, 1)
        sys.stdout, _out = sys.stderr, real
        yield
    finally:
        with contextlib.suppress(OSError, ValueError):
            sys.stderr.flush()
        os.dup2(saved, 1)  # first: nothing below may keep stdout pointing elsewhere
        sys.stdout, _out = previous, None
        with contextlib.suppress(OSError, ValueError):
            real.close()  # its last flush (a reader gone: nothing more to tell it)
        os.close(saved)


def write_json(doc: Any) -> None:
    """One JSON document and a line feed on the command's standard output, flushed."""
    print_json(doc, _out)
