"""Test hosts on one machine: each its own Linux network namespace *and* mount
namespace (a private ``/dev/shm`` and ``/tmp``, so that shared memory cannot silently
cross "hosts"), joined by veth pairs to a bridge, with a Ray node in each: the head in
the first, a worker in each other, each with its own ``--node-ip-address`` and
``--temp-dir``. Without Ray (``up(..., ray=False)``), each host holds only a process
to enter it by, and this machine reaches the hosts at ``root_address`` on the bridge.

Names and the subnet are drawn at random per cluster (``gpb<tag>``, ``gpn<tag><i>``,
``gpv<tag><i>``, ``10.<a>.<b>.0/24``), so that two test sessions on one machine do not
meet. ``TestHosts.down()`` removes everything it made: it kills every process of each
namespace, then the namespaces, the veth pairs and the bridge. Root only.

Also when pytest is interrupted: each cluster records its names under ``REGISTRY``
with its owner (this process's pid and start time) as it comes up; ``down`` runs at
exit (``atexit``) if nothing called it, and every ``up`` first removes what the records
of owners no longer running name (``sweep_orphans``), never a live session's.

``hosts_up(...)`` and ``shared_model(...)`` are the module fixtures' bodies: the
hosts up and down, and a model file at a path every host sees (``/var/tmp``, not the
hosts' private ``/tmp``).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
#: One record per cluster up: its owner and its names (removed when it is down).
REGISTRY = Path("/var/tmp/gpp-netns-hosts")
RAY_PORT = 6379
#: What ``ray start`` logs once its node's processes are up (GCS, raylet, sockets).
STARTED = "Ray runtime started."
#: How long a host's Ray node may take to start on a loaded machine.
START_S = 180.0
#: Runs a command in a private mount namespace with its own /dev/shm and /tmp.
_PRIVATE = (
    "unshare", "--mount", "--propagation", "private", "sh", "-c",
    'mount -t tmpfs tmpfs /dev/shm && mount -t tmpfs tmpfs /tmp && exec "$@"', "sh",
)  # fmt: skip


def unavailable() -> str | None:
    """Why this machine cannot make test hosts (``None``: it can)."""
    if os.geteuid() != 0:
        return "needs root for network and mount namespaces (ip netns, unshare --mount)"
    for tool in ("ip", "unshare", "nsenter"):
        if shutil.which(tool) is None:
            return f"needs {tool} (iproute2, util-linux)"
    for what, path in (("checkout", ROOT), ("interpreter", Path(sys.executable))):
        for private in ("/tmp", "/dev/shm"):
            if Path(private) in Path(os.path.abspath(path)).parents:
                return (
                    f"the {what} at {path} is under {private}, which each test host "
                    "replaces with its own: clone the repository elsewhere"
                )
    return None


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


def _ray() -> str:
    return str(Path(sys.executable).with_name("ray"))


class TestHosts:
    """``count`` hosts; host ``i`` (1-based) is ``namespace(i)`` at ``address(i)``."""

    __test__ = False  # not a test class, whatever pytest thinks of its name

    def __init__(self, count: int = 3) -> None:
        self.count = count
        self.tag = secrets.token_hex(3)
        a, b = 64 + secrets.randbelow(64), secrets.randbelow(250) + 1
        self.subnet = f"10.{a}.{b}"
        self.bridge = f"gpb{self.tag}"
        #: This machine's own address on the bridge (hosts without Ray only).
        self.root_address = f"{self.subnet}.254"
        self.anchors: dict[int, subprocess.Popen[bytes]] = {}  # host -> its `ray start`
        self.logs: dict[int, Path] = {}
        self._starts: dict[int, int] = {}  # host -> STARTED lines in its log before its start
        self.cut_off: set[int] = set()  # hosts whose cable is out (``cut``)

    def namespace(self, i: int) -> str:
        return f"gpn{self.tag}{i}"

    def veth(self, i: int) -> str:
        return f"gpv{self.tag}{i}"

    def address(self, i: int) -> str:
        return f"{self.subnet}.{i}"

    @property
    def head_address(self) -> str:
        return f"{self.address(1)}:{RAY_PORT}"

    # -- up ------------------------------------------------------------------------------
    def _record(self) -> Path:
        return REGISTRY / f"{self.tag}.json"

    def up(self, log_dir: Path, *, ray: bool = True) -> None:
        sweep_orphans()
        REGISTRY.mkdir(mode=0o700, exist_ok=True)
        owner = {"pid": os.getpid(), "start": _start_time(os.getpid()), "tag": self.tag,
                 "count": self.count}  # fmt: skip
        self._record().write_text(json.dumps(owner))
        atexit.register(self.down)
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("link", "set", self.bridge, "up")
        if not ray:
            _ip("addr", "add", f"{self.root_address}/24", "dev", self.bridge)
        for i in range(1, self.count + 1):
            ns = self.namespace(i)
            _ip("netns", "add", ns)
            _ip("link", "add", self.veth(i), "type", "veth", "peer", "name", "eth0", "netns", ns)
            _ip("link", "set", self.veth(i), "master", self.bridge, "up")
            _ip("-n", ns, "addr", "add", f"{self.address(i)}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", ns, "link", "set", "lo", "up")
        if not ray:
            env = dict(os.environ)
            env.pop("GGUF_PIPELINE_TEST_TAG", None)  # the hosts outlive a test's process check
            for i in range(1, self.count + 1):
                self.anchors[i] = subprocess.Popen(
                    ["ip", "netns", "exec", self.namespace(i), *_PRIVATE, "sleep", "infinity"],
                    stdin=subprocess.DEVNULL,
                    env=env,
                )
            for i in range(1, self.count + 1):  # in its namespaces, mounts made, once it sleeps
                deadline = time.monotonic() + 30
                comm = Path(f"/proc/{self.anchors[i].pid}/comm")
                while comm.read_text().strip() != "sleep":
                    if self.anchors[i].poll() is not None or time.monotonic() > deadline:
                        raise RuntimeError(f"host {i}'s anchor did not start")
                    time.sleep(0.01)
            return
        for i in range(1, self.count + 1):
            self.start_ray(i, log_dir)
        for i in range(1, self.count + 1):
            self.wait_started(i)

    def start_ray(self, i: int, log_dir: Path) -> None:
        """Start host ``i``'s Ray node (again, in a fresh mount namespace)."""
        common = [
            f"--node-ip-address={self.address(i)}", "--temp-dir=/tmp/ray", "--num-cpus=1",
            "--object-store-memory=100000000", "--disable-usage-stats", "--block",
        ]  # fmt: skip
        if i == 1:
            role = ["--head", f"--port={RAY_PORT}", "--include-dashboard=false"]
        else:
            role = [f"--address={self.head_address}"]
        log = log_dir / f"ray-host{i}.log"
        self.logs[i] = log
        self._starts[i] = log.read_text().count(STARTED) if log.exists() else 0
        # The test cluster's own authentication, whatever this machine's home holds: Ray
        # (2.5x) starts a head in token mode where ~/.ray/auth_token exists (a local
        # ray.init() writes one) but the nodes joining it in the default mode, so every
        # node failed to join ("InvalidAuthToken").
        env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0", RAY_AUTH_MODE="disabled")
        env.pop("GGUF_PIPELINE_TEST_TAG", None)
        cmd = ["ip", "netns", "exec", self.namespace(i), *_PRIVATE, _ray(), "start", *role]
        with log.open("ab") as out:
            self.anchors[i] = subprocess.Popen(
                [*cmd, *common], stdout=out, stderr=out, stdin=subprocess.DEVNULL, env=env, cwd=ROOT
            )

    def wait_started(self, i: int, timeout_s: float = START_S) -> None:
        """Until host ``i``'s Ray node is up: a driver that connects before the head's
        raylet has its socket dies in Ray's core worker. ``RuntimeError`` with the log's
        end if the node's ``ray start`` ended or the time passed."""
        deadline = time.monotonic() + timeout_s
        while self.logs[i].read_text().count(STARTED) <= self._starts[i]:
            ended = self.anchors[i].poll() is not None
            if ended or time.monotonic() > deadline:
                why = "ended" if ended else f"did not start in {timeout_s:.0f} s"
                tail = self.logs[i].read_text()[-2000:]
                raise RuntimeError(f"host {i}'s Ray node {why}:\n{tail}")
            time.sleep(0.2)

    def anchor(self, i: int) -> int:
        """A process of host ``i``'s namespaces (its ``ray start``), to enter them by."""
        return self.anchors[i].pid

    def driver(self, args: list[str]) -> list[str]:
        """The command line of a driver run on the head's host (its network and mount
        namespaces, this worktree's code)."""
        return ["nsenter", "-t", str(self.anchor(1)), "-m", "-n", f"--wd={ROOT}",
                sys.executable, *args]  # fmt: skip

    def on_host(self, i: int, command: str) -> str:
        """Run a shell command in host ``i``'s network and mount namespaces."""
        return subprocess.run(
            ["nsenter", "-t", str(self.anchor(i)), "-m", "-n", "sh", "-c", command],
            capture_output=True, text=True, check=False, timeout=30,
        ).stdout  # fmt: skip

    # -- faults --------------------------------------------------------------------------
    def cut(self, i: int) -> None:
        """Host ``i``'s cable out: its port on the bridge down, every packet to or from it
        lost, no FIN, no reset; its processes run on."""
        _ip("link", "set", self.veth(i), "down")
        self.cut_off.add(i)

    def mend(self, i: int) -> None:
        _ip("link", "set", self.veth(i), "up")
        self.cut_off.discard(i)

    def pids(self, i: int) -> list[int]:
        out = _ip("netns", "pids", self.namespace(i), check=False).stdout
        return [int(p) for p in out.split()]

    def lose(self, i: int) -> None:
        """Host ``i`` lost: every process in it killed."""
        for _ in range(5):
            pids = self.pids(i)
            if not pids:
                return
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.2)

    # -- down ----------------------------------------------------------------------------
    def down(self) -> None:
        atexit.unregister(self.down)
        for proc in self.anchors.values():  # Ray's own shutdown: its processes exit
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 15
        for proc in self.anchors.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(max(0.1, deadline - time.monotonic()))
        for i in range(1, self.count + 1):
            self.lose(i)
        for proc in self.anchors.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(5)
        self._remove_names()

    def _remove_names(self) -> None:
        for i in range(1, self.count + 1):
            _ip("netns", "del", self.namespace(i), check=False)
            _ip("link", "del", self.veth(i), check=False)
        _ip("link", "del", self.bridge, check=False)
        self._record().unlink(missing_ok=True)

    def left(self) -> list[str]:
        """What of these hosts is still on the machine (after ``down``)."""
        out = []
        namespaces = _ip("netns", "list", check=False).stdout
        links = _ip("link", "show", check=False).stdout
        for i in range(1, self.count + 1):
            if self.namespace(i) in namespaces:
                out.append(f"namespace {self.namespace(i)}")
            if self.veth(i) in links:
                out.append(f"link {self.veth(i)}")
        if self.bridge in links:
            out.append(f"bridge {self.bridge}")
        return out


