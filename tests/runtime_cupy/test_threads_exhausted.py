"""A host out of processes and threads (``ulimit -u``, a control group's ``pids.max``,
``threads-max``) while a run's stages start: each failure names what ran out, exit 1,
nothing left behind, and the next run succeeds.

- A stage process that cannot start its lifeline watchdog or heartbeat thread logs one
  line naming the thread and what ran out, and exits 4, which the run's fault reads as
  ``exited with status 4 (it could not start a thread: ...)``; it was a
  ``RuntimeError: can't start new thread`` traceback, and a fault saying "exited with
  status 1".
- A stage process that cannot be forked: "[Errno 11] Resource temporarily unavailable"
  is followed by what ran out (and the process limit, ``ulimit -u``, where one binds).

Threads are capped by a ``pids`` control group (``tests.support.pids_cgroup``): root is
not held to ``RLIMIT_NPROC``. Needs root; skipped with the reason elsewhere."""

from __future__ import annotations

import errno
import json
import os
import socket
import subprocess
import sys

import pytest

from runplan.resource_limits import with_limit
from runtime_core.threads import LIMIT_REACHED
from runtime_cupy.hosts.local import describe_exit
from runtime_cupy.process.keys import new_secret
from runtime_cupy.process.stage_loss import EXIT_NO_THREAD
from tests.runtime_cupy.test_process_cli import _env
from tests.support.hygiene import run_resources
from tests.support.pids_cgroup import no_pids_cgroup, pids_cgroup

#: Real stage processes (the lanes: pyproject's markers; make fast leaves these out).
pytestmark = pytest.mark.process

RAN_OUT = "this host's or user's processes or threads ran out"  # a stage not forked
#: One thread per process wherever a library would start a pool of them (the count
#: of the host's CPUs): what the group holds is the runtime's own.
ONE_THREAD = {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
              "RAYON_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}  # fmt: skip


#: Two of the eight tasks a run of two stages holds at most (with ``ONE_THREAD``) short.
TASKS = 6


def _skip_without_cgroup() -> None:
    reason = no_pids_cgroup()
    if reason is not None:
        pytest.skip(reason)


def test_a_stage_that_cannot_start_a_thread_exits_4_naming_it() -> None:
    """The stage process alone in a group of one task (its main thread): its first
    thread, the lifeline's watchdog, is refused."""
    _skip_without_cgroup()
    control, stage_end = socket.socketpair()
    lifeline_r, lifeline_w = os.pipe()
    argv = [sys.executable, "-m", "runtime_cupy.process.stage_process", "--run-label", "t",
            "--stage-index", "0", "--stage-count", "1", "--node-id", "stage-0",
            "--orchestrator-id", "orch", "--control-fd", str(stage_end.fileno()),
            "--lifeline-fd", str(lifeline_r), "--worker", "numpy"]  # fmt: skip
    try:
        with pids_cgroup(1) as (_, join):
            proc = subprocess.run(
                argv, input=new_secret().hex() + "\n", capture_output=True, text=True,
                pass_fds=(stage_end.fileno(), lifeline_r), env={**_env(), **ONE_THREAD},
                preexec_fn=join, timeout=120, check=False,
            )  # fmt: skip
    finally:
        control.close()
        stage_end.close()
        os.close(lifeline_r)
        os.close(lifeline_w)
    assert proc.returncode == EXIT_NO_THREAD, (proc.returncode, proc.stderr[-3000:])
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    line = "ERROR cannot start the stage's lifeline watchdog thread (can't start new thread): "
    assert line + LIMIT_REACHED in proc.stderr, proc.stderr[-3000:]


def test_a_run_whose_stages_run_out_of_threads_is_a_named_fault_then_runs(tiny: str) -> None:
    """The CLI in a group of ``TASKS``: its stages start, and run out of threads there
    (or the second cannot be forked); then the same run with room completes."""
    _skip_without_cgroup()
    argv = [sys.executable, "-m", "runtime_cupy", "--model", tiny, "--stages", "2",
            "--prompt-ids", "1,2,3", "--max-tokens", "4", "--worker", "numpy",
            "--json"]  # fmt: skip
    env = {**_env(), **ONE_THREAD}
    with pids_cgroup(TASKS) as (group, join):
        proc = subprocess.run(
            argv, capture_output=True, text=True, env=env, preexec_fn=join, timeout=120,
            check=False,
        )  # fmt: skip
        assert (group / "cgroup.procs").read_text() == ""  # every stage reaped
    assert proc.returncode == 1, (proc.returncode, proc.stderr[-3000:])
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    doc = json.loads(proc.stdout)
    assert doc["outcome"] == "faulted", doc
    assert RAN_OUT in doc["fault"] or LIMIT_REACHED in doc["fault"], doc["fault"]
    assert run_resources(doc["chain_id"]) == []
    again = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=120, check=False)
    assert again.returncode == 0, again.stderr[-3000:]
    assert json.loads(again.stdout)["outcome"] == "completed"


