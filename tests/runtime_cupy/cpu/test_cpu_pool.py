"""The thread pool of the CPU kernels (``csrc/pool.c``) runs every item of a job once,
and a job returns only once its items are done, also when a worker was not running
while one job ended and the next began (a host busy with other processes).

``pool_run`` used to store a job's fields (function, context, item count) and only then
move the ticket from the last job to it. A worker still in the last job (it had seen
that job's number, then was preempted) could read the new item count with the old
ticket and claim an item past the last job's end: it ran the new job's function on an
item that another thread ran too, and counted it in the new job's ``done``, so the job
could return while one of its items was unfinished. An operation that adds to its
output (a residual, a bias) then added twice, or the next read a result half written:
on a loaded host, now and then, other logits than the same run computes alone (the
CPU worker's greedy tokens parted once from llama.cpp's in a full-suite process). The
ticket now moves first, and the fields follow with release stores.

``tests/support/pool_order.c`` includes ``pool.c`` whole and watches, from another
thread, that a job's context is never seen before the ticket has moved to that job,
and that every item of every job ran exactly once. On the code before the fix it saw a
context early within 3 s in 6 runs of 6 (measured on a loaded 2-core host, mostly
within 0.4 s; 2 of them also caught items run twice); on this code it never can: the
acquire load of the context orders the load of the ticket after the store that moved it.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
HARNESS = ROOT / "tests" / "support" / "pool_order.c"
CSRC = ROOT / "src" / "runtime_cupy" / "cpu" / "csrc"
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
    assert counts["early_fields"] == "0" and counts["wrong_cells"] == "0"
    assert int(counts["jobs"]) > 1000 and int(counts["looks"]) > 0
