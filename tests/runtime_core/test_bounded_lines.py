"""``runtime_core.bounded_lines.read_lines``: a user's file is read line by line within
its bounds, each refusal naming the line or the limit; what lies past the lines asked
for is never read."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from runtime_core.bounded_lines import LinesRefused, read_lines


def _lines(path: Path, **bounds: int) -> list[tuple[int, str]]:
    return list(
        read_lines(path, line_limit=bounds.get("line", 8), total_limit=bounds.get("total", 64))
    )


def test_lines_are_numbered_decoded_and_their_ends_dropped(tmp_path: Path) -> None:
    f = tmp_path / "f"
    f.write_bytes(b"\xef\xbb\xbfone\r\n\ntw\xc3\xa9\nlast")
    assert _lines(f) == [(1, "one"), (2, ""), (3, "tw\u00e9"), (4, "last")]
    # A line of exactly the bound is taken; one byte more is refused.
    f.write_bytes(b"12345678\n123456789\n")
    with pytest.raises(LinesRefused, match=r"^line 2 is longer than 8 bytes$"):
        _lines(f)


def test_the_whole_file_is_bounded(tmp_path: Path) -> None:
    f = tmp_path / "f"
    f.write_bytes(b"1234567\n" * 8 + b"x\n")  # 66 bytes: past 64 on line 9
    with pytest.raises(LinesRefused, match=r"^the file holds more than 64 bytes$"):
        _lines(f)
    assert len(_lines(f, total=66)) == 9


def test_text_that_is_not_utf8_is_named_by_its_line(tmp_path: Path) -> None:
    f = tmp_path / "f"
    f.write_bytes(b"ok\n\xff\n")
    with pytest.raises(LinesRefused, match=r"^line 2 is not UTF-8 \(invalid start byte\)$"):
        _lines(f)


def test_only_the_lines_asked_for_are_read(tmp_path: Path) -> None:
    lines = read_lines(Path("/dev/zero"), line_limit=8, total_limit=1 << 40, max_lines=0)
    assert list(lines) == []
    f = tmp_path / "f"
    f.write_bytes(b"key\n" + b"\xff" * 100)
    assert list(read_lines(f, line_limit=8, total_limit=9, max_lines=1)) == [(1, "key")]


def test_a_fifo_is_read_as_it_comes_and_a_folder_refused(tmp_path: Path) -> None:
    """A FIFO (``--prompts-file <(command)``) is read, within the bounds, as its writer
    writes it; a folder is refused."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    writer = threading.Thread(target=lambda: fifo.write_bytes(b"a\nbc\n"))
    writer.start()
    assert list(read_lines(fifo, line_limit=8, total_limit=64)) == [(1, "a"), (2, "bc")]
    writer.join(10)
    with pytest.raises(LinesRefused, match="it is a folder, not a file"):
        _lines(tmp_path)