def test_what_ran_out_is_named_for_a_process_or_thread_refused_only() -> None:
    refused = OSError(errno.EAGAIN, os.strerror(errno.EAGAIN))
    spawning = with_limit(f"could not be started: {refused}", refused.errno, spawning=True)
    assert spawning == f"could not be started: {refused}; {RAN_OUT}" or spawning.startswith(
        f"could not be started: {refused}; {RAN_OUT}; the process limit (RLIMIT_NPROC, "
    )
    # EAGAIN of another call (a mapping under the locked-memory limit) says nothing of it
    assert with_limit("cannot be mapped", errno.EAGAIN) == "cannot be mapped"
    assert describe_exit(EXIT_NO_THREAD) == (
        f"exited with status 4 (it could not start a thread: {LIMIT_REACHED})"
    )
    assert describe_exit(1) == "exited with status 1"


def test_a_thread_refused_names_the_limits_set() -> None:
    """Under ``ulimit -v`` a thread's stack may be what is refused: its value is named."""
    script = (
        "import resource; from runtime_core.threads import thread_refused; "
        "resource.setrlimit(resource.RLIMIT_AS, (1 << 40, resource.RLIM_INFINITY)); "
        "print(thread_refused('x', RuntimeError(\"can't start new thread\")))"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=_env(),
        timeout=60, check=False,
    )  # fmt: skip
    assert done.stdout == (
        f"x (can't start new thread): {LIMIT_REACHED}; the address-space limit "
        f"(RLIMIT_AS, ulimit -v) is {1 << 40} bytes\n"
    ), done.stderr


@pytest.mark.parametrize(
    "prompt", [("--prompt-ids", "1,2,3"), ("--prompt", "hello world")], ids=["ids", "text"]
)
def test_a_cli_with_no_thread_left_is_a_named_setup_fault(
    tiny: str, prompt: tuple[str, str]
) -> None:
    """The CLI alone in a group of one task (its main thread): a text prompt is encoded
    without the tokenizers library's thread pool, which cannot be built (it was a
    ``PanicException`` traceback with a Rust backtrace, exit 1 and no object); the
    display of the stages starting has no thread for its refresh and goes without it
    (it was a ``RuntimeError`` traceback, exit 1 and no object), and the first stage
    cannot be forked: a setup fault naming what ran out."""
    _skip_without_cgroup()
    argv = [sys.executable, "-m", "runtime_cupy", "--model", tiny, "--stages", "2",
            *prompt, "--max-tokens", "4", "--worker", "numpy", "--json"]  # fmt: skip
    env = {**_env(), **ONE_THREAD}
    del env["TOKENIZERS_PARALLELISM"]  # the library tries its pool, as by default
    with pids_cgroup(1) as (_, join):
        proc = subprocess.run(
            argv, capture_output=True, text=True, env=env, preexec_fn=join, timeout=120,
            check=False,
        )  # fmt: skip
    if prompt[0] == "--prompt":  # encoded where the library's pool was refused
        assert "thread pool" in proc.stderr, proc.stderr[-3000:]
    assert proc.returncode == 1, (proc.returncode, proc.stderr[-3000:])
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    doc = json.loads(proc.stdout)
    fault = "the stages could not be started: [Errno 11] Resource temporarily unavailable; "
    assert fault + RAN_OUT in doc["fault"], doc["fault"]
    assert [s["pid"] for s in doc["stages"]] == [None, None], doc["stages"]
    assert run_resources(doc["chain_id"]) == []
