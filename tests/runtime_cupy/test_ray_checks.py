"""What the Ray tests read of this machine's processes (``tests/support/ray_checks.py``)
reads any process's command line: one with bytes that are not UTF-8 (another session's
test of such an argument) is looked past, not a ``UnicodeDecodeError`` that fails the
check of a run's leftovers, whoever started it."""

from __future__ import annotations

import os
import signal
import subprocess

from tests.support.ray_checks import cmdline, run_processes, supervisors, wait_until


def test_a_command_line_that_is_not_utf8_is_read_and_looked_past() -> None:
    # A shell that waits for its sleep (no exec): its own command line keeps the bytes.
    proc = subprocess.Popen(
        [b"sh", b"-c", b"sleep 30; true", b"sh", b"\xff\xfe"], start_new_session=True
    )
    try:
        assert wait_until(lambda: not cmdline(proc.pid).startswith("sh -c"), 10) is False
        assert "\ufffd" in cmdline(proc.pid), cmdline(proc.pid)
        assert run_processes("run-0") == []
        assert supervisors([proc.pid]) == []
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
