"""The thread pool of the CPU kernels (``csrc/pool.c``) runs every item of a job once,
and a job returns only once its items are done, also when a worker was not running
while one job ended and the next began (a host busy with other processes).

Each participant owns a range of a job's items: a ticket word (the job's number and the
range's next item) and the range's end. ``pool_run`` used to store each range's end and
only then move its ticket to the new job. A worker still in a claim of the last job (it
had read that job's ticket, then was preempted) could read the new end with the old
ticket and claim an item past the last job's end: it ran the last job's function, with
that job's context (gone with its caller's frame), on an item that job never had, and
counted it in the new job's ``done``, so the new job could return while one of its
items was unfinished. An operation that adds to its output (a residual, a bias) then
added twice, or the next read a result half written: on a loaded host, now and then,
other logits than the same run computes alone (the CPU worker's greedy tokens parted
once from llama.cpp's in a full-suite process). The ticket now moves first, and the end
follows with a release store that a claim reads with acquire. (The pool before it, a
single ticket for the job, had the same race between its fields and its ticket.)

``tests/support/pool_order.c`` includes ``pool.c`` whole. It records, for jobs of 2 to
4 ranges, the order in which ``pool_run`` stores each range's ticket and end (every
range's end before its ticket on the code before the fix, in every run; the window
between the two stores is a few instructions, too short for a watching thread to catch
it on this host in 18 s of tries). It then runs jobs for ``SECONDS`` while a thread
watches that a range's end is never seen with the ticket of the job before, and checks
that every item of every job ran exactly once and nothing ran past a job's end.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from tests.support.kernels_tree import kernels_pythonpath

ROOT = Path(__file__).resolve().parents[4]
HARNESS = ROOT / "tests" / "support" / "pool_order.c"
CSRC = ROOT / "src" / "runtime_core" / "workers" / "cpu" / "csrc"
SECONDS = 3.0


def compiler() -> list[str]:
    cc = shlex.split(sysconfig.get_config_var("CC") or "cc")
    if shutil.which(cc[0]) is None:
        pytest.skip(f"no C compiler ({cc[0]}) to build the pool's harness")
    return cc


def test_a_worker_left_in_the_last_job_never_takes_an_item_of_the_next(tmp_path: Path) -> None:
    exe = tmp_path / "pool_order"
    # the compiler and the harness without a sanitizer's runtime (make sanitize-*)
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    build = [*compiler(), "-O2", "-pthread", "-I", str(CSRC), str(HARNESS), "-o", str(exe)]
    subprocess.run(build, check=True, capture_output=True, timeout=120, env=env)
    proc = subprocess.run(
        [str(exe), str(SECONDS)],
        check=False,
        capture_output=True,
        text=True,
        timeout=SECONDS + 60,
        env=env,
    )
    counts = dict(zip(*[iter(proc.stdout.split())] * 2, strict=True))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert counts["ends_before_tickets"] == "0" and counts["early_ends"] == "0"
    assert counts["wrong_cells"] == "0" and counts["stray_items"] == "0"
    assert int(counts["jobs"]) > 1000 and int(counts["looks"]) > 0


#: a product on 1000 threads in a fresh interpreter (the pool lives as long as its process):
#: the pool's workers it added, and whether its bits are the 1-thread product's. Counted
#: after a 2-thread product has made the pool's first worker: a sanitizer's runtime
#: starts a thread of its own at the process's first pthread_create (ThreadSanitizer's
#: background thread, under make sanitize-thread), which the count would take for a
#: worker.
MANY_THREADS = """
import os, numpy as np
from runtime_core.workers.cpu import _kernels
from tests.support.random_blocks import random_rows
rows = 32768  # items enough for 1000 threads (a job's items are groups of rows)
raw = random_rows(np.random.default_rng(0), "Q8_0", rows, 256, scale=0.1)
m = _kernels.Matrix([(raw, "Q8_0", rows, 256, 0)])
x = np.random.default_rng(1).standard_normal((64, 256)).astype(np.float32)
one, two, many = (np.zeros((64, rows), np.float32) for _ in range(3))
_kernels.linear(m, 64, x, None, None, None, None, False, False, one, None, False, 1)
_kernels.linear(m, 64, x, None, None, None, None, False, False, two, None, False, 2)
before = len(os.listdir("/proc/self/task"))
_kernels.linear(m, 64, x, None, None, None, None, False, False, many, None, False, 1000)
same = np.array_equal(one, two) and np.array_equal(one, many)
print(len(os.listdir("/proc/self/task")) - before, same)
"""


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="counts threads in /proc")
def test_a_product_runs_on_as_many_threads_as_the_worker_accepts() -> None:
    """The worker takes 1..1024 threads (``kernels.MAX_THREADS``); the pool stopped at 256
    participants without a word (255 workers and the caller), so a stage given 384
    cores of a two-socket host ran on 256."""
    proc = subprocess.run(
        [sys.executable, "-c", MANY_THREADS],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": kernels_pythonpath()},
    )
    assert proc.returncode == 0, proc.stderr
    added, same = proc.stdout.split()
    assert int(added) == 998 and same == "True"  # the 999 workers but the first
