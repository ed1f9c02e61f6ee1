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


# A fresh interpreter where the optional extras' packages cannot be imported, as in a
# venv of the default dependencies only; then every command's --help.
_WITHOUT_EXTRAS = """
import importlib.abc, runpy, sys

EXTRAS = ("prometheus_client", "starlette", "uvicorn", "ray", "cupy", "hypothesis", "pytest")

class Missing(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname.split(".")[0] in EXTRAS:
            raise ModuleNotFoundError(f"No module named {fullname!r}", name=fullname)

sys.meta_path.insert(0, Missing())
for name in list(sys.modules):
    if name.split(".")[0] in EXTRAS:
        del sys.modules[name]
import runtime_cupy.process.stage_process  # what a stage process imports
from runtime_cupy import generate, generate_batch  # the library, as the README shows
sys.argv = [sys.argv[1], "--help"]
runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
"""


@pytest.mark.parametrize("package", ["runplan", "runtime_cupy", "runtime_sim"])
def test_the_commands_run_without_the_extras(package: str) -> None:
    """``pip install gguf-pipeline`` (no ``serve`` extra): ``python -m runtime_cupy``
    and the library import (they once needed ``prometheus_client``, ``serve``'s, through
    the recovery module, so a Ray host of ``[ray]`` could not start a stage)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)])}
    done = subprocess.run(
        [sys.executable, "-c", _WITHOUT_EXTRAS, package],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert "usage:" in done.stdout
