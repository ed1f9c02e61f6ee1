"""The ``--trace`` file both runtimes write (``runtime_core.trace_file``): written, or
one line saying why not, never through another user's link, a file that cannot be
written left as it was."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from runtime_core.trace_file import write_trace


def test_the_trace_is_written_over_what_was_there(tmp_path: Path) -> None:
    path = tmp_path / "trace.json"
    path.write_text("an older, longer trace\n")
    assert write_trace(path, "{}") is None
    assert path.read_text() == "{}"


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="no /dev/full on this system")
def test_a_full_disk_is_one_line_and_the_device_is_left(tmp_path: Path) -> None:
    message = write_trace(Path("/dev/full"), "{}")
    assert message == "cannot write the trace to /dev/full: No space left on device"
    assert Path("/dev/full").is_char_device()


@pytest.mark.skipif(os.geteuid() != 0, reason="another user's link is made with lchown, as root")
def test_another_users_link_is_refused_and_its_target_left(tmp_path: Path) -> None:
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    link = tmp_path / "trace.json"
    link.symlink_to(victim)
    os.lchown(link, 65534, 65534)
    message = write_trace(link, "{}")
    assert message is not None and message.startswith(f"cannot write the trace to {link}: ")
    assert "a symbolic link of uid 65534" in message, message
    assert victim.read_text() == "precious\n"
