"""The CPUs a process may use (``runplan.cpus``): its affinity, within its cgroup's CPU
quota. Hand-made ``/proc`` and ``/sys`` trees for cgroup v1 and v2 as kernels and
container runtimes lay them out, and (as root) a real cgroup whose quota the kernel
applies to a child process."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from runplan.cpus import cgroup_cpu_limit, usable_cpus

V1_MOUNTS = """\
25 1 0:22 / /sys/fs/cgroup rw - tmpfs tmpfs rw,mode=755
31 25 0:27 / /sys/fs/cgroup/cpu,cpuacct rw,relatime shared:9 - cgroup cgroup rw,cpu,cpuacct
32 25 0:28 / /sys/fs/cgroup/memory rw,relatime shared:10 - cgroup cgroup rw,memory
"""
V2_MOUNTS = "30 1 0:26 / /sys/fs/cgroup rw,nosuid shared:4 - cgroup2 cgroup2 rw,nsdelegate\n"


def tree(tmp_path: Path, groups: str, mounts: str, files: dict[str, str]) -> str:
    (tmp_path / "proc/self").mkdir(parents=True)
    (tmp_path / "proc/self/cgroup").write_text(groups)
    (tmp_path / "proc/self/mountinfo").write_text(mounts)
    for name, text in files.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return str(tmp_path)


def affinity() -> int:
    return len(os.sched_getaffinity(0))


@pytest.mark.parametrize(
    ("groups", "mounts", "files", "limit"),
    [
        # cgroup v2, the process's own group limited (a pod's or `docker --cpus 1.5`)
        (
            "0::/kubepods/pod1/c1\n",
            V2_MOUNTS,
            {
                "sys/fs/cgroup/kubepods/pod1/c1/cpu.max": "150000 100000\n",
                "sys/fs/cgroup/kubepods/pod1/cpu.max": "max 100000\n",
            },
            1.5,
        ),
        # v2: an ancestor's limit is the one the kernel applies when it is lower
        (
            "0::/kubepods/pod1/c1\n",
            V2_MOUNTS,
            {
                "sys/fs/cgroup/kubepods/pod1/c1/cpu.max": "max 100000\n",
                "sys/fs/cgroup/kubepods/pod1/cpu.max": "50000 100000\n",
                "sys/fs/cgroup/kubepods/cpu.max": "400000 100000\n",
            },
            0.5,
        ),
        # v2 with no limit anywhere
        ("0::/user.slice\n", V2_MOUNTS, {"sys/fs/cgroup/user.slice/cpu.max": "max 100000\n"}, None),
        # v2 inside a container with a cgroup namespace: its own group is the mount's root
        ("0::/\n", V2_MOUNTS, {"sys/fs/cgroup/cpu.max": "200000 100000\n"}, 2.0),
        # v2 mounted from a sub-tree (no cgroup namespace): the path below the mount's root
        (
            "0::/docker/abc\n",
            "30 1 0:26 /docker/abc /sys/fs/cgroup rw - cgroup2 cgroup2 rw\n",
            {"sys/fs/cgroup/cpu.max": "300000 100000\n"},
            3.0,
        ),
        # v1, cpu and cpuacct together, the quota in its two files
        (
            "4:memory:/docker/abc\n3:cpu,cpuacct:/docker/abc\n0::/\n",
            V1_MOUNTS,
            {
                "sys/fs/cgroup/cpu,cpuacct/docker/abc/cpu.cfs_quota_us": "250000\n",
                "sys/fs/cgroup/cpu,cpuacct/docker/abc/cpu.cfs_period_us": "100000\n",
            },
            2.5,
        ),
        # v1 with no quota (-1)
        (
            "3:cpu,cpuacct:/\n",
            V1_MOUNTS,
            {
                "sys/fs/cgroup/cpu,cpuacct/cpu.cfs_quota_us": "-1\n",
                "sys/fs/cgroup/cpu,cpuacct/cpu.cfs_period_us": "100000\n",
            },
            None,
        ),
        # a mount point with a space, escaped in mountinfo
        (
            "0::/a\n",
            "30 1 0:26 / /sys/fs/my\\040cgroup rw - cgroup2 cgroup2 rw\n",
            {"sys/fs/my cgroup/a/cpu.max": "100000 100000\n"},
            1.0,
        ),
        # files that make no sense are no limit
        ("0::/a\n", V2_MOUNTS, {"sys/fs/cgroup/a/cpu.max": "lots\n"}, None),
        ("garbage\n", "garbage\n", {}, None),
    ],
)
def test_the_limit_is_the_lowest_quota_along_the_cgroups_ancestors(
    tmp_path: Path, groups: str, mounts: str, files: dict[str, str], limit: float | None
) -> None:
    root = tree(tmp_path, groups, mounts, files)
    assert cgroup_cpu_limit(root) == limit
    expected = affinity() if limit is None else min(affinity(), max(1, -(-limit // 1)))
    assert usable_cpus(root) == expected


def test_no_proc_means_no_limit(tmp_path: Path) -> None:
    assert cgroup_cpu_limit(str(tmp_path)) is None
    assert usable_cpus(str(tmp_path)) == affinity()


def _cpu_cgroup_parent() -> tuple[Path, bool] | None:
    """A folder to make a cgroup in whose CPU quota applies (v1's cpu hierarchy, or
    cgroup v2 with the cpu controller given to children), with whether it is v2."""
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        fields = line.split()
        dash = fields.index("-")
        fstype, options, point = fields[dash + 1], fields[dash + 3], Path(fields[4])
        if fstype == "cgroup" and "cpu" in options.split(","):
            return point, False
        if fstype == "cgroup2":
            try:
                given = (point / "cgroup.subtree_control").read_text().split()
            except OSError:
                continue
            if "cpu" in given:
                return point, True
    return None


@pytest.mark.skipif(os.geteuid() != 0, reason="making a cgroup needs root")
def test_a_worker_in_a_cgroup_of_one_cpu_takes_one_thread(tmp_path: Path) -> None:
    # The kernel's own cgroup: a child process in it with a quota of one CPU on a
    # machine of two or more cores. Its stage threads counted the cores (the affinity)
    # and ran that many threads on one CPU's time.
    if affinity() < 2:
        pytest.skip("one core: every count is already 1")
    found = _cpu_cgroup_parent()
    if found is None:
        pytest.skip("no cgroup hierarchy with the cpu controller to make a group in")
    parent, v2 = found
    group = parent / f"gguf-pipeline-test-{uuid.uuid4().hex[:8]}"
    try:
        group.mkdir()
    except OSError as exc:
        pytest.skip(f"cannot make a cgroup under {parent}: {exc}")
    try:
        if v2:
            (group / "cpu.max").write_text("100000 100000")
        else:
            (group / "cpu.cfs_period_us").write_text("100000")
            (group / "cpu.cfs_quota_us").write_text("100000")
        script = (
            "import os, sys\n"
            f"open({str(group / 'cgroup.procs')!r}, 'w').write(str(os.getpid()))\n"
            "from runtime_core.workers.cpu.kernels import default_threads\n"
            "print(len(os.sched_getaffinity(0)), default_threads())\n"
        )
        env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
        out = subprocess.run(
            [sys.executable, "-c", script],
            check=False,
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode == 0, out.stderr
        cores, threads = map(int, out.stdout.split())
        assert cores == affinity() and threads == 1
    finally:
        group.rmdir()
