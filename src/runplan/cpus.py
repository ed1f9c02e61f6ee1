"""How many CPUs this process may use: the cores it may run on (its affinity), and no
more than its cgroup's CPU quota allows (a container's ``--cpus``, a Kubernetes pod's
CPU limit), which the affinity does not show. A stage's threads, the launcher's split
of a host's cores between its stages and the hashing threads all count from here: a
pod limited to 4 CPUs on a 64-core node otherwise ran 64 threads, which the quota
throttles in turn, each step waiting for the last of them.

The quota is read as the kernel applies it: the lowest ``quota / period`` of the
process's cgroup and of every ancestor visible under the mount (cgroup v2's
``cpu.max``, or v1's ``cpu.cfs_quota_us`` and ``cpu.cfs_period_us`` of the hierarchy
that holds the ``cpu`` controller), rounded up to whole CPUs. Nothing readable, or no
limit, leaves the affinity's count.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from pathlib import Path


def usable_cpus(root: str = "/") -> int:
    """The CPUs this process may use (at least 1); ``root``: where ``/proc`` and
    ``/sys`` are found (a test's own tree)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    quota = cgroup_cpu_limit(root)
    if quota is not None:
        cores = min(cores, max(1, math.ceil(quota)))
    return max(1, cores)


def cgroup_cpu_limit(root: str = "/") -> float | None:
    """The CPUs (``quota / period``) this process's cgroups allow it, the lowest along
    its cgroup's ancestors; None where no limit is set or none can be read."""
    base = Path(root)
    try:
        groups = (base / "proc/self/cgroup").read_text()
        mounts = (base / "proc/self/mountinfo").read_text()
    except OSError:
        return None
    limits = [
        limit
        for folder, v2 in _cpu_folders(base, groups, mounts)
        for limit in [_limit_v2(folder) if v2 else _limit_v1(folder)]
        if limit is not None
    ]
    return min(limits) if limits else None


def _cpu_folders(base: Path, groups: str, mounts: str) -> Iterator[tuple[Path, bool]]:
    """The folders of the process's ``cpu`` cgroup and its ancestors up to the mount's
    root, with whether each is cgroup v2's."""
    for line in groups.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        v2 = controllers == ""
        if not v2 and "cpu" not in controllers.split(","):
            continue
        mount = _mount_of(mounts, v2)
        if mount is None:
            continue
        mount_root, mount_point = mount
        # The cgroup's path under the mount: a mount of a sub-tree (a container's own
        # cgroup without a cgroup namespace) holds the part below its root.
        if mount_root != "/" and (path + "/").startswith(mount_root.rstrip("/") + "/"):
            path = path[len(mount_root.rstrip("/")) :]
        elif mount_root != "/":
            path = "/"
        top = base / mount_point.lstrip("/")
        folder = top / path.strip("/") if path.strip("/") else top
        while True:
            yield folder, v2
            if folder == top or top not in folder.parents:
                break
            folder = folder.parent


def _mount_of(mounts: str, v2: bool) -> tuple[str, str] | None:
    """The root and the mount point of the cgroup2 mount (``v2``) or of the v1
    hierarchy holding the ``cpu`` controller, from ``/proc/self/mountinfo``."""
    for line in mounts.splitlines():
        fields = line.split()
        if "-" not in fields:
            continue
        dash = fields.index("-")
        if dash < 5 or len(fields) < dash + 4:
            continue
        fstype, options = fields[dash + 1], fields[dash + 3]
        if v2 and fstype == "cgroup2":
            return _unescape(fields[3]), _unescape(fields[4])
        if not v2 and fstype == "cgroup" and "cpu" in options.split(","):
            return _unescape(fields[3]), _unescape(fields[4])
    return None


def _unescape(field: str) -> str:
    """mountinfo's octal escapes (``\\040`` for a space) undone."""
    if "\\" not in field:
        return field
    out, i = [], 0
    while i < len(field):
        if field[i] == "\\" and i + 3 < len(field) and field[i + 1 : i + 4].isdigit():
            out.append(chr(int(field[i + 1 : i + 4], 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


def _limit_v2(folder: Path) -> float | None:
    """``cpu.max``: ``max PERIOD`` (no limit) or ``QUOTA PERIOD``."""
    try:
        quota, period = (folder / "cpu.max").read_text().split()[:2]
        if quota == "max":
            return None
        return _ratio(int(quota), int(period))
    except (OSError, ValueError):
        return None


def _limit_v1(folder: Path) -> float | None:
    """``cpu.cfs_quota_us`` (-1: no limit) over ``cpu.cfs_period_us``."""
    try:
        quota = int((folder / "cpu.cfs_quota_us").read_text().strip())
        period = int((folder / "cpu.cfs_period_us").read_text().strip())
    except (OSError, ValueError):
        return None
    return _ratio(quota, period)


def _ratio(quota: int, period: int) -> float | None:
    return quota / period if quota > 0 and period > 0 else None
