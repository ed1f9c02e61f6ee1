"""The leftover check of every process-runtime test tells this test's leftovers from
resources another process on the host is using (``hygiene.users``)."""

from __future__ import annotations

import subprocess
import sys
import uuid
from pathlib import Path

from tests.support.hygiene import SHM, alive, users, wait_gone

HOLD = """
import mmap, os, sys, time
path = sys.argv[1]
fd = os.open(path, os.O_RDWR)
if path.startswith("/dev/shm/"):
    os.ftruncate(fd, 4096)
    m = mmap.mmap(fd, 4096)
    os.close(fd)
print("ready", flush=True)
time.sleep(60)
"""


def _hold(path: Path) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(path)], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
    return proc


def test_a_file_held_open_in_a_folder_names_its_holder(tmp_path: Path) -> None:
    folder = tmp_path / "gpp-folder"
    folder.mkdir()
    (folder / "wake").write_bytes(b"")
    assert users(str(folder)) == []
    proc = _hold(folder / "wake")
    try:
        assert users(str(folder)) == [proc.pid]
        assert users(str(tmp_path / "gpp-fold")) == []  # a prefix is not the folder
    finally:
        proc.kill()
        proc.wait()
    assert not alive(proc.pid) and wait_gone([proc.pid], 1.0) == []
    assert users(str(folder)) == []


def test_a_mapped_segment_names_its_mapper() -> None:
    segment = SHM / f"gpp-hygiene-{uuid.uuid4().hex[:8]}"
    segment.write_bytes(b"")
    try:
        proc = _hold(segment)
        try:
            assert users(str(segment)) == [proc.pid]
        finally:
            proc.kill()
            proc.wait()
        assert users(str(segment)) == []
    finally:
        segment.unlink()
