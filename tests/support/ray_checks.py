"""What the Ray tests check after a run, on a host (or, in a namespace, through
``/proc`` of this machine: every test host shares this kernel's process table): no stage
process and no supervisor actor of the run left, nothing of its shared memory or run
folder."""

from __future__ import annotations

import os
import time
from collections.abc import Iterable
from pathlib import Path

from runtime_cupy.process.names import run_label
from tests.support.hygiene import alive

STAGE_ENTRY = "runtime_cupy.hosts.ray.stage_entry"
SUPERVISOR_TITLE = "StageSupervisor"


def cmdline(pid: int) -> str:
    try:
        return (
            Path(f"/proc/{pid}/cmdline")
            .read_bytes()
            .replace(b"\0", b" ")
            .decode("utf-8", "replace")
        )
    except OSError:
        return ""


def ppid(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return 0


def run_processes(run_id: str) -> list[int]:
    """Live stage processes of the run (anywhere on this kernel), by its label."""
    found = []
    needle = f"--run-label {run_label(run_id)} "
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            line = cmdline(int(entry.name))
            if STAGE_ENTRY in line and needle in line and alive(int(entry.name)):
                found.append(int(entry.name))
    return found


def descends_from(pid: int, ancestor: int) -> bool:
    """Whether ``ancestor`` is ``pid``'s parent, or its parent's, and so on."""
    seen = 0
    while pid > 1 and seen < 64:  # a chain of parents is short; a loop is not followed
        pid = ppid(pid)
        if pid == ancestor:
            return True
        seen += 1
    return False


def supervisors(among: Iterable[int] | None = None) -> list[int]:
    """Live Ray workers that hold a stage supervisor (Ray titles them after the actor):
    those of the processes ``among`` (a test's hosts' processes), else those of the Ray
    nodes this process started (their raylets are its children). Another session's
    cluster on the host is never looked at."""
    mine = None if among is None else set(among)
    me = os.getpid()
    found = []
    for entry in Path("/proc").iterdir():
        pid = int(entry.name) if entry.name.isdigit() else 0
        if not pid or (mine is not None and pid not in mine):
            continue
        if SUPERVISOR_TITLE not in cmdline(pid) or not alive(pid):
            continue
        if mine is not None or descends_from(pid, me):
            found.append(pid)
    return found


def wait_until(check: object, timeout_s: float) -> object:
    """Call ``check()`` until it returns something falsy or ``timeout_s`` passes; its
    last value."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()  # type: ignore[operator]
        if not value or time.monotonic() > deadline:
            return value
        time.sleep(0.1)
