"""``python -m runplan | runtime_cupy | runtime_sim`` interrupted while their modules
load (Ctrl-C in the first second of a command) print ``cancelled`` and exit 130, as
they do once the command runs, not a ``KeyboardInterrupt`` traceback."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# A fresh interpreter where importing the command's module raises KeyboardInterrupt, as
# Ctrl-C there would; then ``python -m PACKAGE``.
_INTERRUPTED_IMPORT = """
import importlib.abc, runpy, sys

class Interrupting(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname == sys.argv[2]:
            raise KeyboardInterrupt

sys.meta_path.insert(0, Interrupting())
runpy.run_module(sys.argv[1], run_name="__main__", alter_sys=True)
"""


@pytest.mark.parametrize(
    ("package", "cli"),
    [
        ("runplan", "runplan.cli"),
        ("runtime_cupy", "runtime_cupy.cli.main"),
        ("runtime_sim", "runtime_sim.cli"),
    ],
)
def test_ctrl_c_while_the_modules_load_is_a_quiet_cancel(package: str, cli: str) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)])}
    done = subprocess.run(
        [sys.executable, "-c", _INTERRUPTED_IMPORT, package, cli],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        check=False,
    )
    assert (done.returncode, done.stderr, done.stdout) == (130, "cancelled\n", "")
