"""A control group of the ``pids`` controller that caps the processes and threads of
what a test starts in it (``pids.max``), as a host out of them (``ulimit -u``,
``threads-max``) refuses the next one (``EAGAIN``). ``RLIMIT_NPROC`` cannot stand in
for it: root, whom these tests need, is not held to it. Made under cgroup v1's ``pids``
hierarchy or cgroup v2's, and removed after; ``no_pids_cgroup`` says why none can be
made here (not root, no writable hierarchy)."""

from __future__ import annotations

import contextlib
import os
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

#: Where a ``pids`` hierarchy may be mounted (v1's own, v2's unified ones).
_ROOTS = (Path("/sys/fs/cgroup/pids"), Path("/sys/fs/cgroup/unified"), Path("/sys/fs/cgroup"))


def _root() -> Path | None:
    for root in _ROOTS:
        writable = (root / "cgroup.procs").exists() and os.access(root, os.W_OK)
        if writable and (root.name == "pids" or "pids" in _controllers(root)):
            return root
    return None


def _controllers(root: Path) -> str:
    try:
        return (root / "cgroup.subtree_control").read_text()
    except OSError:
        return ""


def no_pids_cgroup() -> str | None:
    """Why no ``pids`` control group can be made here, or ``None``."""
    if os.geteuid() != 0:
        return "needs root, to make a pids control group (root is not held to ulimit -u)"
    if _root() is None:
        return "no writable cgroup hierarchy with the pids controller"
    return None


@contextlib.contextmanager
def pids_cgroup(limit: int) -> Iterator[tuple[Path, Callable[[], None]]]:
    """A new group whose ``pids.max`` is ``limit``, and a ``preexec_fn`` that puts the
    child it runs in into it; the group is emptied (each process left is SIGKILLed,
    by its id) and removed after."""
    root = _root()
    assert root is not None, no_pids_cgroup()
    group = root / f"gguf-pipeline-test-{uuid.uuid4().hex[:12]}"
    group.mkdir()
    (group / "pids.max").write_text(f"{limit}\n")

    def join() -> None:
        (group / "cgroup.procs").write_text(f"{os.getpid()}\n")

    try:
        yield group, join
    finally:
        for line in (group / "cgroup.procs").read_text().split():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(line), 9)
        for _ in range(200):
            with contextlib.suppress(OSError):
                group.rmdir()
                break
            time.sleep(0.05)  # the killed processes' exits, counted in the group