def _start_time(pid: int) -> str | None:
    """A process's start time (ticks since boot; with the pid, it names the process)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def sweep_orphans() -> list[str]:
    """Remove the hosts whose owner (a test session, interrupted) no longer runs: every
    process in their namespaces, the namespaces, the veth pairs and the bridge; the tags
    removed. A live session's hosts are never touched."""
    swept = []
    for record in sorted(REGISTRY.glob("*.json")) if REGISTRY.is_dir() else []:
        try:
            owner = json.loads(record.read_text())
            pid, start, tag, count = owner["pid"], owner["start"], owner["tag"], owner["count"]
        except (OSError, ValueError, KeyError):
            continue
        if _start_time(int(pid)) == start:
            continue  # its session runs
        hosts = TestHosts(int(count))
        hosts.tag = str(tag)
        hosts.bridge = f"gpb{tag}"
        for i in range(1, hosts.count + 1):
            hosts.lose(i)
        hosts._remove_names()
        swept.append(str(tag))
    return swept


@contextlib.contextmanager
def hosts_up(count: int, log_dir: Path, *, ray: bool = False) -> Iterator[TestHosts]:
    """``count`` test hosts up (``pytest.skip`` with the reason where they cannot be),
    then down, nothing of them left."""
    import pytest

    reason = unavailable()
    if reason is not None:
        pytest.skip(reason)
    h = TestHosts(count)
    try:
        h.up(log_dir, ray=ray)
        yield h
    finally:
        h.down()
        assert h.left() == []


@contextlib.contextmanager
def shared_model(path: str) -> Iterator[str]:
    """The model file at ``path`` copied where every test host sees it (not under their
    private ``/tmp``), removed after."""
    folder = Path("/var/tmp") / f"gpp-test-{secrets.token_hex(4)}"
    folder.mkdir()
    try:
        shutil.copy(path, folder / Path(path).name)
        yield str(folder / Path(path).name)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
