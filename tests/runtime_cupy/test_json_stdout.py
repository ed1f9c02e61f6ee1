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
