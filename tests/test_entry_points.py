"""``python -m runplan | runtime_cupy | runtime_sim`` interrupted while their modules
load (Ctrl-C in the first second of a command) print ``cancelled`` and exit 130, as
they do once the command runs, not a ``KeyboardInterrupt`` traceback; with ``--json``,
the ``Cancelled`` object on standard output (none after the command's own)."""

from __future__ import annotations

import json
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

TARGET = sys.argv[2]

class Interrupting(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname == TARGET:
            raise KeyboardInterrupt

sys.meta_path.insert(0, Interrupting())
sys.argv = [sys.argv[1], *sys.argv[3:]]
runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
"""

# A fresh interpreter where the command prints its JSON and a Ctrl-C comes after (one
# that it did not meet); then ``python -m PACKAGE``.
_INTERRUPTED_AFTER_PRINTING = """
import importlib, runpy, sys
from runplan.json_errors import print_json

def main():
    print_json({"error": {"type": "Cancelled", "message": "the command's own"}})
    raise KeyboardInterrupt

importlib.import_module(sys.argv[2]).main = main
sys.argv = [sys.argv[1], *sys.argv[3:]]
runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
"""

COMMANDS = [
    ("runplan", "runplan.cli"),
    ("runtime_cupy", "runtime_cupy.cli.main"),
    ("runtime_sim", "runtime_sim.cli"),
]


def _python(script: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)])}
    return subprocess.run(
        [sys.executable, "-c", script, *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        check=False,
    )


@pytest.mark.parametrize(("package", "cli"), COMMANDS)
def test_ctrl_c_while_the_modules_load_is_a_quiet_cancel(package: str, cli: str) -> None:
    done = _python(_INTERRUPTED_IMPORT, package, cli)
    assert (done.returncode, done.stderr, done.stdout) == (130, "cancelled\n", "")


@pytest.mark.parametrize(("package", "cli"), COMMANDS)
def test_ctrl_c_while_the_modules_load_with_json_is_the_cancelled_object(
    package: str, cli: str
) -> None:
    """``--json``: standard output is one JSON object, the ``Cancelled`` error (it was
    empty), as once the command runs."""
    done = _python(_INTERRUPTED_IMPORT, package, cli, "run", "--json")
    assert (done.returncode, done.stderr) == (130, "cancelled\n")
    assert done.stdout.count("\n") == 1
    assert json.loads(done.stdout) == {"error": {"type": "Cancelled", "message": "cancelled"}}


@pytest.mark.parametrize(("package", "cli"), COMMANDS)
def test_ctrl_c_after_the_command_printed_its_json_prints_no_second_object(
    package: str, cli: str
) -> None:
    done = _python(_INTERRUPTED_AFTER_PRINTING, package, cli, "--json")
    assert (done.returncode, done.stderr) == (130, "cancelled\n")
    assert json.loads(done.stdout)["error"]["message"] == "the command's own"


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
    done = _python(_WITHOUT_EXTRAS, package)
    assert done.returncode == 0, done.stderr
    assert "usage:" in done.stdout
