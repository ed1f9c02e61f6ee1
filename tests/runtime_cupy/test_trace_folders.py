"""The folders a launcher makes for its stages' traces (``process.trace_folders``): one
whose launcher lives is never freed by a run beside it; one whose launcher died is;
what is not one (no lock file, a link) is left."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from runtime_cupy.process.trace_folders import TraceFolder, sweep
from runtime_cupy.process.tracing import TRACE_FOLDER_PREFIX

MAKE = """
import sys
from pathlib import Path
from runtime_cupy.process.trace_folders import TraceFolder
print(TraceFolder.make(Path(sys.argv[1])).path, flush=True)
sys.stdin.read()
"""


def test_a_held_folder_stays_and_its_holder_removes_it(tmp_path: Path) -> None:
    folder = TraceFolder.make(tmp_path)
    (folder.path / "stage-0.json").write_text("[]")
    assert sweep(tmp_path) == 0
    assert folder.path.is_dir()
    folder.remove()
    folder.remove()
    assert list(tmp_path.iterdir()) == []


def test_a_folder_whose_launcher_was_killed_is_freed(tmp_path: Path) -> None:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    proc = subprocess.Popen(
        [sys.executable, "-c", MAKE, str(tmp_path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    assert proc.stdout is not None
    made = Path(proc.stdout.readline().strip())
    (made / "stage-1.json").write_text("[]")
    try:
        assert sweep(tmp_path) == 0  # its launcher lives
        assert made.is_dir()
    finally:
        proc.kill()
        proc.wait(10)
    assert sweep(tmp_path) == 1
    assert list(tmp_path.iterdir()) == []


def test_what_is_no_held_trace_folder_is_left(tmp_path: Path) -> None:
    bare = tmp_path / f"{TRACE_FOLDER_PREFIX}bare"  # being made, or an earlier version's
    bare.mkdir()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / ".held").write_text("")
    (tmp_path / f"{TRACE_FOLDER_PREFIX}link").symlink_to(elsewhere)
    assert sweep(tmp_path) == 0
    assert bare.is_dir() and (elsewhere / ".held").exists()
