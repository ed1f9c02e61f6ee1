"""``hosts.local.LocalStageHandle``: whether its stage process has exited, asked from any
thread. ``WarmChain.ready`` asks it from a caller's thread while the chain's loop polls
the same process; Popen's ``poll()`` answers "running" while another thread holds its
wait lock, so a CI run saw a chain ``ready`` with a stage killed and gone."""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace
from typing import Any

from runtime_cupy.hosts.local import LocalStageHandle
from tests.support.hygiene import wait_gone


def handle_of(proc: subprocess.Popen[bytes]) -> LocalStageHandle:
    launch: Any = SimpleNamespace(stage_index=0, node_id="node-0", device="cpu")
    channel: Any = None  # (not asked whether the stage exited)
    return LocalStageHandle(launch, proc, channel, -1, None, None)


def test_a_killed_stage_has_exited_while_another_thread_holds_the_wait_lock() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    handle = handle_of(proc)
    try:
        assert not handle.exited()
        proc.kill()
        assert not wait_gone([proc.pid], 10.0)
        with proc._waitpid_lock:  # type: ignore[attr-defined]  # as the other thread's poll
            assert handle.exited()
        assert proc.wait(10) == -9, "the peek left the process to be reaped by its Popen"
    finally:
        proc.kill()
        proc.wait()


def test_a_running_stage_has_not_exited_while_another_thread_holds_the_wait_lock() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    handle = handle_of(proc)
    try:
        with proc._waitpid_lock:  # type: ignore[attr-defined]
            assert not handle.exited()
    finally:
        proc.kill()
        proc.wait()
    assert handle.exited()
