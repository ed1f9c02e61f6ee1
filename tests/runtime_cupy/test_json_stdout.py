"""``--json``'s standard output holds the command's JSON only: what others write there
while the command runs (Ray's driver printing a dead raylet's lines, a library's
``print``, a child process) goes to standard error (``cli.json_stdout``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# Writes to stdout every way another party might, inside the block, then the JSON.
_NOISY = """
import os, subprocess, sys
from runtime_cupy.cli.json_stdout import json_stdout, write_json

print("before")  # before the block: stdout as it was
with json_stdout(True):
    print("(raylet) Raylet is terminated")
    sys.stdout.write("a library's write\\n")
    os.write(1, b"a raw write\\n")
    subprocess.run([sys.executable, "-c", "print('a child')"], check=True)
    write_json({"outcome": "completed", "tokens": [1, 2]})
print("after")  # the block restored stdout
"""


def test_only_the_json_reaches_stdout_while_others_write_there() -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)])}
    done = subprocess.run(
        [sys.executable, "-c", _NOISY], capture_output=True, text=True, env=env, check=True
    )
    lines = done.stdout.splitlines()
    assert lines[0] == "before" and lines[-1] == "after" and len(lines) == 3, done.stdout
    assert json.loads(lines[1]) == {"outcome": "completed", "tokens": [1, 2]}
    for noise in ("(raylet) Raylet is terminated", "a library's write", "a raw write", "a child"):
        assert noise in done.stderr


# The reader of stdout gone before the command ends: stdout is given back all the same.
_READER_GONE = """
import os, sys
from runtime_cupy.cli.json_stdout import json_stdout, write_json

with json_stdout(True):
    try:
        write_json({"a": 1})
    except BrokenPipeError:
        pass
assert sys.stdout is not sys.stderr, "sys.stdout was left pointing at stderr"
assert os.path.samestat(os.fstat(1), os.fstat(sys.__stdout__.fileno())), "fd 1 moved"
assert not os.path.samestat(os.fstat(1), os.fstat(2)), "fd 1 left on stderr"
sys.stderr.write("restored\\n")
"""


def test_stdout_is_given_back_when_its_reader_went_away() -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)])}
    proc = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(0.5); " + _READER_GONE.replace("\n", "\n")],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True,
    )  # fmt: skip
    assert proc.stdout is not None
    proc.stdout.close()  # the reader goes before anything is written
    err = proc.stderr.read() if proc.stderr else ""
    assert proc.wait(30) == 0, err
    assert "restored" in err
