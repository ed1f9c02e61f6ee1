"""Lines of a file a user names for this process to read (``--prompts-file``,
``--api-key-file``), read with bounds: a line past ``line_limit`` bytes, or a file past
``total_limit``, is refused naming the line and the limit, after reading at most one
byte past it (``/dev/zero``, or any file with no line feed in it, was read whole into
memory: a ``MemoryError`` traceback, or the machine's memory taken).

Lines end at a line feed only (JSON text may hold U+2028 and the like raw), and a
``\\r`` before it is dropped; a UTF-8 byte-order mark at the start is skipped. A folder
is refused; a FIFO (``--prompts-file <(command)``) and a character device are read,
within the bounds.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

_BOM = b"\xef\xbb\xbf"


class LinesRefused(ValueError):
    """A file whose lines are not read: too long a line, too large a file, not UTF-8,
    or something that is no file. The message names the line and the limit, never the
    text."""


def read_lines(
    path: Path,
    *,
    line_limit: int,
    total_limit: int,
    max_lines: int | None = None,
) -> Iterator[tuple[int, str]]:
    """Each line of ``path`` and its number (from 1), decoded as UTF-8, up to
    ``max_lines`` of them (``None``: every line); ``LinesRefused`` past a bound, for
    text that is not UTF-8, or for a folder; ``OSError`` for a file that cannot be
    opened or read."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            raise LinesRefused("it is a folder, not a file")
        file = os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise
    with file:
        total = 0
        number = 0
        while max_lines is None or number < max_lines:
            raw = file.readline(line_limit + 1)
            if not raw:
                return
            number += 1
            total += len(raw)
            if total > total_limit:
                raise LinesRefused(f"the file holds more than {total_limit} bytes")
            line = raw.removesuffix(b"\n")
            if len(line) > line_limit:
                raise LinesRefused(f"line {number} is longer than {line_limit} bytes")
            if number == 1:
                line = line.removeprefix(_BOM)
            try:
                text = line.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise LinesRefused(f"line {number} is not UTF-8 ({exc.reason})") from None
            yield number, text.removesuffix("\r")
