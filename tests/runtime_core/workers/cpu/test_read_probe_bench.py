"""benchmarks/cpu_decode.py's read probe (``benchmarks/csrc/read_probe.c``) builds and
reads: a rate for one and two threads, and a usage error for bad arguments."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
from benchmarks import cpu_decode

#: the compiler cpu_decode builds the probe with (``CC``, else gcc)
CC = (shlex.split(os.environ.get("CC", "gcc")) or ["gcc"])[0]
pytestmark = pytest.mark.skipif(shutil.which(CC) is None, reason=f"no {CC} to build the probe")


def test_the_probe_builds_and_reports_a_rate(tmp_path: Path) -> None:
    probe = cpu_decode.build_read_probe(tmp_path)
    assert isinstance(probe, Path), probe
    for threads in ("1", "2"):
        done = subprocess.run(
            [str(probe), threads, "16", "2"], capture_output=True, text=True, check=True
        )
        rate, sink = done.stdout.split()
        assert float(rate) > 1e8, done.stdout  # bytes a second: at least 0.1 GB/s
        assert sink in ("0", "1")
    bad = subprocess.run([str(probe), "0", "16", "2"], capture_output=True, text=True, check=False)
    assert bad.returncode == 2 and "bad THREADS 0" in bad.stderr
